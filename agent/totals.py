"""What a batch's (or a run's) trajectories did, summed, for the metrics and the training cards
of both loops (opd train, opd rl).

    sums(rollouts)      one list of FIELDS (zeros for single-turn rollouts, which have no loop meta)
    add(a, b)           two such lists summed (ranks, steps, a run's total kept in checkpoints)
    metrics(s)          agent/turns, agent/tool_calls, agent/tool_failure_share,
                        agent/observation_tokens, agent/turn_limit_rate ({} without trajectories)
    card(agent, ...)    the card's `agent` section: tools, limits, and those figures over the run
    toolbox(...)        the run's tools (their schemas render the prompts), refused before a run
                        when the tokenizer has no chat template to render them
"""

from __future__ import annotations

from pathlib import Path

from opd.agent.config import AgentConfig
from opd.agent.tools import Toolbox, build_toolbox

FIELDS = ("trajectories", "turns", "tool_calls", "tool_failures", "observation_tokens", "turn_limits",
          "sampled_tokens")


def sums(rollouts) -> list[float]:
    """FIELDS summed over the rollouts the agent loop made (opd.agent.loop: their meta)."""
    runs = [r for r in rollouts if "turns" in r.meta]
    return [float(len(runs)), *(float(sum(r.meta[k] for r in runs)) for k in
                                ("turns", "tool_calls", "tool_failures", "observation_tokens")),
            float(sum(bool(r.meta["turn_limit"]) for r in runs)), float(sum(sum(r.sampled()) for r in runs))]


def add(a: list[float], b: list[float]) -> list[float]:
    return [x + y for x, y in zip(a, b)]


def zeros() -> list[float]:
    return [0.0] * len(FIELDS)


def metrics(s: list[float], prefix: str = "agent/") -> dict[str, float]:
    """Means per trajectory of `sums` (the failure share per call); {} without trajectories."""
    n, turns, calls, failures, observed, limits, _ = s
    if not n:
        return {}
    return {f"{prefix}turns": turns / n, f"{prefix}tool_calls": calls / n,
            f"{prefix}tool_failure_share": failures / calls if calls else 0.0,
            f"{prefix}observation_tokens": observed / n, f"{prefix}turn_limit_rate": limits / n}


def card(agent: AgentConfig, max_new_tokens: int, s: list[float] | None) -> dict:
    """The card's `agent` section: what the model could call and within which limits, what was
    trained, and what the run's trajectories did (s: its `sums`)."""
    s = s or zeros()
    n, calls = s[0], s[2]
    out = {"tools": [t.function if t.name is None else f"{t.function} (called {t.name!r})" for t in agent.tools],
           "max_turns": agent.max_turns, "max_tokens (a trajectory after its prompt)": agent.max_tokens,
           "max_new_tokens (a turn)": max_new_tokens,
           "tool limits": f"{agent.timeout_s} s, {agent.memory_mb} MiB a call; answers cut at "
                          f"{agent.max_output_chars} characters",
           "rows": "the tokens the model sampled; tool observations and the template between turns are context, "
                   "neither trained nor scored",
           "trajectories": int(n)}
    if not n:
        return out
    return {**out, "turns per trajectory": s[1] / n, "tool calls per trajectory": calls / n,
            "tool failure share": s[3] / calls if calls else 0.0,
            "observation tokens masked": f"{int(s[4])} ({s[4] / n:.4g} per trajectory)",
            "sampled tokens per trajectory": s[6] / n, "turn-limit hit rate": s[5] / n}


def toolbox(agent: AgentConfig | None, tokenizer, model_path, base_dir: str | Path) -> Toolbox | None:
    """The tools of `agent` (None without it); their `.schemas()` go to the chat template.
    ValueError, before anything runs, when the tokenizer has no chat template or a tool cannot
    be built (its ToolSpec named)."""
    if agent is None:
        return None
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"agent: the tokenizer of {model_path} has no chat template; multi-turn rollouts render "
                         f"the tools, the tool calls and their answers with one")
    return build_toolbox(agent, base_dir)
