"""Several reward functions combined with weights into one scalar per response.

`build_reward(specs)` turns the config's reward list into a `CombinedReward`, called on a
batch: `total, parts = reward(samples, responses)`, where parts[name] are the unweighted
values of each function (logged separately, so a user sees which one moves).
"""

from __future__ import annotations

import inspect
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from opd.agent.calls import parse_calls
from opd.agent.trajectory import Trajectory
from opd.config import ConfigError
from opd.rewards.code import code_options_used, code_reward_batch
from opd.rewards.math import math_reward
from opd.rewards.shaping import format_reward, length_penalty
from opd.rewards.user import load_user_reward

# (samples, responses, trajectories: one opd.agent.trajectory.Trajectory per response) -> values
BatchFn = Callable[[list, list[str], list], list[float]]


def _per_item(fn: Callable, options: dict) -> BatchFn:
    """fn(sample, response, **options) per item, and its `trajectory` too when it takes one (the
    whole multi-turn trajectory: opd.agent.trajectory); options it does not take are refused
    here, at start-up, rather than at the first step's rewards (or, for **kwargs, never)."""
    wants = "trajectory" in inspect.signature(fn).parameters
    try:
        inspect.signature(fn).bind(None, "", **({"trajectory": None} if wants else {}), **options)
    except TypeError:
        params = [p for p in list(inspect.signature(fn).parameters)[2:] if p != "trajectory"]
        raise ValueError(f"reward {getattr(fn, '__name__', fn)!r}: options {sorted(options)} do not fit; "
                         f"it takes {params or 'none'}") from None
    if wants:
        return lambda samples, responses, trajs: [float(fn(s, r, trajectory=t, **options))
                                                  for s, r, t in zip(samples, responses, trajs)]
    return lambda samples, responses, trajs: [float(fn(s, r, **options)) for s, r in zip(samples, responses)]


def _options_used(fn: Callable, options: dict) -> dict:
    """The keyword options fn runs with: its defaults, then the configured ones."""
    defaults = {name: p.default for name, p in list(inspect.signature(fn).parameters.items())[2:]
                if p.default is not inspect.Parameter.empty and name != "trajectory"}
    return {**defaults, **options}


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_format(options: dict) -> None:
    pattern = options["pattern"]
    if not isinstance(pattern, str):
        raise ValueError(f"option pattern: expected a regular expression (a string), got {pattern!r}")
    try:
        re.compile(pattern, re.DOTALL)
    except re.error as e:
        raise ValueError(f"option pattern {pattern!r} is not a valid regular expression: {e}") from None


def _check_length(options: dict, given: dict) -> None:
    def shown(key):
        return f"{options[key]!r}" + ("" if key in given else " (the default)")

    for key in ("soft_max", "hard_max"):
        if not _is_number(options[key]) or options[key] < 0:
            raise ValueError(f"option {key}: expected a number of characters >= 0, got {options[key]!r}")
    if options["hard_max"] <= options["soft_max"]:
        raise ValueError(f"option hard_max {shown('hard_max')} must be greater than option soft_max "
                         f"{shown('soft_max')}: the penalty falls from 0 at soft_max to -1 at hard_max")


@dataclass
class CombinedReward:
    parts: list[tuple[str, float, BatchFn]]  # (label, weight, batch function)
    # label -> the options each function runs with, its defaults filled in (for the card)
    options: dict[str, dict] = field(default_factory=dict)

    def __call__(self, samples: list, responses: list[str],
                 trajectories: list | None = None) -> tuple[list[float], dict[str, list[float]]]:
        """`trajectories`: each response's whole trajectory (opd.agent.trajectory), for the reward
        functions that take one; without them a response is a trajectory of one turn."""
        if trajectories is None:
            trajectories = [Trajectory([r], [], [parse_calls(r)]) for r in responses]
        total = [0.0] * len(responses)
        values: dict[str, list[float]] = {}
        for label, weight, fn in self.parts:
            vals = fn(samples, responses, trajectories)
            _check_finite(f"reward {label!r}", vals, responses)
            values[label] = vals
            total = [t + weight * v for t, v in zip(total, vals)]
        _check_finite("the weighted sum of the rewards", total, responses)
        return total, values

    def describe(self) -> dict[str, dict]:
        """{label: {"weight": w, option: value, ...}}: each function's weight and the options it
        runs with (the defaults included), as the card records them."""
        return {label: {"weight": weight, **self.options.get(label, {})} for label, weight, _ in self.parts}


def _check_finite(what: str, vals: list[float], responses: list[str]) -> None:
    """Refuse NaN and inf: one of them makes its group's advantages NaN, then the loss, and
    after the optimizer step every weight of the policy."""
    bad = next((i for i, v in enumerate(vals) if not math.isfinite(v)), None)
    if bad is not None:
        raise ConfigError(f"{what} is {vals[bad]} for sample {bad} of the batch (response "
                          f"{responses[bad][:80]!r}); a reward must be a finite number for every response, "
                          f"an empty or unparsable one too")


def _reward_fn(spec, base_dir) -> tuple[BatchFn, dict]:
    """(batch function, the options it runs with). Unknown options and values the function
    cannot use are refused here, at start-up: they failed at the first step's rewards, after
    the model load and the first rollout (a bad regex, hard_max <= soft_max)."""
    opts = dict(spec.options)
    if spec.name == "math":
        return _per_item(math_reward, opts), _options_used(math_reward, opts)
    if spec.name == "code":
        used = code_options_used(opts)   # unknown options and bad values refused now
        return (lambda samples, responses, trajs, o=opts: code_reward_batch(samples, responses, **o)), used
    if spec.name == "format":
        fn, used = _per_item(format_reward, opts), _options_used(format_reward, opts)
        _check_format(used)
        return fn, used
    if spec.name == "length":
        fn, used = _per_item(length_penalty, opts), _options_used(length_penalty, opts)
        _check_length(used, opts)
        return fn, used
    if spec.name == "python":
        path = spec.path
        user_fn = load_user_reward(path, None if Path(path.rsplit(":", 1)[0]).is_file() else base_dir)
        return _per_item(user_fn, opts), {"path": path, **_options_used(user_fn, opts)}
    raise ValueError(f"unknown reward {spec.name!r}")


def reward_labels(specs: list[tuple[str, str | None]]) -> list[str]:
    """The label of each reward (name, path) as metrics and the card name it: the name, or
    python:FUNCTION, with #INDEX added to a label already taken (two format rewards)."""
    labels: list[str] = []
    for name, path in specs:
        label = name if name != "python" else f"python:{(path or '').rsplit(':', 1)[-1]}"
        labels.append(f"{label}#{len(labels)}" if label in labels else label)
    return labels


def build_reward(specs, base_dir: str | Path | None = None) -> CombinedReward:
    """specs: RewardConfig items (name, weight, options, path)."""
    parts, options = [], {}
    labels = reward_labels([(spec.name, spec.path) for spec in specs])
    for i, spec in enumerate(specs):
        try:
            fn, used = _reward_fn(spec, base_dir)
        except ValueError as e:   # options that do not fit: a config mistake, said at start-up
            raise ConfigError(f"rewards[{i}] ({spec.name}): {e}") from None
        if not math.isfinite(spec.weight):   # inf * 0 is NaN: every reward would be poisoned
            raise ConfigError(f"rewards[{i}] ({spec.name}): weight must be a finite number, got {spec.weight}")
        label = labels[i]
        parts.append((label, float(spec.weight), fn))
        options[label] = used
    if not parts:
        raise ValueError("at least one reward function is needed")
    return CombinedReward(parts, options)


# The sample field each built-in verifier scores against; a row without it scores 0.
NEEDS_FIELD = {"math": "answer", "code": "tests"}


def check_reward_fields(specs, samples: list, path: str) -> None:
    """Refuse a verifier that no training row can satisfy: every reward would be 0, and GRPO's
    warning would blame the data's difficulty or the temperature. (Rows of another domain
    without the field are normal in mixed data, so a partial lack is not refused.)"""
    for spec in specs:
        field = NEEDS_FIELD.get(spec.name)
        if field and samples and not any(getattr(s, field) for s in samples):
            raise ConfigError(f"the {spec.name} reward scores each row's `{field}`, and no row of {path} has one")
