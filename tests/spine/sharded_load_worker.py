"""Run by tests/spine/test_sharded.py under torchrun with 2 ranks: load_policy on a sharded
world, then report as JSON what each rank read from disk and what it ended with."""

import json
import sys

import torch
import torch.distributed as dist

import opd.spine.model as spine_model
from opd.lora import LoraSpec
from opd.spine.config import ModelConfig
from opd.spine.dist import init_world
from opd.spine.shards import full_state_dict


def main(path: str, lora: bool, out: str) -> None:
    world = init_world("cpu")
    reads = []   # every whole-model read from disk on this rank
    read = spine_model.AutoModelForCausalLM.from_pretrained
    spine_model.AutoModelForCausalLM.from_pretrained = lambda *a, **k: (reads.append(a[0]), read(*a, **k))[1]
    model, _ = spine_model.load_policy(ModelConfig(path=path, device="cpu", lora=LoraSpec(rank=4) if lora else None),
                                       seed=0, world=world)
    whole = full_state_dict(model)   # rank 0: every weight, gathered back from the shards
    logits = model(input_ids=torch.tensor([[1, 2, 3, 4]])).logits
    report = {"rank": world.rank, "reads": len(reads), "logits": logits.detach().flatten()[:8].tolist(),
              "buffers": {n: b.tolist() for n, b in model.named_buffers()}}
    if world.rank == 0:
        ref_model = read(path, dtype=torch.float32)
        ref = ref_model.state_dict()
        names = {k.replace("base_model.model.", "").replace(".base_layer", ""): v for k, v in whole.items()}
        report["weights_equal"] = all(torch.equal(names[k], v) for k, v in ref.items())
        built = dict(ref_model.named_buffers())
        report["buffers_equal"] = all(torch.equal(built[n.replace("base_model.model.", "")], b)
                                      for n, b in model.named_buffers())
    with open(f"{out}.{world.rank}", "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] == "lora", sys.argv[3])
