"""`opd bench recipes`: held-out accuracy against compute for five post-training recipes.

From the demo's SFT start and with the demo's two RL experts as teachers (`make demo` builds
both under runs/demo), on the demo's math and code tasks:

    grpo         `opd rl`, GRPO against the math + code verifiers, no teacher
    offline      offline distillation: each teacher samples responses to training prompts of
                 its domain (--offline-samples in all), then `opd sft` on them
    opd_sampled  `opd train`, teachers in sampled mode (sampled-token reverse KL as an advantage)
    opd_topk     `opd train`, teachers in top-k mode (the demo's merge config)
    opd_reward   `opd train`, top-k teachers plus the math + code rewards (loss.reward_weight 1,
                 group advantage over 4 samples per prompt)

Budget: every run gets the same CPU-seconds (--cpu-budget; it is stopped when its processes
have used them) and the same --batch sequences per optimizer step (GRPO batch/8 prompts x 8
samples, OPD + reward batch/4 x 4, OPD batch x 1, offline SFT batches of `batch`), with a
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
import hashlib
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
ARMS = ("grpo", "offline", "opd_sampled", "opd_topk", "opd_reward")
LABELS = {"grpo": "GRPO alone (opd rl)", "offline": "offline distillation (opd sft on teacher samples)",
          "opd_sampled": "OPD sampled-token (opd train)", "opd_topk": "OPD top-k (opd train)",
          "opd_reward": "OPD top-k + reward (opd train)"}
SHORT = {"grpo": "GRPO", "offline": "offline distill", "opd_sampled": "OPD sampled",
         "opd_topk": "OPD top-k", "opd_reward": "OPD + reward"}
USES_SERVERS = {"opd_sampled", "opd_topk", "opd_reward"}
GRPO_GROUP = 8        # GRPO's group (the demo's rl configs)
REWARD_GROUP = 4      # OPD + reward's samples_per_prompt (the group its reward advantage needs)
DOMAINS = ("math", "code")
CODE_OPTIONS = {"timeout_s": 2.0, "workers": 2}   # the demo's code verifier options
# CPU-seconds per optimizer step at 32 sequences on the 2-core box (measured): only where the
# checkpoints go, so that about 2 x --evals of them fall inside the budget.
STEP_CPU = {"grpo": 0.7, "offline": 0.07, "opd_sampled": 0.25, "opd_topk": 0.21, "opd_reward": 0.75}
STARTUP_CPU = 6.0     # a trainer's imports and model load, about
QUICK = {"seeds": "0", "cpu_budget": 0.0, "steps": 4, "batch": 8, "evals": 2, "eval_prompts": 4, "offline_samples": 32}


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
    p.add_argument("--grpo-lr", type=float, default=5e-5, help="GRPO's learning rate (the demo's rl configs')")
    p.add_argument("--opd-lr", type=float, default=None,
                   help="OPD arms' learning rate (default: the demo merge config's optim.lr)")
    p.add_argument("--opd-sampled-lr", type=float, default=None,
                   help="OPD sampled-token's learning rate (default: --opd-lr; a seed-100 pilot at 3e-4 did not "
                        "learn either, docs/benchmarks.md)")
    p.add_argument("--reward-weight", type=float, default=1.0,
                   help="OPD + reward: loss.reward_weight, the weight of the reward's group advantage")
    p.add_argument("--sft-lr", type=float, default=1e-3, help="offline distillation's SFT learning rate")
    p.add_argument("--targets", default=None,
                   help="comma-separated accuracies for the 'CPU-s to reach' columns (default: 50%% and 80%% "
                        "of the teachers' own held-out accuracy)")
    p.add_argument("--code-rev", default=None,
                   help="run the library of this git commit (default: the working tree as it is at start); "
                        "either way it is copied to OUT/code first, so edits made while this runs change nothing")
    p.add_argument("--plot", type=Path, default=None, help="also copy the plot here (e.g. docs/img/recipes.png)")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke test: {QUICK} (checks the plumbing; the numbers mean nothing)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)


# ----------------------------------------------------------------------------- CPU accounting

_CLK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def proc_table() -> dict[int, tuple[int, float]]:
    """pid -> (ppid, CPU seconds): its own user + sys time plus that of the children it reaped
    (fields 14-17 of /proc/PID/stat). A process still in /proc (a zombie too) counts its own
    time here; once reaped, its time (and its reaped children's) is in its parent's."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                raw = f.read()
        except OSError:          # gone between listdir and open
            continue
        rest = raw[raw.rfind(b")") + 2:].split()
        utime, stime, cutime, cstime = (int(x) for x in rest[11:15])
        out[int(name)] = (int(rest[1]), (utime + stime + cutime + cstime) / _CLK)
    return out


def tree_cpu(roots, table: dict | None = None) -> float:
    """CPU seconds of the processes `roots` and every descendant still in /proc, with all the
    children any of them reaped: the whole tree's CPU so far (orphans re-parented to init are
    lost; what the trainers start, they wait for)."""
    table = proc_table() if table is None else table
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    total, stack, seen = 0.0, [r for r in roots if r in table], set()
    while stack:
        pid = stack.pop()
        if pid in seen:
            continue
        seen.add(pid)
        total += table[pid][1]
        stack.extend(children.get(pid, ()))
    return total


def at(timeline: list[tuple[float, float]], t: float) -> float:
    """The timeline's value at time t, linearly interpolated (clamped at its ends)."""
    if not timeline:
        return 0.0
    if t <= timeline[0][0]:
        return timeline[0][1]
    for (t0, c0), (t1, c1) in zip(timeline, timeline[1:]):
        if t <= t1:
            return c0 if t1 <= t0 else c0 + (c1 - c0) * (t - t0) / (t1 - t0)
    return timeline[-1][1]


@dataclass
class Counted:
    rc: int
    line: list[tuple[float, float]]          # (wall time, CPU-s of the process tree)
    extra: list[tuple[float, float]]         # (wall time, CPU-s of the `also` trees since the start)
    wall_s: float
    stopped: bool                            # stopped by the budget (SIGTERM from here)

    @property
    def cpu_s(self) -> float:
        return self.line[-1][1] + (self.extra[-1][1] if self.extra else 0.0)


def run_counted(cmd: list[str], log: Path, env: dict | None, *, also: list[int] = (), offset: float = 0.0,
                budget: float | None = None, interval: float = 0.2, cwd: Path = REPO) -> Counted:
    """Run `cmd`, sampling every `interval` s the CPU time of its process tree and of the trees
    of `also` (the teacher servers: what they spend while it runs is its cost too). When
    offset + both reach `budget`, the process gets SIGTERM (SIGKILL 10 s later). The tree's
    last point is the exact total from wait4: the process and every child it waited for."""
    log.parent.mkdir(parents=True, exist_ok=True)
    also = list(also)
    base = tree_cpu(also) if also else 0.0
    t0 = time.time()
    line, extra, stopped, term_at = [(t0, 0.0)], [(t0, 0.0)] if also else [], False, None
    with log.open("wb") as f:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT)
        try:
            while True:
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    break
                table, t = proc_table(), time.time()
                line.append((t, max(tree_cpu([proc.pid], table), line[-1][1])))
                if also:
                    extra.append((t, max(tree_cpu(also, table) - base, extra[-1][1])))
                used = offset + line[-1][1] + (extra[-1][1] if also else 0.0)
                if budget and used >= budget and term_at is None:
                    proc.send_signal(signal.SIGTERM)
                    stopped, term_at = True, t
                elif term_at is not None and t - term_at > 10:
                    proc.kill()
                time.sleep(interval)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    proc.returncode = os.waitstatus_to_exitcode(status)
    t1 = time.time()
    line.append((t1, max(usage.ru_utime + usage.ru_stime, line[-1][1])))
    if also:
        extra.append((t1, max(tree_cpu(also) - base, extra[-1][1])))
    return Counted(proc.returncode, line, extra, t1 - t0, stopped)


# ----------------------------------------------------------------------------- inputs


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")) if path.is_dir() else [path]:
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def snapshot_demo(demo: Path, out: Path) -> dict:
    """Copy the models and data this benchmark uses from the demo folder into OUT/inputs (the
    demo can be rebuilt while this runs); return their paths, fingerprints and the merge config."""
    need = {"SFT start": demo / "sft_base" / "model" / "config.json",
            "math teacher": demo / "rl_math" / "model" / "config.json",
            "code teacher": demo / "rl_code" / "model" / "config.json",
            "merge config": demo / "configs" / "merge.yaml",
            **{f"{d} {s} data": demo / "data" / f"{d}_{s}.jsonl" for d in DOMAINS for s in ("train", "eval")}}
    missing = [f"{what} ({path})" for what, path in need.items() if not path.is_file()]
    if missing:
        raise SystemExit(f"opd bench recipes: {demo} lacks " + ", ".join(missing) +
                         ". Run `make demo` first (it builds the SFT start, the teachers and the data), "
                         "or point --demo-dir at a finished demo folder.")
    inputs = out / "inputs"
    shutil.rmtree(inputs, ignore_errors=True)
    (inputs / "data").mkdir(parents=True)
    models = {}
    for key, src in (("start", "sft_base"), ("math", "rl_math"), ("code", "rl_code")):
        shutil.copytree(demo / src / "model", inputs / key)
        models[key] = {"path": str(inputs / key), "from": str(demo / src / "model"), "sha": _sha(inputs / key)}
    for d in DOMAINS:
        for s in ("train", "eval"):
            shutil.copy2(demo / "data" / f"{d}_{s}.jsonl", inputs / "data" / f"{d}_{s}.jsonl")
    merge = yaml.safe_load((demo / "configs" / "merge.yaml").read_text())
    return {"models": models, "merge": merge, "data": str(inputs / "data")}


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def domain_ratios(merge: dict) -> dict[str, float]:
    """The merge config's mixture (math 0.65, code 0.35 in the demo), normalized: every arm trains on it."""
    ratios = {d["domain"]: float(d.get("ratio", 1.0)) for d in merge["merge"]["datasets"] if d["domain"] in DOMAINS}
    total = sum(ratios.values())
    return {d: ratios.get(d, 0.0) / total for d in DOMAINS}


def prepare_data(data: Path, ratios: dict[str, float], eval_prompts: int) -> dict[str, Path]:
    """The held-out set every arm is measured on (the first `eval_prompts` of each domain's
    eval file) and GRPO's one training file: the two domains' rows interleaved in the
    mixture's proportion (opd rl draws prompts from one file uniformly)."""
    rows = {d: _read_jsonl(data / f"{d}_train.jsonl") for d in DOMAINS}
    scale = min(len(rows[d]) / ratios[d] for d in DOMAINS if ratios[d] > 0)   # the domain that runs out first
    n = {d: min(len(rows[d]), round(scale * ratios[d])) for d in DOMAINS}
    mixed, pos = [], {d: 0 for d in DOMAINS}
    while any(pos[d] < n[d] for d in DOMAINS):   # interleaved evenly: any window holds the mixture
        d = min((d for d in DOMAINS if pos[d] < n[d]), key=lambda d: (pos[d] + 0.5) / n[d])
        mixed.append(rows[d][pos[d]])
        pos[d] += 1
    paths = {"grpo_train": _write_jsonl(data / "grpo_train.jsonl", mixed)}
    for d in DOMAINS:
        paths[f"{d}_train"] = data / f"{d}_train.jsonl"
        paths[f"{d}_eval"] = _write_jsonl(data / f"{d}_heldout.jsonl", _read_jsonl(data / f"{d}_eval.jsonl")[:eval_prompts])
    return paths


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


def snapshot_code(out: Path, rev: str | None) -> dict:
    """The library as it is now (the working tree, or commit `rev`) copied to OUT/code in the
    layout its imports expect (pyproject's package-dir: rl/ becomes opd/rl, ...): every process
    of the benchmark imports it from there (PYTHONPATH, PYTHONSAFEPATH), so edits to the tree
    while it runs change nothing. Returns the environment to run with and what was taken."""
    import io
    import tarfile

    import tomllib

    root = out / "code"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)

    def git(*a):
        return subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True, check=False)

    src = REPO
    if rev:
        src = out / "code-src"
        shutil.rmtree(src, ignore_errors=True)
        src.mkdir()
        archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], capture_output=True, check=False)
        if archive.returncode:
            raise SystemExit(f"opd bench recipes: --code-rev {rev}: {archive.stderr.decode().strip()}")
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(src, filter="data")
    dirs = tomllib.loads((src / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for name, folder in sorted(dirs.items(), key=lambda kv: kv[0].count(".")):   # opd first, then opd.rl, ...
        shutil.copytree(src / folder, root / Path(*name.split(".")), dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    if rev:
        shutil.rmtree(src, ignore_errors=True)
    dirty = [line[3:] for line in git("status", "--porcelain", "--untracked-files=all").stdout.splitlines()
             if line[3:].endswith(".py")] if not rev else []   # what the snapshot holds beyond HEAD
    env = {**ENV, "PYTHONPATH": str(root), "PYTHONSAFEPATH": "1"}
    return {"env": env, "info": {"path": str(root), "rev": git("rev-parse", rev or "HEAD").stdout.strip(),
                                 "working_tree": not rev, "uncommitted_changes": dirty, "sha": _sha(root)}}


# ----------------------------------------------------------------------------- configs


@dataclass
class Plan:
    out: Path
    steps: int
    batch: int
    evals: int
    budget: float                  # CPU-s per run; 0: none
    max_new_tokens: int
    lrs: dict                      # arm -> learning rate
    ratios: dict
    data: dict
    models: dict
    merge: dict
    offline_samples: int = 6400
    reward_weight: float = 1.0
    ports: dict = field(default_factory=dict)

    def every(self, arm: str) -> int:
        """Checkpoint interval: --evals checkpoints at fixed steps; under a budget, about twice
        as many as --evals within it (the evaluated ones are picked by CPU-seconds)."""
        if not self.budget:
            return max(1, self.steps // self.evals)
        steps = (self.budget - STARTUP_CPU) / (STEP_CPU[arm] * self.batch / 32)
        return max(2, int(min(steps, self.steps) // (2 * self.evals)))


def _run_keys(plan: Plan, arm: str, out_dir: Path, seed: int) -> dict:
    return {"steps": plan.steps, "out_dir": str(out_dir), "seed": seed, "eval_every": 0,
            "checkpoint_every": plan.every(arm), "keep_checkpoints": 100000, "progress": False, "tensorboard": False}


def grpo_config(plan: Plan, out_dir: Path, seed: int) -> dict:
    return {
        "model": {"path": plan.models["start"]["path"], "device": "cpu"},
        "data": {"train": str(plan.data["grpo_train"]), "prompts_per_step": plan.batch // GRPO_GROUP},
        "rollout": {"engine": "hf", "group_size": GRPO_GROUP, "temperature": 1.0,
                    "max_new_tokens": plan.max_new_tokens, "batch_size": 64},
        "algorithm": {"advantage": "grpo", "epochs": 1, "kl_beta": 0.0, "loss_aggregation": "token_mean",
                      "micro_batch_size": plan.batch},
        "rewards": [{"name": "math"}, {"name": "code", "options": dict(CODE_OPTIONS)}],
        "optim": {"lr": plan.lrs["grpo"], "schedule": "constant", "warmup_steps": 5},
        "run": _run_keys(plan, "grpo", out_dir, seed),
    }


def opd_config(plan: Plan, arm: str, out_dir: Path, seed: int) -> dict:
    """The demo's merge config with this benchmark's student, data, teachers' addresses, budget
    and (opd_sampled) the teachers' mode; opd_reward adds the math and code rewards."""
    cfg = json.loads(json.dumps(plan.merge))   # a deep copy
    cfg["student"] = {"path": plan.models["start"]["path"], "device": "cpu"}
    m = cfg["merge"]
    for t in m["teachers"]:
        t["address"] = f"tcp://127.0.0.1:{plan.ports[t['name']]}"
        if arm == "opd_sampled":
            t["mode"] = "sampled"
            t.pop("k", None)
    m["datasets"] = [{"domain": d, "path": str(plan.data[f"{d}_train"]), "ratio": plan.ratios[d]} for d in DOMAINS]
    m.pop("sft", None)
    group = REWARD_GROUP if arm == "opd_reward" else 1
    cfg["rollout"] = {**cfg.get("rollout", {}), "prompts_per_step": plan.batch // group, "samples_per_prompt": group,
                      "temperature": 1.0, "max_new_tokens": plan.max_new_tokens}
    cfg["optim"] = {**cfg.get("optim", {}), "micro_batch_size": plan.batch, "lr": plan.lrs[arm], "schedule": "constant"}
    cfg["run"] = {**{k: v for k, v in cfg.get("run", {}).items() if k != "eval_prompts"},
                  **_run_keys(plan, arm, out_dir, seed)}
    if arm == "opd_reward":
        cfg["rewards"] = [{"name": "math"}, {"name": "code", "options": dict(CODE_OPTIONS)}]
        cfg["loss"] = {**cfg.get("loss", {}), "reward_weight": plan.reward_weight, "reward_advantage": "grpo"}
    return cfg


def sft_config(plan: Plan, out_dir: Path, seed: int, files: dict[str, Path]) -> dict:
    return {"out_dir": str(out_dir), "model": plan.models["start"]["path"],
            "train": [{"path": str(files[d]), "ratio": plan.ratios[d], "domain": d} for d in DOMAINS],
            "steps": plan.steps, "batch_size": plan.batch, "lr": plan.lrs["offline"], "warmup_steps": 10,
            "schedule": "constant", "log_every": 1, "seed": seed, "threads": 1, "device": "cpu",
            "checkpoint_every": plan.every("offline"), "keep_checkpoints": 100000}


# ----------------------------------------------------------------------------- runs


def _opd(*args) -> list[str]:
    return [sys.executable, "-m", "opd.cli", *map(str, args)]


def _worker_cmd(job: dict) -> list[str]:
    """This file's workers (sampling, evaluation), run as a script: the library they import is
    the snapshot's, this file the one running (which --code-rev's commit may not hold yet)."""
    return [sys.executable, "-P", str(Path(__file__).resolve()), "--worker", json.dumps(job)]


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


# ----------------------------------------------------------------------------- workers


def _load(path: str, tokenizer_from: str | None = None):
    """(hf rollout engine, tokenizer) of a model dir; a checkpoint's model/ has no tokenizer
    files, so `tokenizer_from` (the SFT start, whose tokenizer every run keeps) gives it."""
    from opd.rollout.hf import HFRolloutEngine
    from opd.spine.config import ModelConfig
    from opd.spine.model import load_policy, load_tokenizer

    tok = load_tokenizer(tokenizer_from or path, "model")
    model, tok = load_policy(ModelConfig(path=path, device="cpu"), tokenizer=tok, train=False, what="model")
    return HFRolloutEngine(model, tok, batch_size=64), tok


def _generate(engine, tok, prompts: list[str], params) -> list:
    from opd.data import encode_prompt

    return engine.generate([encode_prompt(tok, p) for p in prompts], params)


def _text(tok, r) -> str:
    ids = r.response_ids[:-1] if r.finish_reason == "eos" else r.response_ids
    return tok.decode(ids, skip_special_tokens=True)


def worker_sample(job: dict) -> dict:
    """Each domain's teacher answers job n prompts of its training file (a seeded shuffled cycle
    over it), one sample each at temperature 1; written as prompt/response JSONL."""
    import random

    import torch

    from opd.rollout import SamplingParams

    torch.set_num_threads(1)
    tokens = 0
    for i, (d, spec) in enumerate(job["domains"].items()):
        rows = _read_jsonl(Path(spec["prompts"]))
        rng = random.Random(job["seed"] * 7919 + i)
        order: list[dict] = []
        while len(order) < spec["n"]:
            block = rows[:]
            rng.shuffle(block)
            order.extend(block)
        order = order[:spec["n"]]
        engine, tok = _load(spec["teacher"])
        params = SamplingParams(temperature=1.0, max_new_tokens=job["max_new_tokens"], n=1, seed=job["seed"])
        rollouts = _generate(engine, tok, [r["prompt"] for r in order], params)
        tokens += sum(len(r.response_ids) for r in rollouts)
        _write_jsonl(Path(spec["out"]), [{"prompt": r["prompt"], "response": _text(tok, ro), "domain": d}
                                         for r, ro in zip(order, rollouts)])
        engine.close()
    stats = {"tokens": tokens, "sequences": sum(s["n"] for s in job["domains"].values())}
    Path(job["stats"]).write_text(json.dumps(stats))
    return stats


def worker_eval(job: dict) -> dict:
    """Greedy held-out accuracy of each model: {key: {math, code, all}} (the share of answers
    the domain verifier scores 1, as `opd validate`'s greedy column)."""
    import torch
    from opd.rl.rewards import accuracy, verify_batch

    from opd.data import load_jsonl
    from opd.rollout import SamplingParams

    torch.set_num_threads(1)
    sets = {d: load_jsonl(p)[0] for d, p in job["sets"].items()}
    params = SamplingParams(temperature=0.0, max_new_tokens=job["max_new_tokens"], n=1)
    results = {}
    for key, path in job["models"].items():
        engine, tok = _load(path, job.get("tokenizer"))
        res, right, n = {}, 0.0, 0
        for d, samples in sets.items():
            texts = [_text(tok, r) for r in _generate(engine, tok, [s.prompt for s in samples], params)]
            scores = [v if v is not None else 0.0 for v in verify_batch(samples, texts, **CODE_OPTIONS)]
            res[d] = accuracy(scores)
            right, n = right + res[d] * len(samples), n + len(samples)
        res["all"] = right / n
        results[key] = res
        engine.close()
        print(f"{key}: {res}", flush=True)
    Path(job["out"]).parent.mkdir(parents=True, exist_ok=True)
    Path(job["out"]).write_text(json.dumps(results, indent=1))
    return results


# ----------------------------------------------------------------------------- summary


def reach(points: list[dict], target: float, key: str = "cpu_s") -> float | None:
    """The compute (`key`) at the first evaluation whose accuracy is at least `target`; None if none is."""
    for p in points:
        if p["acc"] >= target - 1e-9:
            return p[key]
    return None


def acc_at(points: list[dict], x: float, start: float, key: str = "cpu_s") -> float:
    """The accuracy a run had at `x` CPU-s (or tokens): its last evaluation at or below it (the
    start before any)."""
    below = [p["acc"] for p in points if p[key] <= x + 1e-9]
    return below[-1] if below else start


def _mean_std(xs: list[float]) -> tuple[float, float]:
    return (statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0) if xs else (math.nan, math.nan)


def summarize(results: list[dict], start_acc: float, targets: list[float]) -> list[dict]:
    """One row per arm: final accuracy (mean, std over seeds), CPU-s, steps and tokens, and for
    each target the CPU-s (and tokens) to reach it (mean over the seeds that reached it, and
    how many did)."""
    rows = []
    for arm in dict.fromkeys(r["arm"] for r in results):
        ok = [r for r in results if r["arm"] == arm and r.get("rc") == 0 and r.get("points")]
        failed = [r for r in results if r["arm"] == arm and r not in ok]
        row = {"arm": arm, "label": LABELS.get(arm, arm), "seeds": len(ok), "failed": len(failed),
               "error": failed[0].get("error", "") if failed and not ok else ""}
        if ok:
            for name, vals in (("final_acc", [r["points"][-1]["acc"] for r in ok]),
                               ("final_math", [r["points"][-1]["math"] for r in ok]),
                               ("final_code", [r["points"][-1]["code"] for r in ok]),
                               ("best_acc", [max(p["acc"] for p in r["points"]) for r in ok]),
                               ("cpu_s", [r["cpu_s"] for r in ok]), ("tokens", [r["tokens"] for r in ok]),
                               ("steps", [r.get("steps", r["points"][-1]["step"]) for r in ok]),
                               ("wall_s", [r["wall_s"] for r in ok]),
                               ("startup_cpu_s", [r["phases"]["training"].get("to_first_step_cpu_s") or 0.0 for r in ok])):
                row[name], row[name + "_std"] = _mean_std(vals)
            row["reach"] = {}
            for target in targets:
                curves = [[{"acc": start_acc, "cpu_s": 0.0, "tokens": 0.0}] + r["points"] for r in ok]
                cpu = [c for c in (reach(pts, target) for pts in curves) if c is not None]
                tok = [c for c in (reach(pts, target, "tokens") for pts in curves) if c is not None]
                row["reach"][f"{target:.3f}"] = {"cpu_s": _mean_std(cpu)[0] if cpu else None,
                                                 "tokens": _mean_std(tok)[0] if tok else None,
                                                 "reached": len(cpu), "of": len(ok)}
        rows.append(row)
    return rows


def _fmt(x, spec=".0f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def markdown(report: dict) -> str:
    p = report["plan"]
    targets = report["targets"]
    reward = f"; OPD + reward: loss.reward_weight {p.get('reward_weight', 1.0):g}" if "opd_reward" in p["lrs"] else ""
    budget = (f"{p['cpu_budget']:.0f} CPU-s per run (stopped when its processes have used them; at most "
              f"{p['steps']} steps)" if p["cpu_budget"] else f"{p['steps']} optimizer steps per run")
    lines = [f"Held-out accuracy: greedy, {p['eval_prompts']} math + {p['eval_prompts']} code prompts (the demo's "
             f"eval sets), the share the domain verifier scores fully correct. SFT start: "
             f"{report['start']['all']:.3f} (math {report['start']['math']:.2f}, code {report['start']['code']:.2f}); "
             f"teachers on their own domain: math {report['teachers']['math']:.2f}, code {report['teachers']['code']:.2f} "
             f"(mean {report['teacher_acc']:.3f}).", "",
             f"Budget, every arm: {budget}, {p['batch']} sequences per optimizer step (GRPO {p['batch'] // GRPO_GROUP} "
             f"prompts x {GRPO_GROUP}; OPD + reward {p['batch'] // REWARD_GROUP} x {REWARD_GROUP}; OPD {p['batch']} x 1; "
             f"offline: {p['offline_samples']} teacher samples, then SFT batches of {p['batch']}); responses "
             f"<= {p['max_new_tokens']} tokens; domain mix {', '.join(f'{d} {r:.2f}' for d, r in p['ratios'].items())}; "
             f"constant learning rates after warm-up ({', '.join(f'{SHORT[a]} {lr:g}' for a, lr in p['lrs'].items())})"
             f"{reward}; "
             f"seeds {', '.join(map(str, p['seeds']))}. CPU-s: user + sys of every process of the run (trainer "
             f"and its children, code sandboxes included; the teacher servers while it ran; the offline arm's "
             f"teacher sampling); evaluation not counted. Mean ± std over seeds.", "",
             "| arm | seeds | accuracy at the end | math | code | best | CPU-s | of which to 1st step | steps | "
             "tokens sampled | wall s | " + " | ".join(f"CPU-s to reach {t:.2f}" for t in targets) + " | " +
             " | ".join(f"tokens to reach {t:.2f}" for t in targets) + " |",
             "|---|---|---|---|---|---|---|---|---|---|---|" + "---|" * (2 * len(targets))]
    for r in report["rows"]:
        if not r["seeds"]:
            why = r["error"].splitlines()[-1][:120].replace("|", "/") if r["error"] else "?"
            lines.append(f"| {r['label']} | 0 (failed: {why}) |" + " - |" * (9 + 2 * len(targets)))
            continue

        def reached(t, key, r=r):
            x = r["reach"][f"{t:.3f}"]
            if not x["reached"]:
                return f"not reached (0/{x['of']})"
            return _fmt(x[key]) + (f" ({x['reached']}/{x['of']})" if x["reached"] < x["of"] else "")

        failed = f" (+{r['failed']} failed)" if r["failed"] else ""
        lines.append(
            f"| {r['label']} | {r['seeds']}{failed} | {r['final_acc']:.3f} ± {r['final_acc_std']:.3f} | "
            f"{r['final_math']:.2f} | {r['final_code']:.2f} | {r['best_acc']:.3f} | "
            f"{r['cpu_s']:.0f} ± {r['cpu_s_std']:.0f} | {r['startup_cpu_s']:.0f} | {r['steps']:.0f} | "
            f"{r['tokens']:.0f} | {r['wall_s']:.0f} | "
            + " | ".join(reached(t, "cpu_s") for t in targets) + " | "
            + " | ".join(reached(t, "tokens") for t in targets) + " |")
    marks = (f"at the {p['evals']} marks {p['cpu_budget'] / p['evals']:.0f}, {2 * p['cpu_budget'] / p['evals']:.0f}, ... "
             f"CPU-s (the last checkpoint at or below each)" if p["cpu_budget"] else f"every {p['steps'] // p['evals']} steps")
    lines += ["", f"'CPU-s to reach X': the CPU-seconds at the first evaluated checkpoint at or above accuracy X, mean "
              f"over the seeds that got there ((n/N): only n of N did); checkpoints are evaluated {marks}, so it is "
              "an upper bound within one interval. 'of which to 1st step': the trainer's start-up (imports, model "
              "load) and its first step.", "",
              f"Teacher servers: started once ({report['server_startup_cpu']:.1f} CPU-s, counted in no run). "
              f"Library: {'working tree at ' if report['code'].get('working_tree') else ''}"
              f"{report['code'].get('rev', '?')[:10]}{' + uncommitted changes' if report['code'].get('uncommitted_changes') else ''}.",
              "", f"Machine: {report['machine']}. Whole benchmark: {report['wall_s']:.0f} s wall.", ""]
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12.5, 4.8))
    colors = dict(zip(ARMS, ("tab:red", "tab:green", "tab:purple", "tab:blue", "tab:orange")))
    start = report["start"]["all"]
    p = report["plan"]
    for ax, key, xlabel in ((axes[0], "cpu_s", "CPU-seconds (every process of the run)"),
                            (axes[1], "tokens", "tokens sampled")):
        for arm in dict.fromkeys(r["arm"] for r in report["results"]):
            runs = [r for r in report["results"] if r["arm"] == arm and r.get("points")]
            if not runs:
                continue
            for r in runs:   # each seed, thin
                ax.plot([0] + [q[key] for q in r["points"]], [start] + [q["acc"] for q in r["points"]],
                        color=colors.get(arm), alpha=0.3, lw=0.8, marker=".", ms=3)
            top = min(r["points"][-1][key] for r in runs)
            varies = all(r["points"][0][key] < r["points"][-1][key] for r in runs)
            if key == "cpu_s" and p["cpu_budget"]:   # the mean over seeds at each CPU mark
                xs = [0.0] + [p["cpu_budget"] * (i + 1) / p["evals"] for i in range(p["evals"])]
                accs = [[acc_at(r["points"], x, start) for r in runs] for x in xs]
            elif varies:   # the mean over seeds on a grid of the x every seed reached
                xs = [0.0] + [top * (i + 1) / p["evals"] for i in range(p["evals"])]
                accs = [[acc_at(r["points"], x, start, key) for r in runs] for x in xs]
            else:   # the mean over seeds at each evaluation
                n = min(len(r["points"]) for r in runs)
                xs = [0.0] + [statistics.fmean(r["points"][i][key] for r in runs) for i in range(n)]
                accs = [[start] * len(runs)] + [[r["points"][i]["acc"] for r in runs] for i in range(n)]
            ys = [statistics.fmean(a) for a in accs]
            es = [statistics.stdev(a) if len(a) > 1 else 0.0 for a in accs]
            ax.errorbar(xs, ys, yerr=es, color=colors.get(arm), marker="o", ms=4, lw=1.8, capsize=2,
                        label=f"{SHORT.get(arm, arm)} (n={len(runs)})")
        for t in report["targets"]:
            ax.axhline(t, color="grey", ls=":", lw=0.8)
        ax.axhline(report["teacher_acc"], color="black", ls="--", lw=0.8, label="teachers (own domain)")
        ax.axhline(start, color="grey", ls="-", lw=0.6, label="SFT start")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out accuracy (greedy, math + code)")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="upper left")
    budget = f"{p['cpu_budget']:.0f} CPU-s per run" if p["cpu_budget"] else f"{p['steps']} steps per run"
    fig.suptitle(f"Recipes from one SFT start, {budget}, {p['batch']} sequences per step, seeds "
                 f"{','.join(map(str, p['seeds']))} (mean ± std over seeds; thin: each seed)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine() -> str:
    cpu = platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    load = " ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    return f"{os.cpu_count()} CPU cores ({cpu}), no GPU used, Python {platform.python_version()}, load average at the end {load}"


# ----------------------------------------------------------------------------- main


def make_report(args, plan: Plan, bench: Bench, ref: dict, results: list[dict], arms, seeds, t_begin) -> dict:
    teachers = {d: ref[f"teacher-{d}"][d] for d in DOMAINS}
    teacher_acc = statistics.fmean(teachers.values())
    targets = ([float(t) for t in args.targets.split(",")] if args.targets
               else [round(0.5 * teacher_acc, 3), round(0.8 * teacher_acc, 3)])
    return {"plan": {"cpu_budget": plan.budget, "steps": plan.steps, "batch": plan.batch, "evals": plan.evals,
                     "eval_prompts": args.eval_prompts, "max_new_tokens": plan.max_new_tokens, "lrs": plan.lrs,
                     "offline_samples": plan.offline_samples, "reward_weight": plan.reward_weight, "ratios": plan.ratios, "seeds": seeds, "arms": arms,
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
    if args.worker:
        job = json.loads(args.worker)
        {"sample": worker_sample, "eval": worker_eval}[job["kind"]](job)
        return 0
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
    opd_lr = args.opd_lr if args.opd_lr is not None else float(merge.get("optim", {}).get("lr", 1e-3))
    lrs = {"grpo": args.grpo_lr, "offline": args.sft_lr, "opd_sampled": args.opd_sampled_lr or opd_lr,
           "opd_topk": opd_lr, "opd_reward": opd_lr}
    plan = Plan(out=out, steps=steps, batch=args.batch, evals=args.evals, budget=args.cpu_budget,
                max_new_tokens=args.max_new_tokens, lrs={a: lrs[a] for a in arms}, ratios=ratios, data=data,
                models=snap["models"], merge=merge, offline_samples=args.offline_samples,
                reward_weight=args.reward_weight)
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
    p = argparse.ArgumentParser(prog="python -m opd.benchmarks.recipes", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
