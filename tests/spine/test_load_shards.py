"""opd/spine/load_shards.py on one gloo rank, in a subprocess of its own (a process group in the
pytest worker would outlive a failing test): a buffer kept in the state dict crosses by
broadcast, and a file whose tensor does not fit the model is refused, naming both shapes.
(The 2-rank scatter of uneven rows is tests/spine/test_sharded.py's.)"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from opd.teachers.launch import free_port

SCRIPT = textwrap.dedent("""
    import sys
    from pathlib import Path

    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.fsdp import fully_shard

    from opd.spine.dist import World
    from opd.spine.load_shards import file_keys, params_on_meta, stream_weights, weight_files

    out, port = Path(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(5, 3)
            self.register_buffer("scale", torch.zeros(3))   # saved in the state dict

    def load(weights, name):
        (out / name).mkdir()
        save_file(weights, str(out / name / "model.safetensors"))
        with params_on_meta():
            model = Scaled()
        assert model.lin.weight.is_meta and not model.scale.is_meta
        fully_shard(model)
        model.to_empty(device="cpu")
        files = weight_files(out / name)
        stream_weights(model, files, file_keys(model, files), World(sharded=True), torch.float32)
        return model

    torch.manual_seed(0)
    good = {"lin.weight": torch.randn(3, 5), "lin.bias": torch.randn(3), "scale": torch.tensor([0.5, 2.0, -1.0])}
    model = load(good, "good")
    assert torch.equal(model.lin.weight.full_tensor(), good["lin.weight"])
    assert torch.equal(model.lin.bias.full_tensor(), good["lin.bias"])
    assert torch.equal(model.scale, good["scale"])          # not a DTensor: broadcast whole
    try:
        load({**good, "lin.weight": torch.randn(4, 5)}, "bad")
    except ValueError as e:
        print("refused:", e)
    dist.destroy_process_group()
    print("ok")
""")


def test_a_state_dict_buffer_is_broadcast_and_a_tensor_of_another_shape_is_refused(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), str(free_port())], env=env,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "refused: lin.weight: the file holds (4, 5), the model (3, 5)" in r.stdout, r.stdout
    assert r.stdout.strip().endswith("ok")
