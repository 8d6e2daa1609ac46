"""opd/spine/load_shards.py on two gloo ranks, each a subprocess of its own (a process group in
the pytest worker would outlive a failing test): a buffer kept in the state dict crosses by
broadcast, and a file whose tensor does not fit the model is refused on every rank, naming both
shapes (refused on rank 0 alone, it left rank 1 waiting in the scatter). (The scatter of uneven
rows through load_policy is tests/spine/test_sharded.py's.)"""

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

    out, port, rank = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(5, 3)
            self.register_buffer("scale", torch.zeros(3))   # saved in the state dict

    def load(weights, name):
        if rank == 0:
            (out / name).mkdir()
            save_file(weights, str(out / name / "model.safetensors"))
        dist.barrier()
        with params_on_meta():
            model = Scaled()
        assert model.lin.weight.is_meta and not model.scale.is_meta
        fully_shard(model)
        model.to_empty(device="cpu")
        files = weight_files(out / name)
        stream_weights(model, files, file_keys(model, files), World(rank=rank, size=2, sharded=True),
                       torch.float32)
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


def test_a_state_dict_buffer_is_broadcast_and_a_tensor_of_another_shape_is_refused_on_every_rank(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    port = str(free_port())
    ranks = [subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path), port, str(r)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        outs = [p.communicate(timeout=180) for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    for p, (stdout, stderr) in zip(ranks, outs):
        assert p.returncode == 0, stderr[-3000:]
        assert "refused: lin.weight: the file holds (4, 5), the model (3, 5)" in stdout, stdout
        assert stdout.strip().endswith("ok")
