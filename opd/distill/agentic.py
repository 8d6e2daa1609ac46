"""`opd train` with the `agent:` section: the student's rollouts are multi-turn trajectories.

The rollout engine is wrapped by opd.agent.loop's AgentEngine (the model's turns, tool calls
executed in the sandbox, their observations appended). A trajectory's rows are the kept tokens
the model sampled (opd.spine.rows.trim_turns): the observations are context for the student and
the teachers, never trained or scored. Prompts are rendered with the tools' JSON schemas, and
must leave room for agent.max_tokens (the whole trajectory after the prompt), not only one
turn's rollout.max_new_tokens. What the trajectories did (turns, calls, failures, observation
tokens, turn-limit hits) is summed per step and over the run, for the metrics and the card.
"""

from __future__ import annotations

from pathlib import Path

from opd.agent.loop import build_agent
from opd.agent.tools import build_toolbox
from opd.spine.optim import TrainError

# The sums kept per step and over the run, in this order.
SUMS = ("trajectories", "turns", "tool_calls", "tool_failures", "observation_tokens", "turn_limits")


def schemas(cfg, tokenizer, base_dir: str | Path) -> list[dict] | None:
    """The tools' JSON schemas the prompts are rendered with (None without `agent`); a tool that
    cannot be built, or a tokenizer without a chat template to render them, stops the run here."""
    if cfg.agent is None:
        return None
    if not getattr(tokenizer, "chat_template", None):
        raise TrainError(f"agent: student {cfg.student.path}'s tokenizer has no chat template; multi-turn rollouts "
                         f"render the tools, the tool calls and their answers with one")
    return build_toolbox(cfg.agent, base_dir).schemas()


def wrap(cfg, engine, tokenizer, stop_ids: set[int], base_dir: str | Path):
    """The run's rollout engine, made multi-turn when `agent` is set."""
    if cfg.agent is None:
        return engine
    return build_agent(cfg.agent, engine, tokenizer, stop_ids, base_dir)


def sums(rollouts) -> list[float]:
    """SUMS over a batch's trajectories (zeros for single-turn rollouts, which have no such meta)."""
    metas = [r.meta for r in rollouts if "turns" in r.meta]
    return [float(len(metas)), *(float(sum(m[k] for m in metas)) for k in
                                 ("turns", "tool_calls", "tool_failures", "observation_tokens")),
            float(sum(bool(m["turn_limit"]) for m in metas))]


def add(a: list[float], b: list[float]) -> list[float]:
    return [x + y for x, y in zip(a, b)]


def means(s: list[float], prefix: str = "agent/") -> dict[str, float]:
    """The metrics of opd.agent.loop.trajectory_metrics from SUMS ({} without trajectories)."""
    n, turns, calls, failures, observed, limits = s
    if not n:
        return {}
    return {f"{prefix}turns": turns / n, f"{prefix}tool_calls": calls / n,
            f"{prefix}tool_failure_share": failures / calls if calls else 0.0,
            f"{prefix}observation_tokens": observed / n, f"{prefix}turn_limit_rate": limits / n}


def facts(cfg, s: list[float] | None) -> dict:
    """The card's `agent` section: the tools and limits, and what the run's trajectories did."""
    a = cfg.agent
    m = means(s or [0.0] * len(SUMS), prefix="")
    return {
        "tools": [t.function if t.name is None else f"{t.function} (called {t.name!r})" for t in a.tools],
        "max_turns": a.max_turns, "max_tokens": a.max_tokens,
        "per_turn_max_new_tokens": cfg.rollout.max_new_tokens,
        "tool_limits": f"{a.timeout_s} s, {a.memory_mb} MiB a call; answers cut at {a.max_output_chars} characters",
        "rows": "the tokens the model sampled; tool observations and the template between turns are context, "
                "neither trained nor scored",
        **({"trajectories": int(s[0]), "turns_per_trajectory": m["turns"], "tool_calls_per_trajectory": m["tool_calls"],
            "tool_failure_share": m["tool_failure_share"],
            "observation_tokens_masked": f"{int(s[4])} ({m['observation_tokens']:.3g} per trajectory)",
            "turn_limit_rate": m["turn_limit_rate"]} if m else {"trajectories": 0}),
    }
