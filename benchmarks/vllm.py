"""Teacher scoring and student rollout throughput: transformers vs vLLM, side by side.

    python benchmarks/vllm.py [--model DIR] [--out runs/bench_vllm.json]

Teacher: top-k scoring of `--seqs` x `--seq-len` tokens (every position scored) for k in
{1, 8, 64}, in scored positions per second, for
  hf           HFBackend.score_topk
  vllm         VLLMBackend.score_topk (detokenize=False, flat_logprobs, reshaped to arrays)
  vllm-dicts   plain `LLM.generate` with SamplingParams(prompt_logprobs=k) and vLLM's
               defaults (detokenized dicts of Logprob objects), the path most code uses
Rollout: `--prompts` prompts of `--prompt-len` tokens, `--new-tokens` new tokens each at
temperature 1 with no stop tokens, in generated tokens per second, for HFRolloutEngine
and VLLMRolloutEngine. Without --model it builds the tiny model (head_dim 32, which
vLLM's CPU attention needs). Writes JSON and prints a table. Figures: docs/vllm.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

from opd.rollout.base import SamplingParams as RolloutSampling
from opd.rollout.hf import HFRolloutEngine
from opd.rollout.vllm import VLLMRolloutEngine
from opd.teachers.backend import ScoreRequest
from opd.teachers.hf_backend import HFBackend
from opd.teachers.vllm_backend import VLLMBackend
from opd.tiny import build_tiny_model

KS = (1, 8, 64)


def _timed(fn, repeats: int) -> float:
    """Best wall time of `repeats` calls, after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _score_request(seqs, k: int):
    import torch

    offsets = [0]
    for s in seqs:
        offsets.append(offsets[-1] + len(s))
    return ScoreRequest(request_id=0, mode="topk", ids=torch.tensor([t for s in seqs for t in s]),
                        offsets=tuple(offsets), response_starts=(1,) * len(seqs), k=k,
                        temperature=1.0, dtype="float32", chunk_rows=1024)


def bench_teachers(model_dir: Path, seqs, repeats: int) -> list[dict]:

    rows = sum(len(s) - 1 for s in seqs)
    results = []
    hf = HFBackend(model_dir, name="bench", max_k=max(KS))
    for k in KS:
        dt = _timed(lambda: hf.score_topk([_score_request(seqs, k)]), repeats)
        results.append(dict(subject="teacher", backend="hf", k=k, rows=rows, seconds=dt, positions_per_s=rows / dt))
    del hf
    vb = VLLMBackend(model_dir, name="bench", max_k=max(KS), max_positions=max(len(s) for s in seqs))
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=list(s)) for s in seqs]
    for k in KS:
        dt = _timed(lambda: vb.score_topk([_score_request(seqs, k)]), repeats)
        results.append(dict(subject="teacher", backend="vllm", k=k, rows=rows, seconds=dt, positions_per_s=rows / dt))
        sp = SamplingParams(max_tokens=1, prompt_logprobs=k)
        dt = _timed(lambda: vb.llm.generate(prompts, sp, use_tqdm=False), repeats)
        results.append(dict(subject="teacher", backend="vllm-dicts", k=k, rows=rows, seconds=dt, positions_per_s=rows / dt))
    vb.close()
    return results


def bench_rollouts(model_dir: Path, prompts, new_tokens: int, repeats: int) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    params = RolloutSampling(temperature=1.0, max_new_tokens=new_tokens, seed=0)
    results = []

    def run(engine, name):
        made = []
        dt = _timed(lambda: made.append(sum(len(r.response_ids) for r in engine.generate(prompts, params))), repeats)
        results.append(dict(subject="rollout", backend=name, prompts=len(prompts), tokens=made[-1],
                            seconds=dt, tokens_per_s=made[-1] / dt))

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    run(HFRolloutEngine(model, AutoTokenizer.from_pretrained(str(model_dir))), "hf")
    engine = VLLMRolloutEngine(model_dir, max_model_len=len(prompts[0]) + new_tokens + 8, seed=0)
    run(engine, "vllm")
    engine.close()
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="model dir (default: build the tiny model)")
    p.add_argument("--out", type=Path, default=Path("runs/bench_vllm.json"))
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    model_dir = args.model
    if model_dir is None:

        model_dir = build_tiny_model(Path(tempfile.mkdtemp(prefix="opd-bench-")) / "tiny", seed=0, heads=2, kv_heads=1)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 256, (args.seq_len,), generator=g).tolist() for _ in range(args.seqs)]
    prompts = [torch.randint(0, 256, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]

    results = bench_teachers(model_dir, seqs, args.repeats)
    results += bench_rollouts(model_dir, prompts, args.new_tokens, args.repeats)
    report = dict(machine=dict(platform=platform.platform(), processor=platform.processor(),
                               cpus=os.cpu_count(), torch_threads=torch.get_num_threads()),
                  model=str(model_dir), args={k: str(v) for k, v in vars(args).items()}, results=results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))

    print(f"\n{'subject':8} {'backend':11} {'k':>3} {'throughput':>14}")
    for r in results:
        if r["subject"] == "teacher":
            print(f"{'teacher':8} {r['backend']:11} {r['k']:>3} {r['positions_per_s']:>10.0f} pos/s")
        else:
            print(f"{'rollout':8} {r['backend']:11} {'':>3} {r['tokens_per_s']:>10.0f} tok/s")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
