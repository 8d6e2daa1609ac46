"""`opd bench store`: what a teacher logit store costs on disk and what replaying it saves.

One student, one teacher server (its own process, 1 thread), and:

    store          `opd store` on the student's own rollouts of the prompts (Lightning-OPD's
                   source): sampling and scoring seconds, bytes per response token on disk,
                   beside a live top-k answer's bytes on the wire and a full-vocabulary row's
    replay         `opd train` with `store:`: no teacher running, nothing sampled
    live, stored sequences   the same trainer and the same stored batches, each scored by the
                   live teacher at every step (what the store saves: the teacher's forward)
    live, on-policy          `opd train` against the live teacher, the student sampling every
                   batch (run.pipeline on, the default): what Lightning-OPD replaces

Steps/s is over the training loop after its first step: (steps - 1) / (last step's end - first
step's end). Every arm trains `--batch` sequences a step at the same response length (the
on-policy arm samples up to --max-new-tokens, the stored ones were sampled at that limit).
Defaults build tiny random models (opd.tiny); `--student DIR --teacher DIR` takes real ones
(e.g. SmolLM2-135M-Instruct and its first 8 layers), whose chat prompts come from
opd.benchmarks.step_real.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from opd.benchmarks.step_real import PROMPTS
from opd.config import from_dict
from opd.data import write_jsonl
from opd.distill.config import TrainConfig
from opd.distill.trainer import Trainer
from opd.routing.config import TeacherClientSettings, TeacherSpec
from opd.store.config import StoreConfig
from opd.store.shards import read_manifest
from opd.store.write import build_store
from opd.teachers.launch import start_server_process
from opd.teachers.session import TeacherSet
from opd.tiny import build_tiny_model, perturb_model


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--student", default=None, help="student model directory (default: a tiny random one)")
    p.add_argument("--teacher", default=None, help="teacher model directory, the student's tokenizer")
    p.add_argument("--k", type=int, default=32, help="top-k stored and trained")
    p.add_argument("--prompts", type=int, default=8, help="prompts (the real models cycle opd.benchmarks.step_real's)")
    p.add_argument("--n", type=int, default=4, help="student rollouts per prompt stored")
    p.add_argument("--max-new-tokens", type=int, default=48, help="response length limit (stored and on-policy)")
    p.add_argument("--batch", type=int, default=8, help="sequences per training step")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per arm (the first is not timed)")
    p.add_argument("--out", default=None, help="working directory (default: a temporary one)")
    p.add_argument("--json", default=None, help="write the rows to this JSON file")


def _train_cfg(root: Path, name: str, args, *, store: Path | None = None, address: str | None = None) -> TrainConfig:
    d = {"student": {"path": args.student},
         "rollout": {"prompts_per_step": args.batch, "max_new_tokens": args.max_new_tokens},
         "optim": {"lr": 1e-5, "micro_batch_size": args.batch},
         "run": {"steps": args.steps, "out_dir": str(root / name), "progress": False, "tensorboard": False}}
    if store is not None:
        d["store"] = {"path": str(store), "k": args.k}
    else:
        d["merge"] = {"teachers": [{"name": "store", "address": address, "mode": "topk", "k": args.k}],
                      "datasets": [{"domain": "gen", "path": str(root / "prompts.jsonl")}]}
    return from_dict(d, TrainConfig)


def _steps_per_s(tr: Trainer, steps: int, swap=None) -> dict:
    """Set up `tr`, let `swap(tr)` change it, time its loop; steps/s after the first step."""
    times: list[float] = []
    step = tr.step

    def timed():
        row = step()
        times.append(time.perf_counter())
        return row

    tr.step = timed
    try:
        tr.setup()
        if swap is not None:
            swap(tr)
        tr.train()
    finally:
        tr.close()
    rows = [json.loads(x) for x in (tr.out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    per_step = sum(r["response_len"] for r in rows) / len(rows) * tr.cfg.rollout.prompts_per_step
    return {"steps_per_s": (steps - 1) / (times[-1] - times[0]), "response_tokens_per_step": per_step}


def run(args) -> int:
    root = Path(args.out or tempfile.mkdtemp(prefix="opd_bench_store_"))
    root.mkdir(parents=True, exist_ok=True)
    if args.student is None:
        build_tiny_model(root / "student", layers=4, hidden=256, intermediate=1024, heads=4, kv_heads=2, seed=0)
        perturb_model(root / "student", root / "teacher", scale=0.5, seed=1)
        args.student, args.teacher = str(root / "student"), str(root / "teacher")
        prompts = [f"q{i}: what is {i}+{i}? " for i in range(args.prompts)]
    else:
        prompts = [PROMPTS[i % len(PROMPTS)] + (f" ({i // len(PROMPTS)})" if i >= len(PROMPTS) else "")
                   for i in range(args.prompts)]
    write_jsonl(root / "prompts.jsonl", [{"prompt": p} for p in prompts])
    server = start_server_process(["--model", args.teacher, "--max-k", str(max(64, args.k)), "--name", "t"],
                                  env={"TOKENIZERS_PARALLELISM": "false"})
    results: dict = {"machine": f"{os.cpu_count()} CPUs, torch {torch.__version__}, {torch.get_num_threads()} "
                                f"torch threads in the trainer, the teacher server 1, OMP_WAIT_POLICY "
                                f"{os.environ.get('OMP_WAIT_POLICY', 'unset')}, load average at start "
                                f"{os.getloadavg()[0]:.1f}",
                     "args": {k: v for k, v in vars(args).items() if k != "func"}}
    try:
        store = root / "store"
        cfg = from_dict({"student": {"path": args.student}, "teacher": {"address": server.address, "name": "t"},
                         "sequences": {"prompts": str(root / "prompts.jsonl"), "n": args.n,
                                       "max_new_tokens": args.max_new_tokens},
                         "out": str(store), "k": args.k, "shard_size": 4 * args.n, "batch_size": 8}, StoreConfig)
        t0 = time.perf_counter()
        m = build_store(cfg, root / "store.yaml")
        wall = time.perf_counter() - t0
        rows = sum(e["rows"] for e in m["shards"])
        ids = 2 if m["dtypes"]["topk_ids"] == "uint16" else 4
        results["store"] = {
            "sequences": m["sequences"], "response_tokens": rows, "wall_s": round(wall, 2),
            "bytes_per_token_on_disk": sum(e["bytes"] for e in m["shards"]) / rows,
            "answer_bytes_per_token": args.k * (ids + 2) + 8,            # ids + fp16 log-probs + tail + token
            "live_topk_wire_bytes_per_token": args.k * 8 + 12,          # int32 ids, fp32 log-probs, tail, token, lse
            "full_fp32_bytes_per_token": 4 * m["vocab_size"], "full_bf16_bytes_per_token": 2 * m["vocab_size"],
            "vocab_size": m["vocab_size"], "ids_dtype": m["dtypes"]["topk_ids"]}
        print(f"[bench store] store: {json.dumps(results['store'])}", flush=True)

        replay = _steps_per_s(Trainer(_train_cfg(root, "replay", args, store=store), overwrite=True), args.steps)
        print(f"[bench store] replay: {replay}", flush=True)

        def live_teacher(tr):   # the stored batches, each scored by the server at its step
            tr.teachers = TeacherSet([TeacherSpec(name="store", address=server.address, mode="topk", k=args.k)],
                                     TeacherClientSettings(), tr.student_fp, tr.cfg.student.path)

        same = _steps_per_s(Trainer(_train_cfg(root, "live_stored", args, store=store), overwrite=True), args.steps,
                            live_teacher)
        print(f"[bench store] live teacher, stored sequences: {same}", flush=True)
        on_policy = _steps_per_s(Trainer(_train_cfg(root, "live_on_policy", args, address=server.address),
                                         overwrite=True), args.steps)
        print(f"[bench store] live teacher, on-policy: {on_policy}", flush=True)
    finally:
        server.stop()
    results["machine"] += f", at end {os.getloadavg()[0]:.1f}"
    results["arms"] = {"replay (store)": replay, "live teacher, stored sequences": same,
                       "live teacher, on-policy": on_policy}
    s = results["store"]
    print(f"\n{results['machine']}; k={args.k}, V={s['vocab_size']}, {s['sequences']} sequences, "
          f"{s['response_tokens']} response tokens")
    print(f"\n| bytes per response token | stored ({s['ids_dtype']} ids, fp16) | live top-k wire (fp32) | "
          f"full fp32 | full bf16 |\n|---|---|---|---|---|\n| answer | {s['answer_bytes_per_token']} "
          f"({s['bytes_per_token_on_disk']:.1f} on disk with the sequence's ids and the shard's index) | "
          f"{s['live_topk_wire_bytes_per_token']} | {s['full_fp32_bytes_per_token']} | "
          f"{s['full_bf16_bytes_per_token']} |")
    print(f"\n| arm ({args.batch} sequences a step) | steps/s | x on-policy |\n|---|---|---|")
    base = on_policy["steps_per_s"]
    for name, r in results["arms"].items():
        print(f"| {name} | {r['steps_per_s']:.3f} | {r['steps_per_s'] / base:.2f} |")
    print(f"\nstore written in {s['wall_s']} s (sampling the student's rollouts and the teacher's scoring)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
