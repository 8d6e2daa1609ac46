"""`opd bench recipes`: held-out accuracy against compute for six post-training recipes.

From the demo's SFT start and with the demo's two RL experts as teachers (`make demo` builds
both under runs/demo), on the demo's math and code tasks:

    grpo         `opd rl`, GRPO against the math + code verifiers, no teacher
    offline      offline distillation: each teacher samples responses to training prompts of
                 its domain (--offline-samples in all), then `opd sft` on them
    opd_sampled  `opd train`, teachers in sampled mode (sampled-token reverse KL as an advantage)
    opd_topk     `opd train`, teachers in top-k mode (the demo's merge config)
    opd_reward   `opd train`, top-k teachers plus the math + code rewards (loss.reward_weight 1,
                 the reward less the step's other responses' mean: 32 prompts x 1; or with
                 --reward-advantage grpo, a group advantage over 8 prompts x 4)
    opd_full     `opd train`, teachers in full mode with beta 1: the exact per-position reverse
                 KL, of which opd_sampled is the one-sample estimate (not in the default arms'
                 table before 2026-12-04)

Budget: every run gets the same CPU-seconds (--cpu-budget; it is stopped when its processes
have used them) and the same --batch sequences per optimizer step (GRPO batch/8 prompts x 8
samples, OPD and OPD + reward batch x 1, offline SFT batches of `batch`), with a
constant learning rate after a short warm-up (no schedule that depends on where a run ends).
`--cpu-budget 0 --steps N` instead gives every run N optimizer steps.

Compute is counted per run as the CPU time (user + sys) of every process the run used: the
trainer and its children (code-verifier sandboxes included), the teacher servers while it
ran (idle polling too), and for offline distillation the teachers' sampling process. Tokens
sampled: the student's rollouts, or for offline distillation the teachers' samples.
Held-out accuracy is measured afterwards, outside the counted compute, on checkpoints
picked at --evals evenly spaced CPU-second marks: one greedy answer to each of the same
--eval-prompts math and code prompts (the demo's math_eval / code_eval), checked by the
domain verifier.

    opd bench recipes [--demo-dir runs/demo] [--out runs/recipes] [--seeds 0,1,2] [--cpu-budget 100]
    python -m opd.benchmarks.recipes --quick        # smoke test, about a minute

Writes OUT/recipes.md, OUT/recipes.json and OUT/recipes.png (accuracy against CPU-seconds and
against tokens sampled). Benchmarks report numbers; they do not assert them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

from opd.benchmarks import standalone
from opd.benchmarks.recipes_accounting import Counted, at, proc_table, run_counted, tree_cpu  # noqa: F401
from opd.benchmarks.recipes_report import (acc_at, machine, markdown, plot, reach,  # noqa: F401
                                           summarize)
from opd.benchmarks.recipes_worker import CODE_OPTIONS, _read_jsonl, _write_jsonl  # noqa: F401
from opd.benchmarks.recipes_inputs import (  # noqa: F401  (constants, inputs, configs)
    ARMS, DEFAULT_LRS, DOMAINS, GRPO_GROUP, Plan, QUICK, REPO, USES_SERVERS, domain_ratios, grpo_config, opd_config,
    parse_betas, parse_lrs, prepare_data, sft_config, snapshot_code, snapshot_demo)

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--demo-dir", type=Path, default=Path("runs/demo"),
                   help="the demo's folder (data/, sft_base/, rl_math/, rl_code/, configs/merge.yaml); "
                        "`make demo` builds it")
    p.add_argument("--out", type=Path, default=Path("runs/recipes"),
                   help="folder for the runs, recipes.md, recipes.json and recipes.png")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated training seeds (each arm runs once per seed)")
    p.add_argument("--cpu-budget", type=float, default=100.0,
                   help="CPU-seconds per run (all its processes, teachers' included); 0: no budget, --steps decides")
    p.add_argument("--steps", type=int, default=None,
                   help="optimizer steps per run (default: as many as the CPU budget allows; 150 without one)")
    p.add_argument("--batch", type=int, default=32, help="sequences per optimizer step (every arm; a multiple of 8)")
    p.add_argument("--evals", type=int, default=6,
                   help="checkpoints evaluated per run, at evenly spaced CPU-second marks (step 0, the SFT "
                        "start, is measured once)")
    p.add_argument("--eval-prompts", type=int, default=32, help="held-out prompts per domain (greedy, one answer each)")
    p.add_argument("--max-new-tokens", type=int, default=24, help="response length limit (rollouts, samples, eval)")
    p.add_argument("--offline-samples", type=int, default=6400,
                   help="offline distillation: teacher samples drawn before SFT (in the domain mix; one per "
                        "prompt, prompts reused once a domain's are all used)")
    p.add_argument("--betas", action="append", default=[], metavar="ARM=B1,B2",
                   help="an OPD arm's AdamW betas (repeatable), e.g. --betas opd_sampled=0.99,0.999; default: the "
                        "merge config's")
    p.add_argument("--lr", action="append", default=[], metavar="ARM=LR",
                   help="an arm's learning rate (repeatable), e.g. --lr opd_sampled=1e-4; the defaults are each "
                        f"arm's tuned rate ({', '.join(f'{a} {v:g}' for a, v in DEFAULT_LRS.items())}; "
                        "docs/benchmarks.md, the sweep)")
    p.add_argument("--reward-weight", type=float, default=1.0,
                   help="OPD + reward: loss.reward_weight, the weight of the reward's group advantage")
    p.add_argument("--reward-advantage", choices=["grpo", "batch"], default="batch",
                   help="OPD + reward: loss.reward_advantage; grpo: 8 prompts x 4 samples per step (its groups); "
                        "batch: 32 x 1, the reward less the step's other responses' mean")
    p.add_argument("--targets", default=None,
                   help="comma-separated accuracies for the 'CPU-s to reach' columns (default: 50%% and 80%% "
                        "of the teachers' own held-out accuracy)")
    p.add_argument("--code-rev", default=None,
                   help="run the library of this git commit (default: the working tree as it is at start); "
                        "either way it is copied to OUT/code first, so edits made while this runs change nothing")
    p.add_argument("--plot", type=Path, default=None, help="also copy the plot here (e.g. docs/img/recipes.png)")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke test: {QUICK} (checks the plumbing; the numbers mean nothing)")


# ----------------------------------------------------------------------------- runs


def _opd(*args) -> list[str]:
    return [sys.executable, "-m", "opd.cli", *map(str, args)]


def _worker_cmd(job: dict) -> list[str]:
    """This file's workers (sampling, evaluation), run as a script: the library they import is
    the snapshot's, this file the one running (which --code-rev's commit may not hold yet)."""
    return [sys.executable, "-P", str(Path(__file__).resolve().with_name("recipes_worker.py")), json.dumps(job)]


def _tail(log: Path, n: int = 6) -> str:
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    return "\n".join(lines[-n:])


def checkpoints(run_dir: Path) -> list[tuple[int, float, Path]]:
    """(step, wall time it was written, dir) of every complete checkpoint of a run."""
    out = []
    for d in (run_dir / "checkpoints").glob("step_*"):
        if re.fullmatch(r"step_\d+", d.name) and (d / "model" / "config.json").is_file() and (d / "state.json").is_file():
            out.append((int(d.name.split("_")[1]), (d / "state.json").stat().st_mtime, d))
    return sorted(out)


def pick(points: list[dict], marks: list[float]) -> list[dict]:
    """For each mark, the last point whose CPU-s is at or below it (each point once, in order)."""
    chosen = []
    for m in marks:
        below = [p for p in points if p["cpu_s"] <= m + 1e-9]
        if below and (not chosen or below[-1]["step"] != chosen[-1]["step"]):
            chosen.append(below[-1])
    return chosen


def tokens_by_step(run_dir: Path, arm: str, plan: Plan) -> dict[int, float]:
    """Cumulative tokens the student sampled up to each logged step (metrics.jsonl)."""
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    total, out = 0.0, {}
    for r in sorted((r for r in rows if "step" in r), key=lambda r: r["step"]):
        if arm == "grpo" and "length/mean" in r:
            total += r["length/mean"] * plan.batch
        elif arm != "grpo" and "response_len" in r and "loss" in r:
            total += r["response_len"] * plan.batch
        out[r["step"]] = total
    return out


def first_step_time(run_dir: Path) -> float | None:
    """Wall time of the first training step's metrics row: the trainer's CPU up to it is its
    start-up (imports, model load) and one step."""
    path = run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.is_file() else []:
        r = json.loads(line) if line.strip() else {}
        if "loss" in r and "time" in r:
            return r["time"]
    return None


class Bench:
    def __init__(self, plan: Plan, env: dict):
        self.plan, self.env = plan, env
        self.servers: list = []
        self.server_pids: list[int] = []
        self.server_startup_cpu = 0.0
        self.code: dict = {}

    # -- teacher servers: started once; what they spend while a run uses them is that run's
    def start_servers(self) -> None:
        from opd.teachers.launch import free_port, start_server_process

        t0 = time.time()
        env = {k: self.env[k] for k in ("TOKENIZERS_PARALLELISM", "PYTHONPATH", "PYTHONSAFEPATH") if k in self.env}
        for t in self.plan.merge["merge"]["teachers"]:
            port = free_port()
            self.plan.ports[t["name"]] = port
            self.servers.append(start_server_process(
                ["--model", self.plan.models[t["name"]]["path"], "--bind", f"tcp://127.0.0.1:{port}",
                 "--name", t["name"], "--max-k", "32"], threads=1, env=env))
            self.server_pids.append(self.servers[-1].proc.pid)
        self.server_startup_cpu = tree_cpu(self.server_pids)
        print(f"[recipes] teachers serving on {self.plan.ports} ({time.time() - t0:.0f} s, "
              f"{self.server_startup_cpu:.1f} CPU-s to start, counted in no run)", flush=True)

    def stop_servers(self) -> None:
        while self.servers:
            self.servers.pop().stop(timeout_s=20)

    # -- one arm, one seed
    def run_arm(self, arm: str, seed: int) -> dict:
        plan = self.plan
        run_dir = plan.out / "runs" / f"seed{seed}" / arm
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        cfg_path, log = run_dir / "config.yaml", run_dir / "run.log"
        offset, sampled_tokens, phases = 0.0, 0, {}
        t_start = time.time()
        if arm == "offline":
            files, sampled_tokens, sampling = self.sample_teachers(run_dir, seed)
            offset = sampling.cpu_s
            phases["teacher_sampling"] = {"cpu_s": offset, "wall_s": sampling.wall_s, "tokens": sampled_tokens}
            cfg_path.write_text(yaml.safe_dump(sft_config(plan, run_dir / "sft", seed, files), sort_keys=False))
            cmd, train_dir = _opd("sft", cfg_path, "--overwrite"), run_dir / "sft"
        elif arm == "grpo":
            cfg_path.write_text(yaml.safe_dump(grpo_config(plan, run_dir, seed), sort_keys=False))
            cmd, train_dir = _opd("rl", cfg_path, "--overwrite"), run_dir
        else:
            cfg_path.write_text(yaml.safe_dump(opd_config(plan, arm, run_dir, seed), sort_keys=False))
            cmd, train_dir = _opd("train", cfg_path, "--overwrite"), run_dir
        run = run_counted(cmd, log, self.env, also=self.server_pids if arm in USES_SERVERS else [],
                          offset=offset, budget=plan.budget or None)
        result = {"arm": arm, "seed": seed, "rc": 0 if run.stopped else run.rc, "stopped_by_budget": run.stopped,
                  "run_dir": str(run_dir), "config": str(cfg_path), "wall_s": time.time() - t_start, "phases": phases}
        if run.rc != 0 and not run.stopped:
            result["error"] = _tail(log)
            print(f"[recipes] {arm} seed {seed}: FAILED (exit {run.rc}); {log}:\n{result['error']}", flush=True)
            return result
        first = first_step_time(train_dir)
        phases["training"] = {"cpu_s": run.line[-1][1], "wall_s": run.wall_s,
                              "to_first_step_cpu_s": at(run.line, first) if first else None}
        if arm in USES_SERVERS:
            phases["teacher_servers"] = {"cpu_s": run.extra[-1][1]}
        tokens = tokens_by_step(train_dir, arm, plan)
        points = [{"step": step, "cpu_s": offset + at(run.line, t) + at(run.extra, t),
                   "tokens": sampled_tokens + max((v for s, v in tokens.items() if s <= step), default=0.0),
                   "model": str(d / "model")}
                  for step, t, d in checkpoints(train_dir)]
        points = [p for p in points if not plan.budget or p["cpu_s"] <= plan.budget]
        chosen = pick(points, [plan.budget * (i + 1) / plan.evals for i in range(plan.evals)]) if plan.budget else points
        keep = {p["step"] for p in chosen}
        for step, _, d in checkpoints(train_dir):   # only the evaluated checkpoints' weights are kept
            if step in keep:
                for name in ("optimizer.pt", "trainable.safetensors"):
                    (d / name).unlink(missing_ok=True)
            else:
                shutil.rmtree(d, ignore_errors=True)
        steps_done = max(tokens, default=chosen[-1]["step"] if chosen else 0)
        result.update(cpu_s=offset + run.cpu_s, steps=steps_done, checkpoints_written=len(points),
                      tokens=sampled_tokens + (max(tokens.values()) if tokens else 0.0), points=chosen)
        split = ", ".join(f"{k} {v['cpu_s']:.1f}" for k, v in phases.items())
        print(f"[recipes] {arm} seed {seed}: {result['cpu_s']:.1f} CPU-s ({split}), {steps_done} steps"
              f"{' (stopped by the budget)' if run.stopped else ''}, {result['tokens']:.0f} tokens sampled, "
              f"{result['wall_s']:.0f} s wall, {len(chosen)} checkpoints to evaluate", flush=True)
        return result

    def sample_teachers(self, run_dir: Path, seed: int) -> tuple[dict[str, Path], int, Counted]:
        """Offline distillation's data: --offline-samples prompts in the mixture's proportion,
        each answered once by its domain's teacher (temperature 1, as the rollouts), in a
        counted process."""
        plan = self.plan
        n = {"math": round(plan.offline_samples * plan.ratios["math"])}
        n["code"] = plan.offline_samples - n["math"]
        files = {d: run_dir / "teacher_samples" / f"{d}.jsonl" for d in DOMAINS}
        stats = run_dir / "teacher_samples" / "stats.json"
        job = {"kind": "sample", "seed": seed, "max_new_tokens": plan.max_new_tokens, "stats": str(stats),
               "domains": {d: {"teacher": plan.models[d]["path"], "prompts": str(plan.data[f"{d}_train"]),
                               "n": n[d], "out": str(files[d])} for d in DOMAINS}}
        run = run_counted(_worker_cmd(job), run_dir / "sampling.log", self.env)
        if run.rc != 0:
            raise RuntimeError(f"teacher sampling failed (exit {run.rc}):\n{_tail(run_dir / 'sampling.log')}")
        return files, int(json.loads(stats.read_text())["tokens"]), run

    # -- evaluation (not counted): the given models, in one process
    def evaluate(self, models: dict[str, str], tag: str) -> dict[str, dict]:
        if not models:
            return {}
        out = self.plan.out / "eval" / f"{tag}.json"
        job = {"kind": "eval", "models": models, "out": str(out), "max_new_tokens": self.plan.max_new_tokens,
               "tokenizer": self.plan.models["start"]["path"],
               "sets": {d: str(self.plan.data[f"{d}_eval"]) for d in DOMAINS}}
        log = self.plan.out / "eval" / f"{tag}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("wb") as f:
            rc = subprocess.call(_worker_cmd(job), cwd=REPO, env=self.env, stdout=f, stderr=subprocess.STDOUT)
        if rc != 0:
            raise RuntimeError(f"evaluation failed (exit {rc}):\n{_tail(log)}")
        return json.loads(out.read_text())


# ----------------------------------------------------------------------------- main


def make_report(args, plan: Plan, bench: Bench, ref: dict, results: list[dict], arms, seeds, t_begin) -> dict:
    teachers = {d: ref[f"teacher-{d}"][d] for d in DOMAINS}
    teacher_acc = statistics.fmean(teachers.values())
    targets = ([float(t) for t in args.targets.split(",")] if args.targets
               else [round(0.5 * teacher_acc, 3), round(0.8 * teacher_acc, 3)])
    return {"plan": {"cpu_budget": plan.budget, "steps": plan.steps, "batch": plan.batch, "evals": plan.evals,
                     "eval_prompts": args.eval_prompts, "max_new_tokens": plan.max_new_tokens, "lrs": plan.lrs,
                     "betas": plan.betas, "offline_samples": plan.offline_samples, "reward_weight": plan.reward_weight,
                     "reward_advantage": plan.reward_advantage, "ratios": plan.ratios, "seeds": seeds, "arms": arms,
                     "quick": bool(args.quick), "checkpoint_every": {a: plan.every(a) for a in arms},
                     "budget": (f"{plan.budget:g} CPU-s per run" if plan.budget else f"{plan.steps} steps per run")
                     + f", {plan.batch} sequences per step, every arm"},
            "inputs": {k: {"from": v["from"], "sha": v["sha"]} for k, v in plan.models.items()},
            "start": ref["start"], "teachers": teachers, "teacher_acc": teacher_acc, "targets": targets,
            "teacher_refs": {d: ref[f"teacher-{d}"] for d in DOMAINS},
            "server_startup_cpu": bench.server_startup_cpu, "machine": machine(), "code": bench.code,
            "command": " ".join(["opd", *sys.argv[1:]] if Path(sys.argv[0]).name == "opd" else sys.argv),
            "results": results, "rows": summarize(results, ref["start"]["all"], targets),
            "wall_s": time.time() - t_begin}


def run(args: argparse.Namespace) -> int:
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise SystemExit(f"opd bench recipes: unknown arm(s) {unknown}; choose from {', '.join(ARMS)}")
    seeds = [int(s) for s in str(args.seeds).split(",") if s.strip()]
    steps = args.steps if args.steps is not None else (100000 if args.cpu_budget else 150)
    if args.batch % GRPO_GROUP or steps < 1 or args.evals < 1 or args.cpu_budget < 0:
        raise SystemExit(f"opd bench recipes: --batch must be a multiple of {GRPO_GROUP}, --steps and --evals >= 1, "
                         "--cpu-budget >= 0")
    t_begin = time.time()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    snap = snapshot_demo(args.demo_dir.resolve(), out)
    merge = snap["merge"]
    ratios = domain_ratios(merge)
    data = prepare_data(Path(snap["data"]), ratios, args.eval_prompts)
    lrs = {**DEFAULT_LRS, **parse_lrs(args.lr)}
    plan = Plan(out=out, steps=steps, batch=args.batch, evals=args.evals, budget=args.cpu_budget,
                max_new_tokens=args.max_new_tokens, lrs={a: lrs[a] for a in arms}, ratios=ratios, data=data,
                models=snap["models"], merge=merge, offline_samples=args.offline_samples,
                reward_weight=args.reward_weight, reward_advantage=args.reward_advantage,
                betas={a: b for a, b in parse_betas(args.betas).items() if a in arms})
    code = snapshot_code(out, args.code_rev)
    print(f"[recipes] library snapshot in {code['info']['path']} ({code['info']['rev'][:10]}"
          f"{', working tree' if code['info']['working_tree'] else ''})", flush=True)
    bench = Bench(plan, code["env"])
    bench.code = code["info"]

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    results: list[dict] = []
    report: dict = {}
    reference = {"start": plan.models["start"]["path"], **{f"teacher-{d}": plan.models[d]["path"] for d in DOMAINS}}
    ref: dict = {}
    try:
        if any(a in USES_SERVERS for a in arms):
            bench.start_servers()
        for seed in seeds:
            batch = []
            for arm in arms:
                print(f"[recipes] seed {seed}: {arm}", flush=True)
                batch.append(bench.run_arm(arm, seed))
            # The SFT start and the teachers are evaluated once, with the first seed's checkpoints.
            models = {**({} if ref else reference),
                      **{f"{r['arm']}/{q['step']}": q["model"] for r in batch if r.get("points") for q in r["points"]}}
            print(f"[recipes] seed {seed}: evaluating {len(models)} models (not counted)", flush=True)
            scores = bench.evaluate(models, f"seed{seed}")
            ref = ref or {k: scores[k] for k in reference}
            for r in batch:
                for q in r.get("points", []):
                    sc = scores[f"{r['arm']}/{q['step']}"]
                    q.update(acc=sc["all"], **{d: sc[d] for d in DOMAINS})
                print(f"[recipes] {r['arm']} seed {seed}: accuracy at (step, CPU-s) " +
                      " ".join(f"({q['step']}, {q['cpu_s']:.0f}): {q['acc']:.2f}" for q in r.get("points", [])),
                      flush=True)
            results.extend(batch)
            report = make_report(args, plan, bench, ref, results, arms, seeds, t_begin)
            (out / "recipes.json").write_text(json.dumps(report, indent=1))
    except KeyboardInterrupt:
        print("[recipes] interrupted; teacher servers stopped", file=sys.stderr)
        return 130
    finally:
        bench.stop_servers()
    if not report:
        return 1
    report["wall_s"] = time.time() - t_begin
    report["machine"] = machine()
    (out / "recipes.json").write_text(json.dumps(report, indent=1))
    (out / "recipes.md").write_text("# `opd bench recipes`: held-out accuracy against compute\n\n" + markdown(report))
    plot(report, out / "recipes.png")
    if args.plot:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(out / "recipes.png", args.plot)
    print("\n" + markdown(report), flush=True)
    print(f"[recipes] wrote {out / 'recipes.md'}, {out / 'recipes.json'}, {out / 'recipes.png'} "
          f"({report['wall_s']:.0f} s)", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    return standalone(sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())
