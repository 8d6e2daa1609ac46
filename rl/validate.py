"""`opd validate CONFIG.yaml`: do the models really solve the held-out tasks?

Every named model (the distilled student, its pre-distillation start, the teachers, any
checkpoint) answers every held-out verifiable set; the domain verifier
(`opd.rewards.verify`) checks each answer. Per model and domain the report gives:
    pass@1, pass@k   unbiased estimates from n samples at the sampling temperature
                     (Chen et al. 2021: 1 - C(n-c, k) / C(n, k), c = fully correct samples)
    score            mean verifier score of those samples (partial credit for code: the
                     share of tests passed)
    greedy           accuracy of one temperature-0 answer per prompt: the share fully
                     correct (verifier score 1, as pass@k counts; when `greedy: true`)
    greedy_score     the mean verifier score of those greedy answers (partial credit)
and, for students, the share of the matching teacher's accuracy they reach. Optionally a
short low-learning-rate GRPO pass from one model reports whether reward still rises
(if it does, the model has headroom that imitation did not capture).
With `agent:` every model answers as a multi-turn agent with those tools (opd.agent; the
verifier reads its final turn), and the report adds its trajectories' turns and tool calls.
Writes OUT/report.md and OUT/report.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tqdm import tqdm

from opd.agent.config import AgentConfig
from opd.config import ConfigError, check_top_p, describe, field, load_yaml, near, to_dict
from opd.data import encode_prompt, load_jsonl
from opd.fingerprint import check_model_dir, load_model_tokenizer
from opd.rewards import accuracy, correct, hidden_gap, hidden_pass, verify_batch, verify_details
from opd.rewards.code import limits_from
from opd.rl import agentic
from opd.rl.train import HelpFormatter, load_config
from opd.rollout import SamplingParams
from opd.spine.config import ModelConfig


@dataclass(frozen=True)
class NamedModel:
    name: str = field(help="label in the report, e.g. 'student', 'teacher-math', 'base'")
    path: str = field(help="model directory (full model, or a peft adapter dir with adapter_config.json)")
    role: Literal["student", "teacher", "base", "other"] = field("other", help="how the report compares it")
    domains: list[str] = field(default_factory=list, help="teacher: the domains it is the expert for")


@dataclass(frozen=True)
class HeldOutSet:
    domain: str = field(help="domain name, e.g. math or code")
    path: str = field(help="JSONL with prompt and answer (math) or tests (code)")
    limit: int = field(0, help="use at most this many samples (0 = all)", min=0)


@dataclass(frozen=True)
class GRPOCheck:
    config: str = field(help="an `opd rl` config YAML; its model.path, run.steps, optim.lr and run.out_dir are replaced")
    model: str = field(help="name of the model (from `models`) to start from")
    steps: int = field(10, help="GRPO steps", min=1)
    lr: float = field(1e-6, help="learning rate (low: a probe, not training)", min=0.0)


@dataclass(frozen=True)
class ValidateConfig:
    models: list[NamedModel] = field(help="models to evaluate")
    sets: list[HeldOutSet] = field(help="held-out verifiable sets, one per domain")
    samples: int = field(4, help="n: samples per prompt for pass@k", min=1)
    k: list[int] = field(default_factory=lambda: [1, 4], help="the k of pass@k (each <= samples)")
    temperature: float = field(0.7, help="sampling temperature for pass@k", min=0.0)
    top_p: float = field(1.0, help="nucleus sampling for pass@k", min=0.0, max=1.0)
    greedy: bool = field(True, help="also report the accuracy of one greedy answer per prompt (the share the "
                                    "verifier scores 1) and its mean verifier score (greedy_score)")
    max_new_tokens: int = field(256, help="response length limit", min=1)
    engine: Literal["hf", "vllm"] = field("hf", help="rollout engine: hf (transformers) or vllm")
    batch_size: int = field(64, help="sequences sampled together (hf engine)", min=1)
    code: dict[str, Any] = field(default_factory=dict, help="code verifier options: timeout_s, memory_mb, workers")
    grpo: GRPOCheck | None = field(None, help="optional short GRPO pass: does reward still rise?")
    agent: AgentConfig | None = field(None, help="answer as multi-turn agents with these tools (the verifier reads "
                                                 "the final turn; max_new_tokens is each turn's limit); unset: one turn")
    seed: int = field(0, help="sampling seed")
    dump: int = field(3, help="examples of each failed check (rl/checks.py) written to OUT/samples.md per model "
                              "and domain", min=0)
    perturb: list[Literal["spaces", "prefix", "suffix"]] = field(
        default_factory=list, help="also answer each prompt reworded so the task stays (spaces around operators, a "
                                   "'Question: ' prefix, a trailing newline; greedy) and report the accuracy beside "
                                   "the plain prompts', warning when it falls by more than 0.1")
    out_dir: str = field("runs/validate", help="where report.md, report.json and samples.md go")

    def __post_init__(self):
        check_top_p(self.top_p, "top_p")
        bad = [k for k in self.k if k < 1 or k > self.samples]
        if bad:
            raise ValueError(f"every k must be in 1..samples ({self.samples}), got {bad}")
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be unique, got {names}")
        domains = [s.domain for s in self.sets]
        if len(set(domains)) != len(domains):   # the report is keyed by domain: one set would vanish
            raise ValueError(f"one held-out set per domain, got domains {domains}")
        if self.perturb and not self.greedy:
            raise ValueError("perturb compares greedy answers to the plain and the reworded prompts: set greedy: true")
        if self.grpo is not None and self.grpo.model not in names:
            raise ValueError(f"grpo.model {self.grpo.model!r} is not one of the models {names}")
        try:   # a value the sandbox cannot use failed only at the first code answer (a float memory_mb: all 0)
            limits_from(self.code)
        except ValueError as e:
            raise ValueError(f"code: {e}") from None


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k).

    Defined only for 1 <= k <= n and 0 <= c <= n (the config keeps k <= samples): outside that
    there is no estimate, and the shortcut below would answer 1.0 even with no correct sample."""
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n correct samples, got c={c}, n={n}")
    if n - c < k:   # every choice of k samples holds a correct one
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


# ---- evaluation ---------------------------------------------------------------------------

def _engine(cfg: ValidateConfig, path: str):
    """(rollout engine, tokenizer) of one model: vLLM on its directory, or the hf engine over a
    frozen fp32 copy (a peft adapter directory merged into its base) on cuda when there is one."""
    from opd.rollout.hf import HFRolloutEngine   # here, not at the top: torch (opd.cli says why)
    from opd.rollout.vllm import VLLMRolloutEngine
    from opd.spine.model import load_policy

    if cfg.engine == "vllm":
        return VLLMRolloutEngine(path, seed=cfg.seed), load_model_tokenizer(path, "model")
    model, tok = load_policy(ModelConfig(path=str(path)), train=False, what="model")
    return HFRolloutEngine(model, tok, batch_size=cfg.batch_size), tok


def _agent(cfg: ValidateConfig, engine, tok, path: str, base_dir: Path | None):
    """(the engine, multi-turn with `agent`'s tools; their schemas, or None without `agent`).
    Its turns end at the tokenizer's EOS and the model's generation config's."""
    try:
        box = agentic.toolbox(cfg.agent, tok, path, base_dir)
    except BaseException:
        engine.close()
        raise
    if box is None:
        return engine, None
    gen = getattr(getattr(engine, "model", None), "generation_config", None) or agentic.generation_config(path)
    return agentic.wrap(cfg.agent, engine, box, tok, gen), box.schemas()


def _answers(engine, tokenizer, samples, params, tools=None) -> tuple[list[str], list]:
    """(the final answers as the verifiers read them, the rollouts)."""
    rollouts = engine.generate([encode_prompt(tokenizer, s.chat, tools=tools) for s in samples], params)
    return [r.text(tokenizer) for r in rollouts], rollouts


def evaluate_model(cfg: ValidateConfig, path: str, sets: dict[str, list], bar=None,
                   base_dir: Path | None = None) -> dict[str, dict]:
    """{domain: {"pass@k": ..., "score": ..., "greedy": ..., "greedy_score": ..., "n_prompts": ...}} for one
    model. `greedy` is an accuracy (the share of greedy answers the verifier scores 1, as pass@k
    counts), `score` and `greedy_score` mean verifier scores (partial credit for code). `bar`: a
    tqdm bar advanced by each set's prompts once they are scored. With `agent`, also the sampled
    trajectories' agent/* metrics (opd.agent.loop.trajectory_metrics)."""
    from opd.rl import checks   # torch (opd.diagnostics): here, not at the top (opd.cli says why)

    engine, tok = _engine(cfg, path)
    engine, tools = _agent(cfg, engine, tok, path, base_dir)
    workers = int(cfg.code.get("workers", 2))
    code_opts = {k: v for k, v in cfg.code.items() if k != "workers"}
    out = {}
    try:
        for domain, samples in sets.items():
            n = cfg.samples
            params = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p,
                                    max_new_tokens=cfg.max_new_tokens, n=n, seed=cfg.seed)
            texts, rollouts = _answers(engine, tok, samples, params, tools)
            expanded = [s for s in samples for _ in range(n)]
            details = verify_details(expanded, texts, workers=workers, **code_opts)
            scores = [v if v is not None else 0.0 for v, _ in details]
            right = [sum(map(correct, scores[i * n:(i + 1) * n])) for i in range(len(samples))]
            res: dict[str, Any] = {"n_prompts": len(samples), "samples": n,
                                   "score": sum(scores) / len(scores), **agentic.step_metrics(rollouts),
                                   "checks": checks.exit_checks(expanded, texts, rollouts, details, cfg.dump)}
            if any(s.hidden_tests for s in samples):   # tests no reward saw, beside the visible ones
                pairs = [(v, h) for v, h in zip(scores, hidden_pass(expanded, texts, workers=workers, **code_opts))
                         if h is not None]
                res["hidden"] = hidden_gap([v for v, _ in pairs], [h for _, h in pairs])
            for k in cfg.k:
                res[f"pass@{k}"] = sum(pass_at_k(n, c, k) for c in right) / len(samples)
            if cfg.greedy:
                g, _ = _answers(engine, tok, samples, SamplingParams(temperature=0.0, max_new_tokens=cfg.max_new_tokens,
                                                                      n=1), tools)
                gs = [v if v is not None else 0.0 for v in verify_batch(samples, g, workers=workers, **code_opts)]
                # The share fully correct, as pass@k counts: the mean score gave code partial
                # credit (0.667 for scores [1, 0, 0.333, 1, 1, 0, 1, 1]) and was called accuracy.
                res["greedy"] = accuracy(gs)
                res["greedy_score"] = sum(gs) / len(gs)
                res["example"] = {"prompt": samples[0].prompt[:200], "answer": g[0][:300]}
                for kind in cfg.perturb:   # the same task, reworded: does the accuracy hold?
                    reworded = [checks.perturbed(s, kind) for s in samples]
                    g, _ = _answers(engine, tok, reworded, SamplingParams(temperature=0.0, n=1,
                                                                          max_new_tokens=cfg.max_new_tokens), tools)
                    acc = accuracy([v or 0.0 for v in verify_batch(reworded, g, workers=workers, **code_opts)])
                    res[f"greedy/{kind}"] = acc
                    if warning := checks.format_drop(kind, res["greedy"], acc):
                        res.setdefault("format_warnings", []).append(warning)
            out[domain] = res
            if bar is not None:
                bar.update(len(samples))
    finally:
        engine.close()
        del engine
        gc.collect()
    return out


def grpo_config(cfg: ValidateConfig, base_dir: Path, out_dir: Path):
    """The RL config of the GRPO check: its own config file with the check's model, lr and
    steps, run in OUT/grpo_check. Loaded before any evaluation, so that a bad file fails fast."""
    check = cfg.grpo
    rl_path = Path(check.config)
    if not rl_path.is_absolute() and not rl_path.is_file():
        rl_path = base_dir / rl_path
    rl = load_config(str(rl_path))
    path = next(m.path for m in cfg.models if m.name == check.model)
    return dataclasses.replace(rl, model=dataclasses.replace(rl.model, path=path),
                               optim=dataclasses.replace(rl.optim, lr=check.lr),
                               run=dataclasses.replace(rl.run, steps=check.steps, out_dir=str(out_dir / "grpo_check"),
                                                       checkpoint_every=0, keep_checkpoints=1)), rl_path.parent


def grpo_check(cfg: ValidateConfig, rl, config_dir: Path) -> dict:
    """A short low-lr GRPO pass from one model: does the mean reward still rise?"""
    # OUT/grpo_check belongs to this validation: a rerun replaces it, as it replaces the report.
    from opd.rl.trainer import GRPOTrainer   # torch, transformers, peft (opd.cli says why)

    summary = GRPOTrainer(rl, config_dir=config_dir, overwrite=True).train()
    return {"model": cfg.grpo.model, "steps": cfg.grpo.steps, "lr": cfg.grpo.lr, **summary,
            "run_dir": rl.run.out_dir}


def teacher_shares(cfg: ValidateConfig, results: dict) -> dict:
    """For each student and domain: its accuracy as a share of the best teacher for that domain."""
    metric = "greedy" if cfg.greedy else "pass@1"
    shares: dict[str, dict[str, float | None]] = {}
    for m in cfg.models:
        if m.role != "student":
            continue
        for domain in results[m.name]:
            teachers = [t for t in cfg.models if t.role == "teacher" and (not t.domains or domain in t.domains)]
            best = max((results[t.name][domain][metric] for t in teachers), default=None)
            if best is None:
                continue
            shares.setdefault(m.name, {})[domain] = results[m.name][domain][metric] / best if best > 0 else None
    return {"metric": metric, "shares": shares}


REGRESSION = 0.05   # a fall below the base model's accuracy on a domain larger than this is warned about


def against_base(cfg: ValidateConfig, results: dict) -> dict:
    """Each other model's accuracy on each domain less the (first) `role: base` model's: the seeds'
    regression check (a general set among the domains shows what training cost outside its own),
    with a warning past REGRESSION. Empty without a base model."""
    metric = "greedy" if cfg.greedy else "pass@1"
    base = next((m for m in cfg.models if m.role == "base"), None)
    if base is None:
        return {}
    deltas = {m.name: {d: results[m.name][d][metric] - results[base.name][d][metric] for d in results[m.name]}
              for m in cfg.models if m is not base}
    warnings = [f"{name}, {d}: {metric} {results[name][d][metric]:.3f} against the base's "
                f"{results[base.name][d][metric]:.3f} ({delta:+.3f})"
                for name, per in deltas.items() for d, delta in per.items() if delta < -REGRESSION]
    return {"base": base.name, "metric": metric, "deltas": deltas, "warnings": warnings}


def write_report(cfg: ValidateConfig, results: dict, extra: dict, out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    domains = [s.domain for s in cfg.sets]
    cols = [f"pass@{k}" for k in cfg.k] + ["score"] + (["greedy", "greedy_score"] if cfg.greedy else []) \
        + ([f"greedy/{kind}" for kind in cfg.perturb] if cfg.greedy else []) \
        + (["agent/turns", "agent/tool_calls"] if cfg.agent is not None else [])
    lines = ["# Validation report", "",
             f"{cfg.samples} samples per prompt at temperature {cfg.temperature}, max {cfg.max_new_tokens} new "
             f"tokens. Verifier: math answer match / share of code unit tests passed (sandboxed); an answer "
             f"is correct when it scores 1 (every test passed).", "",
             "- `pass@k`: unbiased, from the samples' correct answers",
             "- `score`: the samples' mean verifier score (partial credit for code)",
             *(["- `greedy`: accuracy of one temperature-0 answer per prompt (the share correct)",
                "- `greedy_score`: those answers' mean verifier score (partial credit for code)"] if cfg.greedy else []),
             *([f"- multi-turn with tools {[t.name or t.function for t in cfg.agent.tools]} (at most "
                f"{cfg.agent.max_turns} turns, {cfg.agent.max_tokens} tokens a trajectory): `agent/turns` and "
                f"`agent/tool_calls` per sampled trajectory; the verifier reads the final turn"]
               if cfg.agent is not None else []),
             ""]
    for domain in domains:
        n = next(iter(results.values()))[domain]["n_prompts"] if results else 0
        lines += [f"## {domain} ({n} held-out prompts)", "",
                  "| model | role | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
        for m in cfg.models:
            r = results[m.name][domain]
            lines.append(f"| {m.name} | {m.role} | " + " | ".join(f"{r[c]:.3f}" for c in cols) + " |")
        lines.append("")
    shares = extra["teacher_shares"]
    if shares["shares"]:
        lines += [f"## Students against the matching teacher ({shares['metric']})", ""]
        for name, per in shares["shares"].items():
            lines.append(f"- **{name}**: " + ", ".join(
                f"{d}: {v:.0%} of the teacher" if v is not None else f"{d}: teacher scores 0" for d, v in per.items()))
        lines.append("")
    base = extra.get("against_base")
    if base:
        lines += [f"## Against the base model {base['base']} ({base['metric']})", "",
                  *(f"- **{name}**: " + ", ".join(f"{d}: {v:+.3f}" for d, v in per.items())
                    for name, per in base["deltas"].items()),
                  *(f"- **warning**, regression: {w}" for w in base["warnings"]), ""]
    if "grpo_check" in extra:
        g = extra["grpo_check"]
        verdict = "still rises" if g.get("reward_rose") else "does not rise"
        lines += ["## Short GRPO pass", "",
                  f"From **{g['model']}**, {g['steps']} steps at lr {g['lr']:g}: mean reward {verdict} "
                  f"(first quarter {g.get('reward_first_quarter', float('nan')):.3f} -> last quarter "
                  f"{g.get('reward_last_quarter', float('nan')):.3f}); run folder `{g['run_dir']}`.", ""]
    from opd.rl import checks

    names = [m.name for m in cfg.models]
    reworded = [f"- **warning**, {m}, {d}: {w}" for m in names for d in domains
                for w in results[m][d].get("format_warnings", [])]
    if reworded:
        lines += ["## Reworded prompts", "", *reworded, ""]
    hidden = [(m, d, results[m][d]["hidden"]) for m in names for d in domains if "hidden" in results[m][d]]
    if hidden:
        lines += ["## Hidden tests (no reward sees them)", "", "| model | domain | visible tests passed | hidden |",
                  "|---|---|---|---|", *(f"| {m} | {d} | {h['visible_accuracy']:.3f} | {h['hidden_accuracy']:.3f} |"
                                         for m, d, h in hidden), "",
                  *(f"- **warning**, {m}, {d}: {h['warning']}" for m, d, h in hidden if "warning" in h), ""]
    lines += checks.markdown(results, names, domains)
    (out / "samples.md").write_text(checks.samples_markdown(results, names, domains))
    lines += [f"Evaluation took {extra['seconds']:.1f} s.", ""]
    md, js = out / "report.md", out / "report.json"
    md.write_text("\n".join(lines))
    js.write_text(json.dumps({"config": to_dict(cfg), "results": results, **extra}, indent=1))
    return md, js


def validate(cfg: ValidateConfig, base_dir: Path | None = None) -> dict:
    t0 = time.time()
    out = Path(cfg.out_dir)
    sets = {}
    for s in cfg.sets:
        samples, _ = load_jsonl(s.path, default_domain=s.domain)
        sets[s.domain] = samples[:s.limit] if s.limit else samples
    # Everything checked before the first evaluation, which takes minutes per model.
    for m in cfg.models:
        check_model_dir(m.path, f"models[{m.name!r}].path")
    grpo = grpo_config(cfg, base_dir or Path.cwd(), out) if cfg.grpo is not None else None
    results = {}
    # One bar over the whole evaluation (models x sets, counted in prompts), as the other commands
    # have: a model's sets took minutes with one line per model and nothing in between.
    bar = tqdm(total=len(cfg.models) * sum(len(v) for v in sets.values()), desc="validate", unit="prompt",
               dynamic_ncols=True)
    try:
        for m in cfg.models:
            tqdm.write(f"[opd validate] {m.name}: {m.path}", file=sys.stderr)
            bar.set_postfix(model=m.name)
            results[m.name] = evaluate_model(cfg, m.path, sets, bar=bar, base_dir=base_dir)
    finally:
        bar.close()
    extra: dict[str, Any] = {"teacher_shares": teacher_shares(cfg, results), "against_base": against_base(cfg, results)}
    if grpo is not None:
        extra["grpo_check"] = grpo_check(cfg, *grpo)
    extra["seconds"] = time.time() - t0
    md, js = write_report(cfg, results, extra, out)
    return {"results": results, **extra, "report_md": str(md), "report_json": str(js)}


def resolve_paths(cfg: ValidateConfig, base: Path) -> ValidateConfig:
    """Relative paths in a config file are relative to its folder (as in every opd config)."""
    return dataclasses.replace(
        cfg, models=[dataclasses.replace(m, path=near(base, m.path)) for m in cfg.models],
        sets=[dataclasses.replace(s, path=near(base, s.path)) for s in cfg.sets], out_dir=near(base, cfg.out_dir),
        grpo=dataclasses.replace(cfg.grpo, config=near(base, cfg.grpo.config)) if cfg.grpo else None)


# ---- CLI ----------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="validate config YAML (see configs/validate_demo.yaml and the keys below)")
    parser.add_argument("--out", "--out-dir", dest="out", default=None, help="override out_dir")
    parser.epilog = "config keys:\n" + describe(ValidateConfig)
    parser.formatter_class = HelpFormatter


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_yaml(args.config, ValidateConfig)
    except ConfigError as e:
        print(f"opd validate: {e}", file=sys.stderr)
        return 2
    cfg = resolve_paths(cfg, Path(args.config).resolve().parent)
    if args.out:
        cfg = dataclasses.replace(cfg, out_dir=args.out)
    result = validate(cfg, base_dir=Path(args.config).resolve().parent)
    print(Path(result["report_md"]).read_text())
    return 0
