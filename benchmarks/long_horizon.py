"""`opd bench long`: where on-policy distillation pays off, on answers 16 to 256 tokens long.

The task is `opd.tiny.chain`: a short program's trace written out, each step depending on the
one before, so one wrong step makes the answer wrong; its response length is the knob. A
teacher (4 layers, hidden 128) is trained by SFT to near-perfect; the student is smaller
(2 layers, hidden 64) and starts from a weak or a mid-strength SFT on the same traces.
From each start, every arm gets the same CPU-seconds (every process of the run counted, as
`opd bench recipes` counts them, the teacher server's and the offline arms' teacher sampling
included) and 32 sequences per optimizer step:

    offline           the teacher samples training prompts (counted), then `opd sft` on them
    offline_filtered  the same, keeping the samples the verifier accepts (rejection sampling)
    opd_topk          `opd train`, the teacher's top-k (k 16) + tail bucket
    opd_sampled       `opd train`, the sampled-token reverse KL as an advantage
    opd_full          `opd train`, the full-vocabulary divergence
    opd_reward        `opd train`, top-k plus the verifier's batch advantage (32 prompts x 1)
    grpo              `opd rl`, the verifier alone (4 prompts x 8)
    offline_then_opd  the recipe's order: `offline` for half the budget, then `opd_topk` from there
    trl               TRL's DistillationTrainer on the same models and prompts (`--trl-python`)

Checkpoints picked at --evals CPU-second marks get a greedy answer to each of the 100 prompts of
the run's length (not counted). The report: accuracy against CPU-seconds per length, and the
CPU-seconds each arm needs to reach 80 % of the teacher's accuracy against the length.

    opd bench long [--out runs/long] [--lengths 16,64,256] [--starts mid] [--seeds 0,1,2]
    python -m opd.benchmarks.long_horizon --quick      # the plumbing, a few minutes

Writes OUT/long.md, OUT/long.json and OUT/long.png. Benchmarks report; they assert nothing.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from opd.benchmarks import standalone
from opd.benchmarks.long_horizon_report import markdown, plot, summarize
from opd.benchmarks.recipes import checkpoints, pick
from opd.benchmarks.recipes_accounting import at, run_counted
from opd.benchmarks.recipes_inputs import ENV, REPO, snapshot_code
from opd.benchmarks.recipes_report import machine
from opd.benchmarks.recipes_worker import _read_jsonl, _write_jsonl
from opd.tiny.chain import STEPS_FOR_TOKENS, write_chain_data

ARMS = ("offline", "offline_filtered", "opd_topk", "opd_sampled", "opd_full", "opd_reward", "grpo",
        "offline_then_opd", "trl")
USES_SERVER = {"opd_topk", "opd_sampled", "opd_full", "opd_reward", "offline_then_opd"}
TEACHER = {"layers": 4, "hidden": 128, "heads": 4, "kv_heads": 2, "intermediate": 256}
STUDENT = {"layers": 2, "hidden": 64, "heads": 2, "kv_heads": 1, "intermediate": 128}
# SFT steps (batch 32, mixed lengths, lr 3e-3 constant) of the teacher, and of the student's two
# starts (one run: its checkpoint at "weak" steps, and its end)
PREP_STEPS = {"teacher": 1000, "weak": 500, "mid": 600}
DEFAULT_LRS = {"offline": 1e-3, "offline_filtered": 1e-3, "opd_topk": 1e-3, "opd_sampled": 1e-4, "opd_full": 1e-3,
               "opd_reward": 1e-3, "grpo": 5e-5, "offline_then_opd": 1e-3, "trl": 1e-3}
DEFAULT_BUDGET = {16: 40.0, 64: 100.0, 256: 300.0}   # CPU-s per run, by response length
QUICK = {"lengths": "16", "seeds": "0", "starts": "weak", "budget": "16=25", "evals": 2, "eval_prompts": 8,
         "prep_scale": 0.02}


@dataclass
class Plan:
    out: Path
    lengths: list[int]
    starts: list[str]
    seeds: list[int]
    arms: list[str]
    budget: dict[int, float]
    evals: int
    eval_prompts: int
    lrs: dict[str, float]
    beta: float
    trl_python: str | None
    prep_scale: float = 1.0
    batch: int = 32
    inputs: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    server: object | None = None

    def steps(self, length: int) -> int:
        return STEPS_FOR_TOKENS[length]

    def every(self, arm: str, length: int) -> int:
        """Checkpoint interval: about 3 x --evals of them in the budget, from a rough CPU-s per step."""
        per_step = {"offline": 0.02, "offline_filtered": 0.02}.get(arm, 0.25) * length / 16 + 0.05
        return max(1, int(self.budget[length] / per_step / (3 * self.evals)))


def _opd(*args) -> list[str]:
    return [sys.executable, "-m", "opd.cli", *map(str, args)]


def _worker(job: dict) -> list[str]:
    return [sys.executable, "-P", str(REPO / "benchmarks" / "recipes_worker.py"), json.dumps(job)]


# ----------------------------------------------------------------------------- inputs


def prepare(plan: Plan, inputs: Path) -> dict:
    """Data, teacher and starts under `inputs` (kept: a rerun with the same scale reuses them)."""
    stamp = inputs / "prepared.json"
    if stamp.is_file() and json.loads(stamp.read_text()).get("prep") == [plan.prep_scale, PREP_STEPS]:
        return json.loads(stamp.read_text())
    data = inputs / "data"
    mix = write_chain_data(data / "mix", list(STEPS_FOR_TOKENS.values()), n_train=40000, n_eval=90, seed=0)
    sets = {}
    for length in (16, 64, 256):
        paths = write_chain_data(data / f"L{length}", plan.steps(length), n_train=20000, n_eval=100, seed=0)
        sets[str(length)] = {"train": str(paths["train"]), "eval": str(paths["eval"])}
    models = {}
    weak = max(1, int(PREP_STEPS["weak"] * plan.prep_scale))
    for name, spec, steps in (("teacher", TEACHER, PREP_STEPS["teacher"]), ("student", STUDENT, PREP_STEPS["mid"])):
        steps = max(weak + 1, int(steps * plan.prep_scale))
        cfg = {"model": {"tiny": {**spec, "max_positions": 320, "seed": 0}},
               "data": {"train": [{"path": str(mix["train"])}], "batch_size": 32, "max_length": 300},
               "optim": {"lr": 3e-3, "schedule": "constant", "warmup_steps": 30},
               "run": {"steps": steps, "out_dir": str(inputs / name), "log_every": 50, "threads": 1, "seed": 0,
                       **({"checkpoint_every": weak, "keep_checkpoints": 1000} if name == "student" else {})}}
        models[name] = str(inputs / name / "model")
        if (inputs / f"{name}.yaml").is_file() and yaml.safe_load((inputs / f"{name}.yaml").read_text()) == cfg \
                and (inputs / name / "model" / "config.json").is_file():
            continue   # prepared before with this config
        (inputs / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
        if name == "teacher":   # another teacher samples at another cost
            (inputs / "sample_cpu.json").unlink(missing_ok=True)
        log = inputs / f"{name}.log"
        print(f"[long] preparing the {name}: opd sft, {steps} steps", flush=True)
        run = run_counted(_opd("sft", inputs / f"{name}.yaml", "--overwrite"), log, plan.env)
        if run.rc:
            raise SystemExit(f"opd bench long: preparing the {name} failed; see {log}")
    # the starts: the student SFT's checkpoint after PREP_STEPS["weak"] steps, and its end
    models["weak"] = str(inputs / "student" / "checkpoints" / f"step_{weak:06d}" / "model")
    models["mid"] = models.pop("student")
    from transformers import AutoTokenizer   # a checkpoint's model/ holds no tokenizer: the byte tokenizer, as every model's

    AutoTokenizer.from_pretrained(models["mid"]).save_pretrained(models["weak"])
    prepared = {"prep": [plan.prep_scale, PREP_STEPS], "sets": sets, "models": models}
    stamp.write_text(json.dumps(prepared, indent=1))
    return prepared


# ----------------------------------------------------------------------------- configs


def train_config(plan: Plan, arm: str, length: int, start: str, out_dir: Path, seed: int, model: str) -> dict:
    mode = {"opd_sampled": "sampled", "opd_full": "full"}.get(arm, "topk")
    teacher = {"name": "chain", "address": f"tcp://127.0.0.1:{plan.server.port}", "mode": mode, "beta": plan.beta}
    if mode == "topk":
        teacher["k"] = 16
    if mode == "sampled":
        teacher.pop("beta")
    cfg = {"student": {"path": model, "device": "cpu"},
           "merge": {"teachers": [teacher],
                     "datasets": [{"domain": "chain", "path": plan.inputs["sets"][str(length)]["train"]}],
                     "routing": {"rules": [{"kind": "fallback", "teacher": "chain"}]}},
           "rollout": {"prompts_per_step": plan.batch, "samples_per_prompt": 1, "temperature": 1.0,
                       "max_new_tokens": length + 8},
           "loss": {"length_norm": "token", "trim": "eos"},
           "optim": {"lr": plan.lrs[arm], "warmup_steps": 5, "schedule": "constant", "micro_batch_size": plan.batch},
           "run": {"steps": 100000, "out_dir": str(out_dir), "seed": seed, "eval_every": 0, "progress": False,
                   "tensorboard": False, "checkpoint_every": plan.every(arm, length), "keep_checkpoints": 100000}}
    if arm == "opd_reward":   # the reward less the step's other answers' mean: 32 distinct prompts for the teacher
        cfg["rewards"] = [{"name": "math"}]
        cfg["loss"]["reward_advantage"] = "batch"
    return cfg


def grpo_config(plan: Plan, length: int, out_dir: Path, seed: int, model: str) -> dict:
    return {"model": {"path": model, "device": "cpu"},
            "data": {"train": plan.inputs["sets"][str(length)]["train"]},
            "rollout": {"engine": "hf", "prompts_per_step": plan.batch // 8, "samples_per_prompt": 8,
                        "temperature": 1.0, "max_new_tokens": length + 8},
            "algorithm": {"advantage": "grpo", "epochs": 1, "kl_beta": 0.0, "loss_aggregation": "token_mean",
                          "micro_batch_size": plan.batch},
            "rewards": [{"name": "math"}],
            "optim": {"lr": plan.lrs["grpo"], "schedule": "constant", "warmup_steps": 5},
            "run": {"steps": 100000, "out_dir": str(out_dir), "seed": seed, "eval_every": 0, "progress": False,
                    "tensorboard": False, "checkpoint_every": plan.every("grpo", length), "keep_checkpoints": 100000}}


def sft_config(plan: Plan, arm: str, length: int, out_dir: Path, seed: int, model: str, data: Path) -> dict:
    return {"model": {"path": model, "device": "cpu"},
            "data": {"train": [{"path": str(data)}], "batch_size": plan.batch, "max_length": 300},
            "optim": {"lr": plan.lrs[arm], "warmup_steps": 5, "schedule": "constant"},
            "run": {"steps": 100000, "out_dir": str(out_dir), "log_every": 1, "seed": seed, "threads": 1,
                    "checkpoint_every": plan.every(arm, length), "keep_checkpoints": 100000}}


# ----------------------------------------------------------------------------- runs


def points_of(run, run_dir: Path, offset: float, budget: float) -> list[dict]:
    """(step, CPU-s, model dir) of each checkpoint within the budget."""
    pts = [{"step": step, "cpu_s": offset + at(run.line, t) + at(run.extra, t), "model": str(d / "model")}
           for step, t, d in checkpoints(run_dir)]
    return [p for p in pts if p["cpu_s"] <= budget + 1e-6]


def trl_points(run, run_dir: Path, budget: float) -> list[dict]:
    pts = []
    for d in run_dir.glob("checkpoint-*"):
        state = d / "trainer_state.json"
        if state.is_file():
            t = state.stat().st_mtime
            pts.append({"step": int(d.name.split("-")[1]), "cpu_s": at(run.line, t), "model": str(d)})
    return [p for p in sorted(pts, key=lambda p: p["step"]) if p["cpu_s"] <= budget + 1e-6]


def sample_teacher(plan: Plan, length: int, run_dir: Path, seed: int, n: int, filtered: bool):
    """The teacher's answers to n training prompts of this length (counted), JSONL for `opd sft`;
    filtered: only those the verifier accepts."""
    out = run_dir / "teacher_samples" / "chain.jsonl"
    stats = run_dir / "teacher_samples" / "stats.json"
    job = {"kind": "sample", "seed": seed, "max_new_tokens": length + 8, "stats": str(stats),
           "domains": {"chain": {"teacher": plan.inputs["models"]["teacher"], "n": n, "out": str(out),
                                 "prompts": plan.inputs["sets"][str(length)]["train"]}}}
    run = run_counted(_worker(job), run_dir / "sampling.log", plan.env)
    if run.rc:
        raise RuntimeError(f"teacher sampling failed; see {run_dir / 'sampling.log'}")
    rows = _read_jsonl(out)
    if filtered:
        from opd.data import Sample
        from opd.rewards import math_reward

        answers = {r["prompt"]: r["answer"] for r in _read_jsonl(Path(plan.inputs["sets"][str(length)]["train"]))}
        rows = [r for r in rows if math_reward(Sample(prompt=r["prompt"], answer=answers[r["prompt"]]), r["response"]) >= 1]
        _write_jsonl(out, rows)
    return out, run, len(rows)


def run_arm(plan: Plan, arm: str, length: int, start: str, seed: int) -> dict:
    run_dir = plan.out / "runs" / f"L{length}" / start / f"seed{seed}" / arm
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    budget, model = plan.budget[length], plan.inputs["models"][start]
    server = [plan.server.proc.pid] if arm in USES_SERVER else []
    result = {"arm": arm, "length": length, "start": start, "seed": seed, "run_dir": str(run_dir)}
    t0 = time.time()
    if arm in ("offline", "offline_filtered", "offline_then_opd"):
        share = budget / 2 if arm == "offline_then_opd" else budget
        # samples: a third of the (offline part's) budget, the sampler's start-up included
        cost = plan.inputs["sample_cpu"][str(length)]
        n = max(plan.batch, int((share / 3 - cost["startup_cpu_s"]) / cost["per_sample_cpu_s"]))
        n = min(n, 20000)   # the size of the length's training file
        data, sampling, kept = sample_teacher(plan, length, run_dir, seed, n, arm == "offline_filtered")
        result.update(samples=n, kept=kept, sampling_cpu_s=sampling.cpu_s)
        if not kept:
            result.update(rc=1, points=[], error=f"the verifier accepted none of the teacher's {n} samples")
            return result
        cfg, log = run_dir / "sft.yaml", run_dir / "sft.log"
        cfg.write_text(yaml.safe_dump(sft_config(plan, arm, length, run_dir / "sft", seed, model, data)))
        run = run_counted(_opd("sft", cfg, "--overwrite"), log, plan.env, offset=sampling.cpu_s, budget=share)
        points = points_of(run, run_dir / "sft", sampling.cpu_s, share)
        if arm == "offline_then_opd" and points:
            spent, handover = points[-1]["cpu_s"], points[-1]["model"]
            from transformers import AutoTokenizer   # a checkpoint's model/ holds no tokenizer

            AutoTokenizer.from_pretrained(model).save_pretrained(handover)
            cfg, log = run_dir / "opd.yaml", run_dir / "opd.log"
            cfg.write_text(yaml.safe_dump(train_config(plan, arm, length, start, run_dir / "opd", seed, handover)))
            run = run_counted(_opd("train", cfg, "--overwrite"), log, plan.env, also=server, offset=spent,
                              budget=budget)
            points += points_of(run, run_dir / "opd", spent, budget)
    elif arm == "grpo":
        cfg, log = run_dir / "config.yaml", run_dir / "run.log"
        cfg.write_text(yaml.safe_dump(grpo_config(plan, length, run_dir, seed, model)))
        run = run_counted(_opd("rl", cfg, "--overwrite"), log, plan.env, budget=budget)
        points = points_of(run, run_dir, 0.0, budget)
    elif arm == "trl":
        log = run_dir / "run.log"
        job = {"student": model, "teacher": plan.inputs["models"]["teacher"], "out": str(run_dir),
               "prompts": plan.inputs["sets"][str(length)]["train"], "lr": plan.lrs["trl"], "beta": plan.beta,
               "batch": plan.batch, "new_tokens": length + 8, "seed": seed, "save_steps": plan.every("trl", length)}
        run = run_counted([plan.trl_python, "-P", str(REPO / "benchmarks" / "long_horizon_trl.py"), json.dumps(job)],
                          log, plan.env, budget=budget)
        points = trl_points(run, run_dir, budget)
    else:
        cfg, log = run_dir / "config.yaml", run_dir / "run.log"
        cfg.write_text(yaml.safe_dump(train_config(plan, arm, length, start, run_dir, seed, model)))
        run = run_counted(_opd("train", cfg, "--overwrite"), log, plan.env, also=server, budget=budget)
        points = points_of(run, run_dir, 0.0, budget)
    failed = run.rc != 0 and not run.stopped
    chosen = pick(points, [budget * (i + 1) / plan.evals for i in range(plan.evals)])
    result.update(rc=run.rc if failed else 0, wall_s=time.time() - t0, points=chosen, checkpoints=len(points))
    if failed:
        result["error"] = log.read_text(errors="replace")[-800:] if log.is_file() else ""
    print(f"[long] L{length} {start} seed {seed} {arm}: {len(points)} checkpoints, {len(chosen)} to evaluate, "
          f"{result['wall_s']:.0f} s wall{' FAILED' if failed else ''}", flush=True)
    return result


def evaluate(plan: Plan, models: dict[str, str], length: int, tag: str) -> dict:
    if not models:
        return {}
    out = plan.out / "eval" / f"{tag}.json"
    job = {"kind": "eval", "models": models, "out": str(out), "max_new_tokens": length + 8,
           "tokenizer": plan.inputs["models"]["teacher"], "sets": {"chain": plan.inputs["eval_sets"][str(length)]}}
    run = run_counted(_worker(job), plan.out / "eval" / f"{tag}.log", plan.env)
    if run.rc:
        raise RuntimeError(f"evaluation failed; see {plan.out / 'eval' / f'{tag}.log'}")
    return json.loads(out.read_text())


def measure_sampling(plan: Plan, inputs: Path) -> dict[str, dict[str, float]]:
    """The teacher's sampling cost at each length: its process's start-up and the CPU-s per
    further sample (batches of 64). An offline arm spends a third of its budget sampling,
    start-up included: (share / 3 - start-up) / per sample samples. The two runs differ by 16
    batches, so that the difference is well above the noise of a CPU reading (from 64 and 320
    prompts the first runs read 0.02 CPU-s of difference at 16 tokens, and sampled 69,002
    answers for a 40 CPU-s run). Kept in INPUTS/sample_cpu.json: the parts of a study that share
    their inputs draw their offline samples by one measurement (at 256 tokens it costs 73 CPU-s)."""
    stored = inputs / "sample_cpu.json"
    out = json.loads(stored.read_text()) if stored.is_file() else {}
    for length in plan.lengths:
        if str(length) in out:
            continue
        cpu = {}
        for n in (64, 17 * 64):
            d = inputs / "sampling" / f"L{length}_{n}"
            shutil.rmtree(d, ignore_errors=True)
            cpu[n] = sample_teacher(plan, length, d, 0, n, False)[1].cpu_s
        per = (cpu[17 * 64] - cpu[64]) / (16 * 64)
        if per <= 0:
            raise RuntimeError(f"the teacher's sampling cost at {length} tokens read {cpu}: not measurable here")
        out[str(length)] = {"startup_cpu_s": max(cpu[64] - 64 * per, 0.0), "per_sample_cpu_s": per}
        stored.write_text(json.dumps(out, indent=1))
    return {str(length): out[str(length)] for length in plan.lengths}


# ----------------------------------------------------------------------------- main


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("runs/long"), help="runs, inputs, long.md/json/png")
    p.add_argument("--lengths", default="16,64,256", help="response lengths in tokens, of 16, 64, 256")
    p.add_argument("--starts", default="mid", help="student starts, of weak, mid")
    p.add_argument("--seeds", default="0,1,2", help="training seeds")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    p.add_argument("--budget", default=",".join(f"{k}={v:g}" for k, v in DEFAULT_BUDGET.items()),
                   help="CPU-s per run by length, LENGTH=SECONDS,...")
    p.add_argument("--evals", type=int, default=6, help="checkpoints evaluated per run, at CPU-second marks")
    p.add_argument("--eval-prompts", type=int, default=100, help="prompts evaluated per length (greedy; 100 starts exist)")
    p.add_argument("--lr", action="append", default=[], metavar="ARM=LR", help="an arm's learning rate (repeatable)")
    p.add_argument("--beta", type=float, default=1.0, help="the OPD arms' and TRL's divergence: 0 forward KL, 1 reverse")
    p.add_argument("--trl-python", default=None, help="interpreter with TRL (.venv-bench/bin/python); the trl arm needs it")
    p.add_argument("--prep-scale", type=float, default=1.0, help="scale of the teacher's and starts' SFT steps")
    p.add_argument("--inputs", type=Path, default=None,
                   help="the prepared data, teacher and starts (default OUT/inputs; another run's, to share them)")
    p.add_argument("--prepare-only", action="store_true", help="prepare the inputs (data, teacher, starts) and stop")
    p.add_argument("--merge", default=None, metavar="DIR,DIR",
                   help="only write OUT/long.md, .json and .png from these runs' long.json (one study run in parts)")
    p.add_argument("--quick", action="store_true", help=f"the plumbing: {QUICK}")


def run(args: argparse.Namespace) -> int:
    from opd.teachers.launch import free_port, start_server_process

    if args.merge:
        return merge([Path(d) for d in args.merge.split(",")], args.out)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    arms = [a for a in args.arms.split(",") if a]
    if bad := [a for a in arms if a not in ARMS]:
        raise SystemExit(f"opd bench long: unknown arm(s) {bad}; choose from {', '.join(ARMS)}")
    if "trl" in arms and not args.trl_python:
        raise SystemExit("opd bench long: the trl arm needs --trl-python (.venv-bench/bin/python, `make bench`)")
    budget = {int(k): float(v) for k, v in (item.split("=") for item in args.budget.split(","))}
    lengths = [int(x) for x in args.lengths.split(",")]
    lrs = dict(DEFAULT_LRS)
    for item in args.lr:
        arm, _, value = item.partition("=")
        if arm not in ARMS:
            raise SystemExit(f"opd bench long: --lr {item!r}: unknown arm {arm!r}")
        lrs[arm] = float(value)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    code = snapshot_code(out, None)
    plan = Plan(out=out, lengths=lengths, starts=args.starts.split(","), seeds=[int(s) for s in args.seeds.split(",")],
                arms=arms, budget=budget, evals=args.evals, eval_prompts=args.eval_prompts, lrs=lrs, beta=args.beta,
                trl_python=args.trl_python, prep_scale=args.prep_scale, env={**code["env"]})
    t_begin = time.time()
    inputs = (args.inputs or out / "inputs").resolve()
    plan.inputs = prepare(plan, inputs)
    if args.prepare_only:
        print(f"[long] inputs ready: {json.dumps(plan.inputs['models'])}", flush=True)
        return 0
    plan.inputs["eval_sets"] = {}
    for length in lengths:
        rows = _read_jsonl(Path(plan.inputs["sets"][str(length)]["eval"]))[:args.eval_prompts]
        plan.inputs["eval_sets"][str(length)] = str(_write_jsonl(out / "inputs" / f"heldout_L{length}.jsonl", rows))
    plan.inputs["sample_cpu"] = measure_sampling(plan, inputs)
    port = free_port()
    plan.server = start_server_process(["--model", plan.inputs["models"]["teacher"], "--bind",
                                        f"tcp://127.0.0.1:{port}", "--name", "chain", "--max-k", "32"], threads=1,
                                       env={k: plan.env[k] for k in ("PYTHONPATH", "PYTHONSAFEPATH") if k in plan.env})
    plan.server.port = port
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    refs = {length: evaluate(plan, {k: plan.inputs["models"][k] for k in ("teacher", *plan.starts)}, length,
                             f"refs_L{length}") for length in lengths}
    results = []
    try:
        for length in lengths:
            for start in plan.starts:
                for seed in plan.seeds:
                    batch = [run_arm(plan, arm, length, start, seed) for arm in arms]
                    models = {f"{r['arm']}/{i}": p["model"] for r in batch for i, p in enumerate(r["points"])}
                    scores = evaluate(plan, models, length, f"L{length}_{start}_seed{seed}")
                    for r in batch:
                        for i, p in enumerate(r["points"]):
                            p["acc"] = scores[f"{r['arm']}/{i}"]["all"]
                    results += batch
                    report = {"plan": {"lengths": lengths, "starts": plan.starts, "seeds": plan.seeds, "arms": arms,
                                       "budget": {str(k): v for k, v in budget.items()}, "evals": plan.evals,
                                       "eval_prompts": args.eval_prompts, "lrs": lrs, "beta": plan.beta,
                                       "batch": plan.batch, "prep_steps": PREP_STEPS, "prep_scale": plan.prep_scale,
                                       "teacher": TEACHER, "student": STUDENT, "sample_cpu": plan.inputs["sample_cpu"]},
                              "refs": {str(k): v for k, v in refs.items()}, "results": results, "machine": machine(),
                              "code": code["info"], "command": " ".join(sys.argv), "wall_s": time.time() - t_begin}
                    report["rows"] = summarize(report)
                    (out / "long.json").write_text(json.dumps(report, indent=1))
    except KeyboardInterrupt:
        print("[long] interrupted", file=sys.stderr)
        return 130
    finally:
        plan.server.stop(timeout_s=20)
    (out / "long.md").write_text("# `opd bench long`: where on-policy distillation pays off\n\n" + markdown(report))
    plot(report, out / "long.png")
    print(markdown(report), flush=True)
    return 0


def merge(parts: list[Path], out: Path) -> int:
    """One report from the long.json of runs that split a study (by length, seed or arm): their
    plans must agree but for the lengths, seeds, arms and budgets, whose union it reports; a run
    in a later part replaces the same run in an earlier one."""
    reports = [json.loads((d / "long.json").read_text()) for d in parts]
    report = reports[0]
    for other in reports[1:]:
        a, b = ({k: v for k, v in r["plan"].items() if k not in ("lengths", "seeds", "arms", "budget", "sample_cpu")}
                for r in (report, other))
        if a != b:
            raise SystemExit(f"opd bench long --merge: the plans differ in {sorted(k for k in a if a[k] != b.get(k))}")
        p = report["plan"]
        p["lengths"] = sorted(set(p["lengths"]) | set(other["plan"]["lengths"]))
        p["seeds"] = sorted(set(p["seeds"]) | set(other["plan"]["seeds"]))
        p["arms"] = p["arms"] + [a for a in other["plan"]["arms"] if a not in p["arms"]]
        p["budget"] = {**p["budget"], **other["plan"]["budget"]}
        report["refs"] = {**report["refs"], **other["refs"]}
        # a later part's run of the same (length, start, seed, arm) replaces an earlier one
        key = lambda r: (r["length"], r["start"], r["seed"], r["arm"])   # noqa: E731
        redone = {key(r) for r in other["results"]}
        report["results"] = [r for r in report["results"] if key(r) not in redone] + other["results"]
        report["wall_s"] = max(report["wall_s"], other["wall_s"])
    report["rows"] = summarize(report)
    report["merged_from"] = [str(d) for d in parts]
    out.mkdir(parents=True, exist_ok=True)
    (out / "long.json").write_text(json.dumps(report, indent=1))
    (out / "long.md").write_text("# `opd bench long`: where on-policy distillation pays off\n\n" + markdown(report))
    plot(report, out / "long.png")
    print(markdown(report), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    return standalone(sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())
