"""`opd rl` with `agent:`: GRPO over multi-turn trajectories with tools.

The rollout engine (hf or vLLM) is wrapped by opd.agent.loop's AgentEngine: each response is a
trajectory of the policy's turns and the tool observations between them, one Rollout with a
`mask` (1 on what the policy sampled). What changes in GRPO, and where:

    prompts    rendered with the tools' JSON schemas (the chat template's `tools=`): `toolbox`
    rows       rl/batch.py's rows are the tokens the rollout's mask marks: the policy loss, the
               KL, the entropy, the token-mean and seq-mean normalizers and the teachers' terms
               count the sampled tokens alone; the episode's group advantage is credited to each
    rewards    the reward functions read the final answer (Rollout.text: the last turn); with
               `agent_shaping` every valid / failed call (and a turn-limit hit) adds its amount
               to the trajectory's reward (`shaped`, logged as reward/agent_shaping)
    dr_grpo    its constant normalizer is the most tokens a trajectory samples (`sampled_budget`)
    metrics    opd.agent.loop.trajectory_metrics per step (eval/agent/* on the held-out
               prompts), length/sampled_mean beside length/mean (the trajectory's tokens)
    card       the agent section: tools, limits, and what the run's trajectories did, from
               opd.agent.totals' sums kept in every checkpoint (`facts`)
"""

from __future__ import annotations

from pathlib import Path

from opd.agent.config import AgentConfig
from opd.agent import totals
from opd.agent.loop import AgentEngine, trajectory_metrics
from opd.agent.tools import Toolbox
from opd.config import ConfigError
from opd.rollout.base import RolloutEngine, eos_ids


def toolbox(agent: AgentConfig | None, tokenizer, model_path, base_dir: str | Path | None) -> Toolbox | None:
    """The tools of `agent` (None without it), FILE.py paths relative to the config's folder; a
    ConfigError before the first rollout when they cannot be built or rendered (opd.agent.totals)."""
    try:
        return totals.toolbox(agent, tokenizer, model_path, base_dir or ".")
    except ValueError as e:
        raise ConfigError(str(e) if str(e).startswith("agent") else f"agent.tools: {e}") from None


def wrap(agent: AgentConfig | None, engine: RolloutEngine, box: Toolbox | None, tokenizer,
         generation_config=None) -> RolloutEngine:
    """`engine`, multi-turn when `agent` is set. A turn ends at the tokens the engines stop on:
    the tokenizer's EOS and those of the model's generation config."""
    if agent is None:
        return engine
    return AgentEngine(engine, tokenizer, box, agent, eos_ids(tokenizer, generation_config))


def generation_config(path):
    """A model directory's generation config (its EOS ids), or None when it has none."""
    from transformers import GenerationConfig   # slow to import; only a vLLM validation needs it

    try:
        return GenerationConfig.from_pretrained(str(path))
    except OSError:
        return None


def sampled_budget(cfg) -> int:
    """Dr. GRPO's constant normalizer: the most tokens one response samples. One turn:
    rollout.max_new_tokens; a trajectory: its turns' limits within agent.max_tokens (which
    its observations share)."""
    agent = getattr(cfg, "agent", None)   # (a stand-in config of a test may have no agent section)
    if agent is None:
        return cfg.rollout.max_new_tokens
    return agent.max_sampled(cfg.rollout.max_new_tokens)


def shaping(shape, rollouts) -> list[float]:
    """Per trajectory: valid_call per call that answered, failed_call per call that failed,
    turn_limit when max_turns cut it (0 for a rollout without the loop's meta)."""
    out = []
    for r in rollouts:
        m = r.meta
        calls, failed = m.get("tool_calls", 0), m.get("tool_failures", 0)
        out.append(shape.valid_call * (calls - failed) + shape.failed_call * failed
                   + shape.turn_limit * bool(m.get("turn_limit", False)))
    return out


def shaped(cfg, rewards: tuple[list[float], dict], rollouts) -> tuple[list[float], dict]:
    """(total, parts) of the reward functions with `agent_shaping` added to each trajectory's
    total and logged as its own part (unchanged without it)."""
    total, parts = rewards
    if cfg.agent_shaping is None:
        return total, parts
    extra = shaping(cfg.agent_shaping, rollouts)
    return [t + e for t, e in zip(total, extra)], {**parts, "agent_shaping": extra}


def step_metrics(rollouts, prefix: str = "") -> dict[str, float]:
    """The trajectories' metrics (opd.agent.loop.trajectory_metrics) and their sampled tokens
    per trajectory ({} for single-turn rollouts)."""
    m = trajectory_metrics(rollouts)
    if not m:
        return {}
    sampled = [sum(r.sampled()) for r in rollouts]
    m["length/sampled_mean"] = sum(sampled) / len(sampled)
    m["length/sampled_max"] = float(max(sampled))
    return {prefix + k: v for k, v in m.items()}


def sums(rollouts, before: list[float] | None = None) -> list[float]:
    """opd.agent.totals.sums of a batch's trajectories, added to `before` (the run's so far)."""
    now = totals.sums(rollouts)
    return now if before is None else totals.add(before, now)


def facts(cfg, run_totals: list[float] | None) -> dict:
    """The card's `agent` section (opd.agent.totals.card), with the shaping and the credit."""
    shape = cfg.agent_shaping
    return {**totals.card(cfg.agent, cfg.rollout.max_new_tokens, run_totals),
            "credit": "the episode's group advantage on every sampled token",
            "shaping": ({"valid_call": shape.valid_call, "failed_call": shape.failed_call,
                         "turn_limit": shape.turn_limit} if shape is not None else "none")}
