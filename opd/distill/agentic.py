"""`opd train` with the `agent:` section: the student's rollouts are multi-turn trajectories.

The rollout engine is wrapped by opd.agent.loop's AgentEngine (the model's turns, tool calls
executed in the sandbox, their observations appended). A trajectory's rows are the kept tokens
the model sampled (opd.spine.rows.trim_turns): the observations are context for the student and
the teachers, never trained or scored. Prompts are rendered with the tools' JSON schemas, and
must leave room for agent.max_tokens (the whole trajectory after the prompt), not only one
turn's rollout.max_new_tokens (TrainConfig.response_budget). What the trajectories did (turns,
calls, failures, observation tokens, turn-limit hits) is summed per step and over the run by
opd.agent.totals, the account both loops keep, for the metrics, the checkpoints and the card.
"""

from __future__ import annotations

from pathlib import Path

from opd.agent import totals
from opd.agent.loop import build_agent
from opd.spine.optim import TrainError

sums, add, zeros, metrics = totals.sums, totals.add, totals.zeros, totals.metrics


def schemas(cfg, tokenizer, base_dir: str | Path) -> list[dict] | None:
    """The tools' JSON schemas the prompts are rendered with (None without `agent`); a tool that
    cannot be built, or a tokenizer without a chat template to render them, stops the run here."""
    try:
        box = totals.toolbox(cfg.agent, tokenizer, cfg.student.path, base_dir)
    except ValueError as e:
        raise TrainError(str(e)) from None
    return None if box is None else box.schemas()


def wrap(cfg, engine, tokenizer, stop_ids: set[int], base_dir: str | Path):
    """The run's rollout engine, made multi-turn when `agent` is set."""
    if cfg.agent is None:
        return engine
    return build_agent(cfg.agent, engine, tokenizer, stop_ids, base_dir)


def facts(cfg, run_sums: list[float] | None) -> dict:
    """The card's `agent` section: the tools and limits, and what the run's trajectories did."""
    return totals.card(cfg.agent, cfg.rollout.max_new_tokens, run_sums)
