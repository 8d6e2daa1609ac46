"""Run by tests/spine/test_sharded.py under torchrun with 2 ranks: a sharded student beside rank
0's vLLM engine (opd.spine.engine). Three optimizer steps on the engine's own samples, each
followed by the weight sync (in buckets of 16 KiB, so a sync is many partial loads); then every rank's rollouts of a last call, with the engine's raw
log-probs of them beside a forward of the trained weights (the sharded model itself, every rank
in the collective), written as JSON per rank."""

import json
import os
import sys

import psutil
import torch
import torch.distributed as dist

from opd.lora import LoraSpec
from opd.rollout import SamplingParams
from opd.spine.config import ModelConfig, RolloutConfig
from opd.spine.dist import init_world
from opd.spine.model import load_policy, make_engine


def forward_logprobs(model, rollouts) -> list[list[float]]:
    out = []
    for r in rollouts:
        ids = torch.tensor([r.prompt_ids + r.response_ids])
        logits = model(input_ids=ids).logits[0, len(r.prompt_ids) - 1:-1].float()
        out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(r.response_ids)[:, None])[:, 0].tolist())
    return out


def main(path: str, lora: bool, out: str) -> None:
    world = init_world("cpu")
    model_cfg = ModelConfig(path=path, device="cpu", lora=LoraSpec(rank=4) if lora else None)
    model, tok = load_policy(model_cfg, seed=0, world=world)
    engine = make_engine(RolloutConfig(engine="vllm", vllm_max_model_len=128), model_cfg, model, tok, seed=0,
                         world=world)
    engine.bucket_bytes = 16 << 10   # many buckets per sync: vLLM keeps what a bucket leaves out
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    prompts = [[5, 6, 7], [8, 9]] if world.rank == 0 else [[10, 11, 12, 13], [14]]
    for step in range(3):   # raise the log-probs of the engine's own samples: the weights move
        rollouts = engine.generate(prompts, SamplingParams(max_new_tokens=6, seed=step))
        loss = -sum(sum(lp) for lp in forward_logprobs_with_grad(model, rollouts))
        loss.backward()
        opt.step()
        opt.zero_grad()
        engine.sync_weights(model)
    last = engine.generate(prompts, SamplingParams(max_new_tokens=8, n=2, seed=7))
    with torch.no_grad():
        mine = forward_logprobs(model, last)
    report = {"rank": world.rank, "prompts": [r.prompt_ids for r in last], "index": [r.prompt_index for r in last],
              "engine": [r.logprobs for r in last], "forward": mine,
              "vllm_children": sum("vllm" in " ".join(c.cmdline()).lower() or c.name().startswith("VLLM")
                                   for c in psutil.Process().children(recursive=True))}
    engine.close()
    with open(f"{out}.{world.rank}", "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


def forward_logprobs_with_grad(model, rollouts):
    for r in rollouts:
        ids = torch.tensor([r.prompt_ids + r.response_ids])
        logits = model(input_ids=ids).logits[0, len(r.prompt_ids) - 1:-1].float()
        yield torch.log_softmax(logits, -1).gather(-1, torch.tensor(r.response_ids)[:, None])[:, 0]


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    main(sys.argv[1], sys.argv[2] == "lora", sys.argv[3])
