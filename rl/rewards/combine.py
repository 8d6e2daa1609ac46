"""Several reward functions combined with weights into one scalar per response.

`build_reward(specs)` turns the config's reward list into a `CombinedReward`, called on a
batch: `total, parts = reward(samples, responses)`, where parts[name] are the unweighted
values of each function (logged separately, so a user sees which one moves).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from opd.rl.rewards.code import code_reward_batch
from opd.rl.rewards.math import math_reward
from opd.rl.rewards.shaping import format_reward, length_penalty
from opd.rl.rewards.user import load_user_reward

BatchFn = Callable[[list, list[str]], list[float]]


def _per_item(fn: Callable, options: dict) -> BatchFn:
    return lambda samples, responses: [float(fn(s, r, **options)) for s, r in zip(samples, responses)]


@dataclass
class CombinedReward:
    parts: list[tuple[str, float, BatchFn]]  # (label, weight, batch function)

    def __call__(self, samples: list, responses: list[str]) -> tuple[list[float], dict[str, list[float]]]:
        total = [0.0] * len(responses)
        values: dict[str, list[float]] = {}
        for label, weight, fn in self.parts:
            vals = fn(samples, responses)
            values[label] = vals
            total = [t + weight * v for t, v in zip(total, vals)]
        return total, values

    def describe(self) -> dict[str, float]:
        return {label: weight for label, weight, _ in self.parts}


def build_reward(specs, base_dir: str | Path | None = None) -> CombinedReward:
    """specs: RewardConfig items (name, weight, options, path)."""
    parts = []
    for spec in specs:
        opts = dict(spec.options)
        if spec.name == "math":
            fn = _per_item(math_reward, opts)
        elif spec.name == "code":
            fn = lambda samples, responses, o=opts: code_reward_batch(samples, responses, **o)  # noqa: E731
        elif spec.name == "format":
            fn = _per_item(format_reward, opts)
        elif spec.name == "length":
            fn = _per_item(length_penalty, opts)
        elif spec.name == "python":
            path = spec.path
            user_fn = load_user_reward(path, None if Path(path.rsplit(":", 1)[0]).is_file() else base_dir)
            fn = _per_item(user_fn, opts)
        else:
            raise ValueError(f"unknown reward {spec.name!r}")
        label = spec.name if spec.name != "python" else f"python:{spec.path.rsplit(':', 1)[-1]}"
        if label in {p[0] for p in parts}:
            label = f"{label}#{len(parts)}"
        parts.append((label, float(spec.weight), fn))
    if not parts:
        raise ValueError("at least one reward function is needed")
    return CombinedReward(parts)
