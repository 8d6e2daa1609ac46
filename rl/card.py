"""What `opd rl` writes beside its metrics: the training card and summary.json.

The card states every setting that changes the result (advantage estimator, group size G,
clipping, KL to the reference, rewards and their weights, sampling, optimizer), each resume
with the keys changed since its checkpoint, and the results: rewards, evaluation, the share
of all-equal groups (which carry no gradient) and the warnings printed about them; with
`agent`, the tools and limits and what the run's trajectories did (rl/agentic.py: facts).
"""

from __future__ import annotations

from pathlib import Path

from opd.card import write_card
from opd.config import to_dict


def write_grpo_card(out: Path, c, *, reward: dict, train_report, resumes: list[dict], warnings: list[str],
                    start_step: int, history: list[dict] | None = None, ranks: int = 1,
                    memory: dict | None = None, agent: dict | None = None) -> None:
    """card.md / card.json: the settings, the resumes, and with `history` (every step's
    metrics, the steps before a resume included) the results; without it, at the start,
    the results section says the run is in progress. agent: the `agent` section (multi-turn)."""
    is_lora = c.model.lora is not None
    facts = {
        "model": {"start": c.model.path, "training": "LoRA" if is_lora else "full fine-tuning",
                  **({"lora": to_dict(c.model.lora)} if is_lora else {}), "dtype": c.model.dtype,
                  "dropout": "off (the ratio is taken against dropout-free rollouts)"},
        "objective": {"advantage estimator": c.algorithm.advantage, "group size G": c.rollout.samples_per_prompt,
                      "prompts per step P": c.rollout.prompts_per_step, "eps_low": c.algorithm.eps_low,
                      "eps_high": c.algorithm.eps_high, "epochs per batch": c.algorithm.epochs,
                      "minibatches": c.algorithm.minibatches, "kl beta": c.algorithm.kl_beta,
                      "kl estimator": c.algorithm.kl_estimator,
                      "reference": ("adapter off (LoRA)" if is_lora else "frozen copy")
                      if c.algorithm.kl_beta > 0 else "none (beta = 0)",
                      "loss aggregation": c.algorithm.loss_aggregation,
                      "entropy bonus": (f"{c.terms.entropy_bonus:g} x the entropy per token, aggregated as the "
                                        f"surrogate (opd.spine.terms)" if c.terms.needs_entropy else "none"),
                      "dynamic sampling": (f"up to {c.algorithm.dynamic_sampling} more draws of P prompts a step "
                                           f"replace all-equal groups") if c.algorithm.dynamic_sampling else "off",
                      "teachers": [{"name": t.name, "address": t.address, "lambda (weight)": t.weight, "gamma": t.gamma,
                                    "signal": "sampled-token reverse KL in each token's advantage",
                                    "domains": t.domains or "all"} for t in c.teachers] or "none"},
        "rewards": reward,
        "sampling": {"engine": c.rollout.engine, "temperature": c.rollout.temperature, "top_p": c.rollout.top_p,
                     "max_new_tokens": c.rollout.max_new_tokens,
                     **({"rollout actors (Ray)": c.rollout.actors} if c.cluster.mode == "ray"
                        and not c.cluster.ranks_on_ray else {})},
        "data": {"train": c.data.train, "train samples": train_report.loaded,
                 "skipped lines": train_report.skipped, "eval": c.data.eval or "(none)"},
        "optimizer": {"AdamW lr": c.optim.lr, "weight decay": c.optim.weight_decay,
                      "warmup steps": c.optim.warmup_steps, "gradient clip": c.optim.grad_clip,
                      "schedule": c.optim.schedule},
        "run": {"steps": c.run.steps, "seed": c.run.seed, "out": str(out),
                "ranks": f"{ranks} (FSDP2, each rank {c.rollout.prompts_per_step // ranks} prompts a step)"
                if ranks > 1 else "1", **({"memory_per_rank_bytes": memory} if memory else {})},
    }
    if agent is not None:
        facts["agent"] = agent
    if resumes:
        facts["resumes"] = {
            f"resumed at step {r['at_step']} ({r['checkpoint']})":
                "changed since the checkpoint: " + ("; ".join(r["changed"]) or "nothing")
                if r["changed"] is not None else
                "changed since the checkpoint: unknown (the checkpoint has no saved config)"
            for r in resumes}
    facts["results"] = results(history, warnings) if history is not None else \
        {"status": f"in progress from step {start_step} (rewritten with the results when the run ends)"}
    write_card(out, "GRPO training card", facts)


def results(history: list[dict], warnings: list[str]) -> dict:
    """The card's results: rewards, evaluation, all-equal groups and the warnings printed."""
    if not history:
        return {"steps trained": 0}
    rewards = [h["reward/mean"] for h in history]
    flat = [h["groups/all_equal"] for h in history if "groups/all_equal" in h]
    out = {"steps trained": len(history), "final reward": rewards[-1],
           "mean reward": sum(rewards) / len(rewards)}
    for key, label in (("eval/reward", "eval reward (greedy, held-out)"),
                       ("eval/accuracy", "eval accuracy (share fully correct)"),
                       ("eval/verifier_score", "eval verifier score (mean, partial credit)")):
        vals = [(h["step"], h[key]) for h in history if key in h]
        if vals:
            out[label] = f"{vals[-1][1]:.4g} (step {vals[-1][0]})"
    if flat:
        out["all-equal groups, mean"] = sum(flat) / len(flat)
        out["all-equal groups, last step"] = flat[-1]
    draws = [h["groups/draws"] for h in history if "groups/draws" in h]
    if draws:   # what dynamic sampling cost: prompts sampled per prompt trained, and the time
        drawn = [h["groups/flat_drawn"] for h in history if "groups/flat_drawn" in h]
        rollout = [h["time/rollout"] + h.get("time/reward", 0.0) + h.get("time/resample", 0.0) for h in history
                   if "time/rollout" in h]
        out["dynamic sampling"] = (f"{sum(draws) / len(draws):.2f} draws of P prompts a step on average (max "
                                   f"{max(draws):.0f}); {sum(drawn) / len(drawn):.0%} of the groups drawn were all-equal; "
                                   f"sampling and scoring took {sum(rollout) / len(rollout):.2f} s a step")
    out["flat-group warnings"] = (f"{len(warnings)} printed" + (", the last 10 below"
                                  if len(warnings) > 10 else "")) if warnings else "none"
    for i, text in enumerate(warnings[-10:]):
        out[f"warning {len(warnings) - min(10, len(warnings)) + i + 1}"] = text
    return out


def summary(history: list[dict]) -> dict:
    """summary.json: the reward at the start and end (quarters), whether it rose, the last evaluation."""
    if not history:
        return {}
    rewards = [h["reward/mean"] for h in history]
    k = max(1, len(rewards) // 4)
    out = {"steps": len(history), "reward_first": rewards[0], "reward_last": rewards[-1],
           "reward_first_quarter": sum(rewards[:k]) / k, "reward_last_quarter": sum(rewards[-k:]) / k}
    out["reward_rose"] = out["reward_last_quarter"] > out["reward_first_quarter"]
    for key in ("eval/reward", "eval/accuracy", "eval/verifier_score"):
        vals = [h[key] for h in history if key in h]
        if vals:
            out[key.replace("/", "_") + "_last"] = vals[-1]
    return out
