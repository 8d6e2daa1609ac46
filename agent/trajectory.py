"""A multi-turn rollout as a reward function reads it: the model's turns, what it read between
them, and the tool calls of each turn.

    trajectory(rollout, tokenizer) -> Trajectory

A reward that takes a `trajectory` argument (`def fn(sample, text, trajectory)`, a `python`
reward) gets one per response, so it can score the whole trajectory (the calls made, their
arguments, the results read), not only the final turn the verifiers read. A single-turn
response is a trajectory of one turn and no calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from opd.agent.calls import Call, parse_calls


@dataclass(frozen=True)
class Trajectory:
    turns: list[str]                     # the model's turns, decoded, in order (stop tokens dropped)
    observations: list[str]              # what it read after each turn but the last: tool results
    calls: list[list[Call]]              # each turn's tool calls, parsed ([] for a final answer)
    meta: dict = field(default_factory=dict)   # the loop's counts: turns, tool_calls, tool_failures, ...

    @property
    def tool_calls(self) -> list[Call]:
        """Every call of the trajectory, in order."""
        return [c for turn in self.calls for c in turn]


def trajectory(rollout, tokenizer) -> Trajectory:
    """`rollout`'s turns (its runs of sampled tokens, `Rollout.mask`) and observations (the runs
    between them), decoded without special tokens."""
    ids, mask = rollout.response_ids, rollout.mask or [1] * len(rollout.response_ids)
    runs: list[tuple[int, list[int]]] = []   # (sampled?, ids) runs of the response
    for tok, m in zip(ids, mask):
        if runs and runs[-1][0] == m:
            runs[-1][1].append(tok)
        else:
            runs.append((m, [tok]))
    turns = [tokenizer.decode(r, skip_special_tokens=True) for m, r in runs if m]
    seen = [tokenizer.decode(r, skip_special_tokens=True) for m, r in runs if not m]
    return Trajectory(turns=turns, observations=seen, calls=[parse_calls(t) for t in turns], meta=dict(rollout.meta))
