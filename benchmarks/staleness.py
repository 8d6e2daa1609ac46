"""`opd bench staleness`: optimizer steps per second of `opd train` by how far rollouts may run ahead.

One config, one teacher server (its own process), four schedules of the same run:

    on-policy      run.pipeline false                    (staleness 0)
    pipeline       run.pipeline true                     (look-ahead of one batch, staleness 1)
    ahead K=0      run.max_staleness 0                   (the sampling thread, always waiting)
    ahead K=2      run.max_staleness 2                   (the thread up to 2 steps ahead)

Steps/s is over the training loop after its first step (model loading, the first evaluation,
the teacher's start and the first step, which pays the engines' warm-up and which a thread
may have sampled during setup, are left out): (steps - 1) / (last step's end - first step's end). The models are random tiny Qwen2-style ones (opd.tiny) with a
rollout long enough that sampling is a real share of the step. Each schedule runs `--rounds`
times, alternating, and the best round is kept (the box is shared).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from opd.config import from_dict
from opd.data import write_jsonl
from opd.distill.config import TrainConfig
from opd.distill.trainer import Trainer
from opd.teachers.launch import start_server_process
from opd.tiny import build_tiny_model, perturb_model

SCHEDULES = {"on-policy": {"run.pipeline": False}, "pipeline": {"run.pipeline": True},
             "ahead K=0": {"run.max_staleness": 0}, "ahead K=2": {"run.max_staleness": 2}}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=12, help="optimizer steps per run")
    p.add_argument("--rounds", type=int, default=2, help="runs of each schedule (the best is kept)")
    p.add_argument("--engine", choices=["hf", "vllm"], default="hf", help="rollout engine")
    p.add_argument("--hidden", type=int, default=256, help="hidden size of the tiny student and teacher")
    p.add_argument("--layers", type=int, default=4, help="layers of the tiny student and teacher")
    p.add_argument("--max-new-tokens", type=int, default=48, help="response length limit")
    p.add_argument("--json", default=None, help="write the rows to this JSON file")
    p.add_argument("--quick", action="store_true", help="3 steps, 1 round, small model (smoke test)")


def _config(root: Path, name: str, address: str, args, over: dict):
    d = {"student": {"path": str(root / "student")},
         "merge": {"teachers": [{"name": "t", "address": address, "mode": "topk", "k": 16}],
                   "datasets": [{"domain": "gen", "path": str(root / "train.jsonl")}]},
         "rollout": {"engine": args.engine, "prompts_per_step": 8, "max_new_tokens": args.max_new_tokens,
                     "temperature": 1.0, "vllm_max_model_len": 256},
         "optim": {"lr": 1e-4, "micro_batch_size": 8},
         "run": {"steps": args.steps, "out_dir": str(root / name), "progress": False, "tensorboard": False}}
    for path, value in over.items():
        section, key = path.split(".")
        d[section][key] = value
    return from_dict(d, TrainConfig)


def _one(root: Path, name: str, address: str, args, over: dict) -> dict:
    tr = Trainer(_config(root, name, address, args, over), overwrite=True)
    times: list[float] = []
    step = tr.step

    def timed_step():
        if not times:
            times.append(time.perf_counter())
        row = step()
        times.append(time.perf_counter())
        return row

    tr.step = timed_step
    try:
        tr.setup()
        tr.train()
    finally:
        tr.close()
    rows = [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]
    stale = [r["staleness"] for r in rows if "staleness" in r]
    return {"steps_per_s": (args.steps - 1) / (times[-1] - times[1]), "staleness_mean": sum(stale) / len(stale),
            "staleness_max": max(stale)}


def run(args) -> int:
    if args.quick:
        args.steps, args.rounds, args.hidden, args.layers, args.max_new_tokens = 3, 1, 64, 2, 12
    if args.steps < 2:
        raise SystemExit("--steps: at least 2 (the first step is not timed)")
    root = Path(tempfile.mkdtemp(prefix="opd_bench_staleness_"))
    build_tiny_model(root / "student", layers=args.layers, hidden=args.hidden, intermediate=4 * args.hidden,
                     heads=4, kv_heads=2, seed=0)
    perturb_model(root / "student", root / "teacher", scale=0.5, seed=1)
    write_jsonl(root / "train.jsonl", [{"prompt": f"q{i}: what is {i}+{i}? "} for i in range(64)])
    server = start_server_process(["--model", str(root / "teacher"), "--max-k", "16", "--name", "t"],
                                  env={"TOKENIZERS_PARALLELISM": "false"})
    best: dict[str, dict] = {}
    try:
        for r in range(args.rounds):
            for name, over in SCHEDULES.items():
                out = _one(root, f"{name.replace(' ', '_').replace('=', '')}_{r}", server.address, args, over)
                print(f"[bench staleness] round {r + 1} {name}: {out['steps_per_s']:.3f} steps/s, staleness mean "
                      f"{out['staleness_mean']:.2f} max {out['staleness_max']:.0f}", flush=True)
                if name not in best or out["steps_per_s"] > best[name]["steps_per_s"]:
                    best[name] = out
    finally:
        server.stop()
    base = best["on-policy"]["steps_per_s"]
    rows = [{"schedule": k, **v, "vs_on_policy": v["steps_per_s"] / base} for k, v in best.items()]
    print(f"\n| schedule ({args.engine}, {os.cpu_count()} CPUs, {args.steps} steps, best of {args.rounds}) "
          f"| steps/s | x on-policy | staleness mean / max |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row['schedule']} | {row['steps_per_s']:.3f} | {row['vs_on_policy']:.2f} | "
              f"{row['staleness_mean']:.2f} / {row['staleness_max']:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
