"""`opd bench step`: one on-policy distillation step, this project vs TRL's trainers.

Same student, same teacher, same prompts, same batch (default: tiny models, 8 prompts x 32
new tokens; `--preset small-real`: SmolLM2-135M's shapes, 4 chat prompts x 32, see
step_real.py; `--student DIR --teacher DIR`: any local models), fp32 on CPU, forward KL
(beta=0), fully on-policy:
  opd-full   `opd train`, teacher in its own `opd serve-teacher` process, mode full; the
             trainer forks that process after its imports (cluster.mode fork), or with
             `--teacher-launch process` it is started beforehand as its own interpreter
  opd-topk   the same with the teacher's top-k answer (--k) and its tail bucket
  opd-topk-pipelined  opd-topk with `run.pipeline: true` (staleness 1): NOT fully on-policy
  trl-gkd    TRL `GKDTrainer` with lmbda=1 (every step samples from the student), teacher
             in the trainer's process (TRL's design); trl-distill TRL's `DistillationTrainer`
             (step_trl.py)
Each runs in its own process, `--rounds` times, the systems taking turns; the first
`--warmup` steps of a run are dropped and the rest pooled. Reported: trained
response tokens per second, seconds per step, peak RSS of the trainer (and of the teacher
server for opd, which TRL does not have), the peak of the processes' summed PSS (trainer +
teacher server for opd, TRL's one process), and for opd the time per phase (rollout,
waiting for the teacher after the student's first forward, loss + backward + optimizer). TRL is a benchmark extra: it runs with
`--trl-python` (default: this interpreter if it imports trl, else .venv-bench/bin/python,
which `make bench` creates); without it the TRL row is skipped and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from opd.benchmarks.step_memory import GroupMemory, wait_child
from opd.benchmarks.step_real import prompts_file
from opd.benchmarks.step_trl import has_distillation_trainer
from opd.teachers.launch import start_server_process
from opd.tiny import build_tiny_model

REPO = Path(__file__).resolve().parents[1]
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}Q: {{ m['content'] }}\nA:"
                 "{% else %} {{ m['content'] }}<|endoftext|>{% endif %}{% endfor %}")


def sums(n: int) -> list[str]:
    """n distinct prompts "a+b=?" with two-digit a and b, the same for every run: no step of a run
    repeats a prompt, which opd's teacher would find in its prompt cache (step_real.prompts_file)."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(0).shuffle(pairs)
    return [f"{a}+{b}=?" for a, b in pairs[:n]]


def build_models(work: Path | str, vocab: int | None = None, prompts: int = 8) -> tuple[Path, Path, Path]:
    """Student (2 layers, ~0.4M params) and teacher (4 layers, ~2M), one chat template, and
    `prompts` distinct prompts; `vocab` pads both models' vocabulary (LM head rows) to a real model's size."""
    from transformers import AutoTokenizer

    work = Path(work)

    student = build_tiny_model(work / "student", layers=2, hidden=64, intermediate=128, seed=0, vocab_size=vocab)
    teacher = build_tiny_model(work / "teacher", layers=4, hidden=128, heads=4, kv_heads=2, intermediate=256, seed=1,
                               vocab_size=vocab)
    for d in (student, teacher):
        tok = AutoTokenizer.from_pretrained(str(d))
        tok.chat_template = CHAT_TEMPLATE
        tok.save_pretrained(str(d))
    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "domain": "math", "response": "0"}) + "\n" for p in sums(prompts)))
    return student, teacher, data


def run_opd(work: Path, student: Path, teacher: Path, data: Path, mode: str, steps: int, warmup: int,
            threads: int = 1, launch: str = "fork", batch: int = 8, new_tokens: int = 32, k: int = 32,
            pipeline: bool = False, teacher_threads: int | None = None, interval_s: float = 0.05) -> dict:
    """One `opd train` run. launch: fork: the trainer forks its teacher server (cluster.mode fork,
    the runtime held once); process: the teacher is an `opd serve-teacher` started beforehand.
    pipeline: `run.pipeline: true`, the next batch sampled while this one trains (staleness 1).
    teacher_threads: the teacher server's torch threads (None: `threads`, the trainer's)."""
    teacher_threads = teacher_threads or threads
    serve_args = ["--max-k", str(max(64, k))]
    import yaml

    memory = GroupMemory(interval_s)
    server = None
    name = f"opd-{mode}" + ("-pipelined" if pipeline else "")
    out = work / name
    shutil.rmtree(out, ignore_errors=True)  # a fresh run each round, not a resume
    try:
        if launch == "process":
            server = start_server_process(["--model", str(teacher), *serve_args], threads=teacher_threads)
            memory.pids.append(server.proc.pid)
        cfg = {
            "student": {"path": str(student)},
            "merge": {"teachers": [{"name": "teacher", "address": server.address if server else "tcp://127.0.0.1:*",
                                    "mode": mode, "k": k, "beta": 0.0, "domains": ["math"]}],
                      "datasets": [{"domain": "math", "path": str(data)}],
                      "routing": {"rules": [{"kind": "fallback", "teacher": "teacher"}]}},
            "rollout": {"prompts_per_step": batch, "max_new_tokens": new_tokens, "temperature": 1.0},
            "loss": {"trim": "none"},
            # AdamW at opd's defaults (fused, as transformers' Trainer, so both TRL trainers, has it)
            "optim": {"lr": 1e-4, "warmup_steps": 0, "schedule": "constant", "micro_batch_size": batch},
            "run": {"steps": steps, "out_dir": str(out), "pipeline": pipeline, "eval_every": 0,
                    "checkpoint_every": 0, "progress": False, "tensorboard": False},
        }
        if launch == "fork":
            cfg["cluster"] = {"mode": "fork", "teachers": [{"name": "teacher", "model": str(teacher),
                                                            "serve_args": serve_args,
                                                            "num_cpus": teacher_threads}]}
        path = work / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        proc = subprocess.Popen([sys.executable, "-m", "opd.cli", "train", str(path)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        memory.pids.append(proc.pid)
        text = proc.stdout.read()
        code, rss = wait_child(proc)
        if code != 0:
            raise RuntimeError(f"opd train failed ({code}):\n{text[-3000:]}")
    finally:
        if server is not None:
            server.stop()
        pss = memory.stop()
    # The trainer's own peak: wait4's ru_maxrss also covers the children it reaped (its forked
    # teacher), so it was the larger of the two processes, not the trainer's.
    rss = memory.hwm.get(proc.pid) or rss
    teacher_rss = max((v for p, v in memory.hwm.items() if p != proc.pid), default=0)
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if l.strip()]
    rows = [r for r in rows if "step_s" in r]
    steps_ = [{"tokens": r["tokens"], "step_s": r["step_s"], "rollout": r["rollout_s"],
               "teacher_wait": r["teacher_wait_s"], "loss_backward_optim": r["step_s"] - r["rollout_s"] - r["teacher_wait_s"]}
              for r in rows][warmup:]
    # The measured steps' CPU: from the end of the last warm-up step to the end of the last step
    # (each row's time is when it was logged, right after its step).
    cpu = memory.cpu_between(rows[warmup - 1]["time"] if warmup else rows[0]["time"] - rows[0]["step_s"],
                             rows[-1]["time"])
    return {**summarize(name, steps_, rss, teacher_rss, pss, cpu), "teacher_launch": launch}


PHASES = ("rollout", "teacher_wait", "loss_backward_optim")


def summarize(system: str, steps: list[dict], rss: int, teacher_rss: int, pss: int, cpu_s: float) -> dict:
    """One row from measured steps ({tokens, step_s[, phases]}), the peaks of memory and the CPU
    seconds all the system's processes spent in those steps."""
    tokens = sum(r["tokens"] for r in steps)
    return {
        "system": system, "steps_measured": len(steps), "step_s": statistics.median(r["step_s"] for r in steps),
        "tokens_per_s": tokens / sum(r["step_s"] for r in steps),
        "cpu_s": cpu_s, "cpu_us_per_token": 1e6 * cpu_s / tokens,
        "cores": cpu_s / sum(r["step_s"] for r in steps),
        "peak_rss_trainer": rss, "peak_rss_teacher": teacher_rss, "peak_pss_total": pss,
        "phases_s": ({k: statistics.median(r[k] for r in steps) for k in PHASES} if PHASES[0] in steps[0] else None),
        "steps": steps,
    }


def pool(rows: list[dict]) -> dict:
    """The rows of one system from several rounds as one: every measured step, the highest peaks."""
    pooled = summarize(rows[0]["system"], [s for r in rows for s in r["steps"]],
                       *(max(r[k] for r in rows) for k in ("peak_rss_trainer", "peak_rss_teacher", "peak_pss_total")),
                       sum(r["cpu_s"] for r in rows))
    return {**pooled, **({"teacher_launch": rows[0]["teacher_launch"]} if "teacher_launch" in rows[0] else {})}


def _trl_python(arg: str | None) -> str | None:
    """The interpreter to run TRL with: the one given, this one if it has trl, else .venv-bench's."""
    import importlib.util

    if arg:
        return arg
    if importlib.util.find_spec("trl") is not None:
        return sys.executable
    bench = REPO / ".venv-bench" / "bin" / "python"
    return str(bench) if bench.exists() else None


def run_trl(python: str, work: Path, student: Path, teacher: Path, steps: int, warmup: int, threads: int = 1,
            trainer: str = "gkd", batch: int = 8, new_tokens: int = 32, interval_s: float = 0.05) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
    code = (f"from opd.benchmarks.step_trl import trl_main; trl_main({str(work)!r}, {str(student)!r}, {str(teacher)!r}, "
            f"{steps}, {threads}, {trainer!r}, {batch}, {new_tokens})")
    memory = GroupMemory(interval_s)
    proc = subprocess.Popen([python, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    memory.pids.append(proc.pid)
    text = proc.stdout.read()
    rc, rss = wait_child(proc)
    pss = memory.stop()
    line = next((l for l in text.splitlines() if l.startswith("TRL_RESULT ")), None)
    if rc != 0 or line is None:
        raise RuntimeError(f"TRL run failed ({rc}):\n{text[-3000:]}")
    res = json.loads(line[len("TRL_RESULT "):])
    steps = [{"tokens": n, "step_s": t} for n, t in zip(res["tokens"][warmup:], res["times"][warmup:])]
    ends = res["ends"]
    cpu = memory.cpu_between(ends[warmup - 1] if warmup else ends[0] - res["times"][0], ends[-1])
    return summarize(f"trl-{trainer}", steps, rss, 0, pss, cpu)


SYSTEMS = ["opd-full", "opd-topk", "opd-topk-pipelined", "trl-gkd", "trl-distill"]
# --preset small-real: SmolLM2-135M's shapes (step_real.py); one step is ~3 s on 2 cores, so
# fewer steps than the tiny models' 60, and torch's default threads (both cores) per process but
# opd's teacher server, which takes one core fewer: it prefills while the student samples on
# all the cores (top-64 on 2 cores: 33.5 tokens/s at 2 teacher threads, 38.8 at 1, two runs of
# 2026-12-03 10:10-10:22 UTC; the trainer never waited for the teacher at either).
PRESETS = {
    "tiny": dict(steps=60, warmup=5, rounds=3, batch=8, new_tokens=32, k=32, threads=1,
                 systems=["opd-full", "opd-topk", "trl-gkd"], memory_interval=0.05),
    "small-real": dict(steps=6, warmup=1, rounds=2, batch=4, new_tokens=32, k=64, threads=os.cpu_count() or 1,
                       teacher_threads=max(1, (os.cpu_count() or 1) - 1), systems=SYSTEMS, memory_interval=0.25),
}
QUICK = dict(steps=2, warmup=1, rounds=1)


def _by_preset(key: str) -> str:
    """What an option left unset becomes: each preset's value, e.g. "unset: tiny 5, small-real 1"."""
    return "unset: " + ", ".join(f"{name} {values[key]}" for name, values in PRESETS.items())


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", type=Path, default=None, help="write the rows as JSON here")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                   help="tiny: 2- and 4-layer models, byte tokenizer; small-real: random weights at SmolLM2-135M's "
                        "config (teacher 30 layers, student its first 8, V=49,152, tied), a 49,152-token BPE, chat "
                        "prompts. Sets the defaults of the options below")
    p.add_argument("--student", type=Path, default=None, help="a local student model directory (with --teacher)")
    p.add_argument("--teacher", type=Path, default=None, help="a local teacher model directory (with --student)")
    p.add_argument("--quick", action="store_true", help="2 steps (1 measured), 1 round: a smoke run")
    # tiny: 3 runs of 60 steps per system: one step of the tiny models is 0.06-0.1 s, and
    # shorter runs (2 of 18) gave ratios to TRL between 1.32x and 1.74x on this 2-core box.
    p.add_argument("--steps", type=int, default=None,
                   help=f"steps per run (the first --warmup are dropped) ({_by_preset('steps')})")
    p.add_argument("--warmup", type=int, default=None,
                   help=f"first steps of each run left out of the timings ({_by_preset('warmup')})")
    p.add_argument("--rounds", type=int, default=None,
                   help=f"runs per system, the systems taking turns; steps pooled ({_by_preset('rounds')})")
    p.add_argument("--batch", type=int, default=None, help=f"prompts per step ({_by_preset('batch')})")
    p.add_argument("--new-tokens", type=int, default=None,
                   help=f"new tokens sampled per prompt ({_by_preset('new_tokens')})")
    p.add_argument("--k", type=int, default=None, help=f"opd-topk's k ({_by_preset('k')})")
    p.add_argument("--systems", nargs="+", default=None, choices=SYSTEMS,
                   help="systems timed: opd-full (teacher answers the full vocabulary), opd-topk (top-k + tail), "
                        "opd-topk-pipelined (run.pipeline: true, staleness 1, not fully on-policy), trl-gkd (TRL "
                        "GKDTrainer, lmbda=1), trl-distill (TRL DistillationTrainer); TRL rows skipped without trl")
    p.add_argument("--trl-python", default=None, help="interpreter that has trl installed")
    p.add_argument("--vocab", type=int, default=None,
                   help="tiny: pad both models' vocabulary to this many rows; None: the byte tokenizer's 260")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads of every process (TRL's, opd's trainer, opd's teacher server)")
    p.add_argument("--teacher-threads", type=int, default=None,
                   help="torch threads of opd's teacher server (unset: tiny --threads, small-real one fewer than the "
                        "cores, at least 1)")
    p.add_argument("--omp-wait-policy", choices=["passive", "active"], default=None,
                   help="OMP_WAIT_POLICY of every process of every system, TRL's too (forced PASSIVE slowed "
                        "TRL from 56-62 to 45 tokens/s at small-real); None: each system's own (libgomp's "
                        "default; opd train sets PASSIVE itself when it forks its teacher)")
    # Reading smaps_rollup of 2.5 GB processes every 50 ms took ~0.3 of a core from the systems
    p.add_argument("--memory-interval", type=float, default=None, help="seconds between PSS samples")
    p.add_argument("--teacher-launch", choices=["fork", "process"], default="fork",
                   help="fork: opd train forks its teacher server (cluster.mode fork: one copy of the Python and "
                        "torch runtime in memory); process: an `opd serve-teacher` started beforehand")


def _settle(args) -> None:
    """The preset's defaults for every option left unset, --quick's on top."""
    for key, value in {**PRESETS[args.preset], **(QUICK if args.quick else {})}.items():
        if getattr(args, key) is None or (args.quick and key in QUICK):
            setattr(args, key, value)


def prepare(args, work: Path) -> tuple[Path, Path, Path]:
    """(student, teacher, prompts file): given directories, or built in a child process so that
    this process never maps torch (see GroupMemory)."""
    if (args.student is None) != (args.teacher is None):
        raise SystemExit("opd bench step: --student and --teacher go together")
    prompts = args.batch * args.steps   # one run's worth, none repeated
    if args.student is not None:
        return args.student.resolve(), args.teacher.resolve(), prompts_file(work, prompts)
    if args.preset == "small-real":
        code = f"from opd.benchmarks.step_real import build_small_real; build_small_real({str(work)!r}, {prompts})"
    else:
        code = f"from opd.benchmarks.step import build_models; build_models({str(work)!r}, {args.vocab}, {prompts})"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": str(REPO)},
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return work / "student", work / "teacher", work / "prompts.jsonl"


def run(args) -> int:
    _settle(args)
    if not 0 <= args.warmup < args.steps:
        raise SystemExit(f"opd bench step: --warmup ({args.warmup}) must lie in [0, --steps ({args.steps}))")
    work = Path(tempfile.mkdtemp(prefix="opd-bench-step-"))
    try:
        return _run(args, work)
    finally:   # the small-real models and every run's output: about 1 GB
        shutil.rmtree(work, ignore_errors=True)


def _run(args, work: Path) -> int:
    if args.omp_wait_policy:   # inherited by every child: opd's trainer, its forked teacher, TRL
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy.upper()
    student, teacher, data = prepare(args, work)
    python = _trl_python(args.trl_python)
    systems = [s for s in args.systems if not s.startswith("trl-") or python is not None]
    if len(systems) < len(args.systems):
        print("trl: skipped (trl not installed; `make bench` installs it into .venv-bench)")
    if "trl-distill" in systems and not has_distillation_trainer(python):
        systems.remove("trl-distill")
        print("trl-distill: skipped (this TRL has no DistillationTrainer)")
    # Systems take turns, round after round: drifts of a shared machine hit all of them alike.
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    for r in range(args.rounds):
        for system in systems:
            if system.startswith("trl-"):
                row = run_trl(python, work, student, teacher, args.steps, args.warmup, args.threads,
                              system.split("-")[1], args.batch, args.new_tokens, args.memory_interval)
            else:
                row = run_opd(work, student, teacher, data, system.split("-")[1], args.steps, args.warmup,
                              args.threads, args.teacher_launch, args.batch, args.new_tokens, args.k,
                              pipeline=system.endswith("-pipelined"), teacher_threads=args.teacher_threads,
                              interval_s=args.memory_interval)
            runs[system].append(row)
            print(f"round {r + 1}/{args.rounds}  " + _fmt(row), flush=True)
    rows = [pool(v) for v in runs.values()]
    for row in rows:
        row["fully_on_policy"] = not row["system"].endswith("-pipelined")
        print(_fmt(row), flush=True)
    trls = [r for r in rows if r["system"].startswith("trl-")]
    trl = max(trls, key=lambda r: r["tokens_per_s"]) if trls else None
    if trl:
        print(f"against the faster TRL trainer: {trl['system']}")
        for r in rows:
            r["vs_trl_system"] = trl["system"]
            r["tokens_per_s_vs_trl"] = r["tokens_per_s"] / trl["tokens_per_s"]
            # per token of CPU: the ratio at equal CPU (opd's teacher scores on the other core)
            r["tokens_per_cpu_s_vs_trl"] = trl["cpu_us_per_token"] / r["cpu_us_per_token"]
            r["peak_rss_vs_trl"] = r["peak_rss_trainer"] / trl["peak_rss_trainer"]
            r["peak_pss_total_vs_trl"] = r["peak_pss_total"] / trl["peak_pss_total"]
            print(f"{r['system']:<19} {r['tokens_per_s_vs_trl']:.2f}x TRL tokens/s, "
                  f"{r['tokens_per_cpu_s_vs_trl']:.2f}x TRL tokens per CPU second, "
                  f"{r['peak_rss_vs_trl']:.2f}x TRL trainer peak RSS, "
                  f"{r['peak_pss_total_vs_trl']:.2f}x TRL total peak PSS (trainer + teacher server)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        machine = f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at the end"
        settings = {k: getattr(args, k) for k in ("preset", "steps", "warmup", "rounds", "batch", "new_tokens", "k",
                                                  "threads", "teacher_threads", "omp_wait_policy")}
        args.json.write_text(json.dumps({"machine": machine, "settings": settings, "rows": rows}, indent=1))
    return 0


def _fmt(r: dict) -> str:
    phases = ""
    if r["phases_s"]:
        phases = "  phases: " + ", ".join(f"{k} {v:.3f}s" for k, v in r["phases_s"].items())
    return (f"{r['system']:<19} {r['tokens_per_s']:8.1f} tok/s  {r['cpu_us_per_token']:6.0f} CPU us/token "
            f"({r['cores']:.2f} cores)  {r['step_s']:.3f} s/step  trainer RSS "
            f"{r['peak_rss_trainer'] / 2**20:6.0f} MiB  teacher RSS {r['peak_rss_teacher'] / 2**20:5.0f} MiB  "
            f"total PSS {r['peak_pss_total'] / 2**20:5.0f} MiB{phases}")
