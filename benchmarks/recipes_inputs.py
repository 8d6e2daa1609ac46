"""`opd bench recipes`: its arms' constants, the inputs it copies, and each arm's config."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from opd.benchmarks.recipes_worker import CODE_OPTIONS, _read_jsonl, _write_jsonl  # noqa: F401

REPO = Path(__file__).resolve().parent.parent
ARMS = ("grpo", "offline", "opd_sampled", "opd_topk", "opd_reward", "opd_full")
LABELS = {"grpo": "GRPO alone (opd rl)", "offline": "offline distillation (opd sft on teacher samples)",
          "opd_sampled": "OPD sampled-token (opd train)", "opd_topk": "OPD top-k (opd train)",
          "opd_reward": "OPD top-k + reward (opd train)",
          "opd_full": "OPD exact reverse KL (opd train, mode full, beta 1)"}
SHORT = {"grpo": "GRPO", "offline": "offline distill", "opd_sampled": "OPD sampled",
         "opd_topk": "OPD top-k", "opd_reward": "OPD + reward", "opd_full": "OPD reverse KL"}
USES_SERVERS = {"opd_sampled", "opd_topk", "opd_reward", "opd_full"}
GRPO_GROUP = 8        # GRPO's group (the demo's rl configs)
REWARD_GROUP = 4      # OPD + reward's samples_per_prompt with a group advantage (--reward-advantage grpo)
DOMAINS = ("math", "code")
# CPU-seconds per optimizer step at 32 sequences on the 2-core box (measured): only where the
# checkpoints go, so that about 2 x --evals of them fall inside the budget.
STEP_CPU = {"grpo": 0.7, "offline": 0.07, "opd_sampled": 0.25, "opd_topk": 0.21, "opd_reward": 0.75, "opd_full": 0.25}
STARTUP_CPU = 6.0     # a trainer's imports and model load, about
# Each arm's learning rate (constant after a short warm-up): the best of a sweep on a seed the
# table does not use (docs/benchmarks.md, "Recipes against compute").
DEFAULT_LRS = {"grpo": 1e-5, "offline": 1e-3, "opd_sampled": 3e-5, "opd_topk": 1e-3, "opd_reward": 1e-3,
               "opd_full": 1e-3}
QUICK = {"seeds": "0", "cpu_budget": 0.0, "steps": 4, "batch": 8, "evals": 2, "eval_prompts": 4, "offline_samples": 32}


# ----------------------------------------------------------------------------- inputs


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")) if path.is_dir() else [path]:
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def reward_group(advantage: str) -> int:
    """OPD + reward's samples per prompt: a group advantage needs a group; `batch` needs none."""
    return 1 if advantage == "batch" else REWARD_GROUP


def parse_arm_values(items: list[str], flag: str, arms, value):
    """["ARM=VALUE", ...] -> {ARM: value("VALUE")} for `arms`; `value` raises ValueError on a bad
    value, and a bad item exits with the flag and what is wrong."""
    out = {}
    for item in items:
        arm, _, text = item.partition("=")
        try:
            if arm not in arms:
                raise ValueError(f"unknown arm {arm!r} for {flag}; choose from {', '.join(sorted(arms))}")
            out[arm] = value(text)
        except ValueError as e:
            raise SystemExit(f"opd bench recipes: {flag} {item!r}: {e}") from None
    return out


def _lr(text: str) -> float:
    if (lr := float(text)) <= 0:
        raise ValueError("a learning rate is positive")
    return lr


def _betas(text: str) -> list[float]:
    betas = [float(b) for b in text.split(",")]
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        raise ValueError("two values in [0, 1)")
    return betas


def parse_lrs(items: list[str]) -> dict[str, float]:
    """["opd_topk=1e-3", ...] -> {"opd_topk": 0.001}."""
    return parse_arm_values(items, "--lr", ARMS, _lr)


def parse_betas(items: list[str]) -> dict[str, list[float]]:
    """["opd_sampled=0.99,0.999", ...] -> {"opd_sampled": [0.99, 0.999]}: AdamW's betas of an OPD
    arm (its config's optim.betas)."""
    return parse_arm_values(items, "--betas", USES_SERVERS, _betas)


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
    reward_advantage: str = "batch"   # batch: 32 prompts x 1 (no groups); grpo: 8 x 4
    betas: dict = field(default_factory=dict)   # OPD arm -> AdamW's betas (else the merge config's)
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
        "data": {"train": str(plan.data["grpo_train"])},
        "rollout": {"engine": "hf", "prompts_per_step": plan.batch // GRPO_GROUP, "samples_per_prompt": GRPO_GROUP,
                    "temperature": 1.0,
                    "max_new_tokens": plan.max_new_tokens, "batch_size": 64},
        "algorithm": {"advantage": "grpo", "epochs": 1, "kl_beta": 0.0, "loss_aggregation": "token_mean",
                      "micro_batch_size": plan.batch},
        "rewards": [{"name": "math"}, {"name": "code", "options": dict(CODE_OPTIONS)}],
        "optim": {"lr": plan.lrs["grpo"], "schedule": "constant", "warmup_steps": 5},
        "run": _run_keys(plan, "grpo", out_dir, seed),
    }


def opd_config(plan: Plan, arm: str, out_dir: Path, seed: int) -> dict:
    """The demo's merge config with this benchmark's student, data, teachers' addresses, budget
    and (opd_sampled, opd_full) the teachers' mode; opd_reward adds the math and code rewards.
    opd_full is the exact per-position reverse KL, the objective whose unbiased one-sample
    estimate opd_sampled is: side by side they part the estimator's noise from the direction."""
    cfg = json.loads(json.dumps(plan.merge))   # a deep copy
    cfg["student"] = {"path": plan.models["start"]["path"], "device": "cpu"}
    m = cfg["merge"]
    for t in m["teachers"]:
        t["address"] = f"tcp://127.0.0.1:{plan.ports[t['name']]}"
        if arm == "opd_sampled":
            t["mode"] = "sampled"
            t.pop("k", None)
        elif arm == "opd_full":
            t.update(mode="full", beta=1.0)
            t.pop("k", None)
    m["datasets"] = [{"domain": d, "path": str(plan.data[f"{d}_train"]), "ratio": plan.ratios[d]} for d in DOMAINS]
    m.pop("sft", None)
    group = reward_group(plan.reward_advantage) if arm == "opd_reward" else 1
    cfg["rollout"] = {**cfg.get("rollout", {}), "prompts_per_step": plan.batch // group, "samples_per_prompt": group,
                      "temperature": 1.0, "max_new_tokens": plan.max_new_tokens}
    cfg["optim"] = {**cfg.get("optim", {}), "micro_batch_size": plan.batch, "lr": plan.lrs[arm], "schedule": "constant"}
    if arm in plan.betas:
        cfg["optim"]["betas"] = plan.betas[arm]
    cfg["run"] = {**{k: v for k, v in cfg.get("run", {}).items() if k != "eval_prompts"},
                  **_run_keys(plan, arm, out_dir, seed)}
    if arm == "opd_reward":
        cfg["rewards"] = [{"name": "math"}, {"name": "code", "options": dict(CODE_OPTIONS)}]
        cfg["loss"] = {**cfg.get("loss", {}), "reward_weight": plan.reward_weight,
                       "reward_advantage": plan.reward_advantage}
    return cfg


def sft_config(plan: Plan, out_dir: Path, seed: int, files: dict[str, Path]) -> dict:
    return {"model": {"path": plan.models["start"]["path"], "device": "cpu"},
            "data": {"train": [{"path": str(files[d]), "ratio": plan.ratios[d], "domain": d} for d in DOMAINS],
                     "batch_size": plan.batch},
            "optim": {"lr": plan.lrs["offline"], "warmup_steps": 10, "schedule": "constant"},
            "run": {"steps": plan.steps, "out_dir": str(out_dir), "log_every": 1, "seed": seed, "threads": 1,
                    "checkpoint_every": plan.every("offline"), "keep_checkpoints": 100000}}
