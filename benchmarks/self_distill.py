"""`opd bench self-distill`: self-distillation with the reference answer in the teacher's context.

Can a student improve without any larger teacher, by distilling from a frozen copy of itself
that sees the answer? On the demo's math task ("47+8=" -> "55"), on tiny byte-level models:

    warm-up       `opd sft` of a fresh tiny model on the training prompts, a share of them
                  (--hint-ratio) with the answer as a hint in the prompt (--context, by default
                  "answer 55. 47+8="), the rest plain, briefly (--warmup-steps): it learns to
                  copy a hint and stays mediocre without one. This is the base.
    base          the base itself, no further training
    self_distill  `opd train` from the base with one teacher, `self` (cluster.mode fork,
                  `model: self`: a frozen copy of the base served by the run), whose `context`
                  renders the training prompt with its reference answer; the teacher scores the
                  student's own samples after that prompt (top-k, the demo merge's settings)
    sft           `opd sft` from the base on the same training prompts' reference answers
                  (no hint): the same optimizer steps, batch size, learning rate and schedule

Measured afterwards on held-out prompts the training never sees (nor their answers): one
greedy answer each, without any hint, checked by the math verifier; and the teacher's own
accuracy, the base answering the same held-out prompts WITH the hint (the upper bound it can
pass on). Each trained arm runs once per seed (--seeds); the base is trained once.

    opd bench self-distill [--out runs/self_distill] [--seeds 0,1,2] [--eval-steps 25,50,100,200]
    python -m opd.benchmarks.self_distill --quick       # smoke test, under a minute

Writes OUT/self_distill.md and OUT/self_distill.json. The library is copied to OUT/code
first (as `opd bench recipes` does), so edits to the tree while it runs change nothing.
Benchmarks report numbers; they do not assert them.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

from opd.benchmarks import standalone
from opd.benchmarks.recipes_inputs import snapshot_code
from opd.benchmarks.recipes_report import machine
from opd.data import write_jsonl
from opd.teachers.launch import start_server_process
from opd.tiny.data import make_split

ARMS = ("self_distill", "sft")
LABELS = {"base": "base (warm-up only)", "teacher": "teacher: the base, with the answer as a hint in its prompt",
          "self_distill": "self-distillation (`opd train`, teacher `self` with the answer in its context)",
          "sft": "SFT on the reference answers (`opd sft`)"}
CONTEXT = "answer {answer}. {prompt}"
TINY = {"layers": 4, "hidden": 128, "heads": 4, "kv_heads": 2, "intermediate": 256, "max_positions": 128, "seed": 0}
QUICK = {"seeds": "0", "eval_steps": "2,3", "batch": 8, "warmup_steps": 20, "warmup_batch": 16, "eval_prompts": 16,
         "n_train": 200, "tiny": {**TINY, "layers": 2, "hidden": 64, "heads": 2, "kv_heads": 1, "intermediate": 128}}
RUN_TIMEOUT_S = 1800


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("runs/self_distill"),
                   help="folder for the data, the runs, self_distill.md and self_distill.json")
    p.add_argument("--arms", default=",".join(ARMS),
                   help=f"comma-separated, of {', '.join(ARMS)} (the base is always measured)")
    p.add_argument("--seeds", default="0,1,2",
                   help="comma-separated training seeds of the arms (the base is trained once)")
    p.add_argument("--eval-steps", default="25,50,100,200",
                   help="comma-separated optimizer steps at which each arm is measured; the last is its length")
    p.add_argument("--batch", type=int, default=32, help="sequences per optimizer step of each arm")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate of both arms (constant after 5 warm-up steps)")
    p.add_argument("--k", type=int, default=16, help="the self teacher's top-k")
    p.add_argument("--context", default=CONTEXT,
                   help="the teacher's context: a str.format template over the sample's fields; the same text is "
                        "the hinted prompt of the warm-up and of the teacher's own held-out measurement")
    p.add_argument("--hint-ratio", type=float, default=0.5, help="share of the warm-up's prompts that carry the hint")
    p.add_argument("--warmup-steps", type=int, default=400, help="steps of the warm-up SFT that makes the base")
    p.add_argument("--warmup-batch", type=int, default=64, help="its batch size")
    p.add_argument("--n-train", type=int, default=1400, help="training prompts (warm-up and both arms)")
    p.add_argument("--eval-prompts", type=int, default=200, help="held-out prompts (greedy, one answer each)")
    p.add_argument("--max-new-tokens", type=int, default=8, help="response length limit (rollouts and evaluation)")
    p.add_argument("--teacher", choices=["fork", "server"], default="fork",
                   help="fork: `cluster.mode: fork` with `model: self` (opd train serves its start itself); "
                        "server: this benchmark starts `opd serve-teacher --model BASE` and gives its address")
    p.add_argument("--code-rev", default=None, help="run the library of this git commit (default: the working tree)")
    p.add_argument("--quick", action="store_true", help=f"smoke test: {QUICK} (the numbers mean nothing)")


# ----------------------------------------------------------------------------- data and configs


def write_data(out: Path, n_train: int, n_eval: int, hint_ratio: float, context: str) -> dict[str, Path]:
    """The demo's math generator (opd.tiny.data), seed 0: training and disjoint held-out rows.
    warm.jsonl: the training rows, a seeded `hint_ratio` of them with the hinted prompt;
    train.jsonl: the same rows plain (both arms); held-out plain and hinted."""
    train, held = make_split("math", n_train, n_eval, 0)
    rng = random.Random(0)
    warm = [{**r, "prompt": context.format(**r)} if rng.random() < hint_ratio else r for r in train]
    d = out / "data"
    return {"warm": write_jsonl(d / "warm.jsonl", warm), "train": write_jsonl(d / "train.jsonl", train),
            "held_plain": write_jsonl(d / "heldout_plain.jsonl", held),
            "held_hint": write_jsonl(d / "heldout_hint.jsonl", [{**r, "prompt": context.format(**r)} for r in held])}


def warmup_config(out_dir: Path, data: dict, steps: int, batch: int, tiny: dict) -> dict:
    return {"model": {"tiny": dict(tiny), "device": "cpu"},
            "data": {"train": [{"path": str(data["warm"]), "domain": "math"}], "batch_size": batch},
            "optim": {"lr": 1e-3, "warmup_steps": min(20, steps // 5)},
            "run": {"steps": steps, "out_dir": str(out_dir), "log_every": 10, "seed": 0, "threads": 1}}


def sft_arm_config(out_dir: Path, base: Path, data: dict, args, seed: int) -> dict:
    return {"model": {"path": str(base), "device": "cpu"},
            "data": {"train": [{"path": str(data["train"]), "domain": "math"}], "batch_size": args.batch},
            "optim": {"lr": args.lr, "warmup_steps": 5, "schedule": "constant"},
            "run": {"steps": args.steps, "out_dir": str(out_dir), "log_every": 1, "seed": seed, "threads": 1,
                    "checkpoint_every": args.checkpoint_every, "keep_checkpoints": 100000}}


def self_distill_config(out_dir: Path, base: Path, data: dict, args, seed: int, address: str | None = None) -> dict:
    """`opd train` from the base; its one teacher is the base itself, shown `--context`.
    `address` None: the teacher is forked by the run (`cluster.mode: fork`, `model: self`)."""
    teacher = {"name": "self", "address": address or "tcp://127.0.0.1:*", "domains": ["math"], "mode": "topk",
               "k": args.k, "temperature": 1.0, "beta": 0.0, "weight": 1.0, "context": args.context}
    cfg = {"student": {"path": str(base), "device": "cpu"},
           "merge": {"teachers": [teacher], "datasets": [{"domain": "math", "path": str(data["train"])}]},
           "rollout": {"engine": "hf", "prompts_per_step": args.batch, "samples_per_prompt": 1, "temperature": 1.0,
                       "max_new_tokens": args.max_new_tokens},
           "loss": {"length_norm": "sequence", "trim": "eos"},
           "optim": {"lr": args.lr, "warmup_steps": 5, "schedule": "constant", "micro_batch_size": args.batch},
           "run": {"steps": args.steps, "out_dir": str(out_dir), "seed": seed, "pipeline": True, "eval_every": 0,
                   "checkpoint_every": args.checkpoint_every, "keep_checkpoints": 100000, "progress": False,
                   "tensorboard": False}}
    if address is None:
        cfg["cluster"] = {"mode": "fork",
                          "teachers": [{"name": "self", "model": "self", "serve_args": ["--max-k", "64"]}]}
    return cfg


# ----------------------------------------------------------------------------- runs


def _opd(*a) -> list[str]:
    return [sys.executable, "-m", "opd.cli", *map(str, a)]


def _tail(log: Path, n: int = 12) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:]) if log.is_file() else ""


def run_logged(cmd: list[str], log: Path, env: dict) -> tuple[int, float]:
    t0 = time.time()
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as f:
        try:
            rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, time.time() - t0


def last_metrics(run_dir: Path) -> dict:
    """The last training row of a run's metrics.jsonl (opd train's, or opd sft's under out_dir)."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    rows = [r for r in (json.loads(line) for line in lines if line.strip()) if "loss" in r]
    return {k: v for k, v in rows[-1].items() if isinstance(v, (int, float))} if rows else {}


def train_arm(arm: str, seed: int, base: Path, data: dict, args, env: dict, address: str | None) -> dict:
    run_dir = args.out / "runs" / f"seed{seed}" / arm
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    cfg = (self_distill_config(run_dir / "train", base, data, args, seed, address) if arm == "self_distill"
           else sft_arm_config(run_dir / "train", base, data, args, seed))
    cfg_path = run_dir / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    rc, wall = run_logged(_opd("train" if arm == "self_distill" else "sft", cfg_path, "--overwrite"),
                          run_dir / "run.log", env)
    train = run_dir / "train"
    points = {n: train / "model" if n == args.steps else train / "checkpoints" / f"step_{n:06d}" / "model"
              for n in args.eval_at}
    result = {"arm": arm, "seed": seed, "rc": rc, "wall_s": wall, "config": str(cfg_path),
              "log": str(run_dir / "run.log"), "models": {n: str(m) for n, m in points.items()},
              "last_metrics": last_metrics(train), "points": {}}
    missing = [str(m) for m in points.values() if not (m / "config.json").is_file()]
    if rc != 0 or missing:
        result["rc"] = rc or 1
        result["error"] = _tail(run_dir / "run.log") + (f"\nmissing: {', '.join(missing)}" if missing else "")
        print(f"[self-distill] {arm} seed {seed}: FAILED (exit {rc}); {run_dir / 'run.log'}:\n{result['error']}",
              flush=True)
    else:
        print(f"[self-distill] {arm} seed {seed}: {args.steps} steps in {wall:.0f} s", flush=True)
    return result


def evaluate(models: dict[str, str], data: dict, args, env: dict, tokenizer: Path) -> dict[str, dict]:
    """Greedy accuracy of each model on the held-out prompts, plain and hinted (recipes_worker's
    evaluation: the math verifier on every answer), in one subprocess."""
    out = args.out / "eval" / "scores.json"
    job = {"kind": "eval", "models": models, "out": str(out), "max_new_tokens": args.max_new_tokens,
           "tokenizer": str(tokenizer), "sets": {"plain": str(data["held_plain"]), "hint": str(data["held_hint"])}}
    worker = Path(__file__).resolve().with_name("recipes_worker.py")
    rc, _ = run_logged([sys.executable, "-P", str(worker), json.dumps(job)], args.out / "eval" / "eval.log", env)
    if rc != 0:
        raise RuntimeError(f"evaluation failed (exit {rc}):\n{_tail(args.out / 'eval' / 'eval.log')}")
    return json.loads(out.read_text())


# ----------------------------------------------------------------------------- report


def _mean_std(xs: list[float]) -> tuple[float, float]:
    if not xs:
        return math.nan, math.nan
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def summarize(base: dict, results: list[dict], eval_at: list[int]) -> list[dict]:
    """Rows of the table: the base, the teacher (the base with the hint), then each arm: its
    held-out accuracy at each measured step (mean, std over seeds), per seed at the last step,
    and at the last step on the hinted prompts."""
    rows = [{"arm": "base", "label": LABELS["base"], "seeds": 1, "acc": base["plain"], "hint_acc": base["hint"]},
            {"arm": "teacher", "label": LABELS["teacher"], "seeds": 1, "acc": base["hint"]}]
    last = eval_at[-1]
    for arm in dict.fromkeys(r["arm"] for r in results):
        ok = [r for r in results if r["arm"] == arm and r["rc"] == 0 and r["points"]]
        bad = [r for r in results if r["arm"] == arm and r not in ok]
        row = {"arm": arm, "label": LABELS.get(arm, arm), "seeds": len(ok), "failed": len(bad),
               "error": bad[0].get("error", "") if bad else "", "at": {}}
        for n in eval_at:
            mean, std = _mean_std([r["points"][n]["plain"] for r in ok])
            row["at"][n] = {"acc": mean, "std": std}
        row["per_seed"] = [r["points"][last]["plain"] for r in ok]
        row["acc"] = row["at"][last]["acc"]
        row["gain"] = row["acc"] - base["plain"] if ok else math.nan
        row["hint_acc"] = _mean_std([r["points"][last]["hint"] for r in ok])[0]
        row["wall_s"] = _mean_std([r["wall_s"] for r in ok])[0]
        rows.append(row)
    return rows


def _f(x: float | None) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"


def markdown(report: dict) -> str:
    p, eval_at = report["plan"], report["plan"]["eval_at"]
    last = eval_at[-1]
    head = " | ".join(f"step {n}" for n in eval_at)
    lines = [f"Held-out math prompts: {p['eval_prompts']} (never trained on, their answers never shown), one greedy "
             f"answer each (at most {p['max_new_tokens']} tokens), no hint, math verifier. Arms: {p['batch']} "
             f"sequences per optimizer step, lr {p['lr']:g} constant after 5 warm-up steps, seeds "
             f"{', '.join(map(str, p['seeds']))}. Teacher context: `{p['context']!r}` (top-k, k={p['k']}, forward KL). "
             f"Base: `opd sft` of a fresh tiny model ({p['tiny']['layers']} layers, hidden {p['tiny']['hidden']}), "
             f"{p['warmup_steps']} steps of {p['warmup_batch']} on {p['n_train']} training prompts, "
             f"{p['hint_ratio']:.0%} of them with the hint.", "",
             f"| model | held-out accuracy at {head} | per seed at step {last} | gain over the base at step {last} | "
             f"held-out prompts WITH the hint, step {last} | wall s per run |",
             "|---|" + "---|" * len(eval_at) + "---|---|---|---|"]
    blank = " |" * len(eval_at)
    for r in report["rows"]:
        if r["arm"] == "base":
            lines.append(f"| {r['label']} | {_f(r['acc'])} (step 0){' |' * (len(eval_at) - 1)} | | | "
                         f"{_f(r['hint_acc'])} | |")
        elif r["arm"] == "teacher":
            lines.append(f"| {r['label']} |{blank} | | **{_f(r['acc'])}** | |")
        elif not r["seeds"]:
            why = (r.get("error") or "").strip().splitlines()[-1:] or [""]
            lines.append(f"| {r['label']} | failed: {why[0].replace('|', '/')}{' |' * (len(eval_at) - 1)} | | | | |")
        else:
            accs = " | ".join(_f(a["acc"]) + (f" ± {_f(a['std'])}" if r["seeds"] > 1 else "")
                              for a in r["at"].values())
            lines.append(f"| {r['label']} | {accs} | {', '.join(_f(x) for x in r['per_seed'])} | {r['gain']:+.3f} | "
                         f"{_f(r['hint_acc'])} | {r['wall_s']:.0f} |")
    lines += ["", f"Mean ± standard deviation over seeds. Warm-up: {report['warmup_wall_s']:.0f} s. "
              f"Total wall time: {report['wall_s']:.0f} s. Machine: {report['machine']}.",
              f"Command: `{report['command']}`; library {report['code']['rev'][:10]}"
              f"{' + working tree' if report['code']['working_tree'] else ''}."]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- main


def run(args: argparse.Namespace) -> int:
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    tiny = getattr(args, "tiny", TINY)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    args.eval_at = sorted({int(n) for n in str(args.eval_steps).split(",") if n.strip()})
    if [a for a in arms if a not in ARMS] or not args.eval_at or args.eval_at[0] < 1 or args.batch < 1:
        raise SystemExit(f"opd bench self-distill: --arms of {', '.join(ARMS)}; --eval-steps and --batch >= 1")
    args.steps, args.checkpoint_every = args.eval_at[-1], math.gcd(*args.eval_at)
    try:
        args.context.format(prompt="1+1=", answer="2", response="2", domain="math")
    except (KeyError, IndexError, ValueError) as e:
        raise SystemExit(f"opd bench self-distill: --context {args.context!r}: {e!r}") from None
    seeds = [int(s) for s in str(args.seeds).split(",") if s.strip()]
    t_begin = time.time()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    code = snapshot_code(args.out, args.code_rev)
    env = code["env"]
    data = write_data(args.out, args.n_train, args.eval_prompts, args.hint_ratio, args.context)

    print(f"[self-distill] warm-up: {args.warmup_steps} steps of {args.warmup_batch}", flush=True)
    base_dir = args.out / "base"
    shutil.rmtree(base_dir, ignore_errors=True)
    (args.out / "configs").mkdir(exist_ok=True)
    wcfg = args.out / "configs" / "warmup.yaml"
    wcfg.write_text(yaml.safe_dump(warmup_config(base_dir, data, args.warmup_steps, args.warmup_batch, tiny),
                                   sort_keys=False))
    rc, warm_wall = run_logged(_opd("sft", wcfg, "--overwrite"), args.out / "warmup.log", env)
    if rc != 0:
        raise SystemExit(f"opd bench self-distill: the warm-up failed (exit {rc}):\n{_tail(args.out / 'warmup.log')}")
    base = base_dir / "model"

    server, address = None, None
    results: list[dict] = []
    try:
        if args.teacher == "server" and "self_distill" in arms:
            server = start_server_process(["--model", str(base), "--name", "self", "--max-k", "64"], env=env)
            address = server.address
        for seed in seeds:
            for arm in arms:
                results.append(train_arm(arm, seed, base, data, args, env, address))
    finally:
        if server is not None:
            server.stop(timeout_s=20)
    models = {"base": str(base), **{f"{r['arm']}/{r['seed']}/{n}": m for r in results if r["rc"] == 0
                                    for n, m in r["models"].items()}}
    print(f"[self-distill] evaluating {len(models)} models on {args.eval_prompts} held-out prompts", flush=True)
    scores = evaluate(models, data, args, env, base)
    for r in results:
        if r["rc"] == 0:
            r["points"] = {n: scores[f"{r['arm']}/{r['seed']}/{n}"] for n in args.eval_at}
    plan = {k: getattr(args, k) for k in ("steps", "eval_at", "batch", "lr", "k", "context", "hint_ratio",
                                          "warmup_steps", "warmup_batch", "n_train", "eval_prompts",
                                          "max_new_tokens", "teacher")}
    plan.update(seeds=seeds, arms=arms, tiny=tiny, quick=bool(args.quick))
    report = {"plan": plan, "base": scores["base"], "rows": summarize(scores["base"], results, args.eval_at),
              "results": results,
              "warmup_wall_s": warm_wall, "machine": machine(), "code": code["info"],
              "command": " ".join(["opd", *sys.argv[1:]] if Path(sys.argv[0]).name == "opd" else sys.argv),
              "wall_s": time.time() - t_begin}
    (args.out / "self_distill.json").write_text(json.dumps(report, indent=1))
    text = markdown(report)
    (args.out / "self_distill.md").write_text("# `opd bench self-distill`: self-distillation with a privileged "
                                              "context\n\n" + text)
    print("\n" + text, flush=True)
    print(f"[self-distill] wrote {args.out / 'self_distill.md'}, {args.out / 'self_distill.json'} "
          f"({report['wall_s']:.0f} s)", flush=True)
    return 0 if all(r["rc"] == 0 for r in results) else 1


def main(argv: list[str] | None = None) -> int:
    return standalone(sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())
