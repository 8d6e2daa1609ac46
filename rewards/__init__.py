"""Verifiable rewards for GRPO and the domain verifiers used for accuracy.

`verify(sample, response_text)` is the domain verifier: the code reward (fraction of unit
tests passed, sandboxed) when the sample has `tests`, else the math reward (1.0 or 0.0)
when it has an `answer`, else None (nothing to check). The distillation trainer, `opd
validate` and the demo all measure accuracy with it.
"""

from __future__ import annotations

import dataclasses

from opd.agent.sandbox import SandboxLimits, SandboxResult, run_many, run_tests
from opd.rewards.code import code_results_batch, code_reward, code_reward_batch, extract_code
from opd.rewards.combine import CombinedReward, build_reward
from opd.rewards.math import answers_match, extract_answer, math_reward


def correct(score: float) -> bool:
    """A verifier's score of 1 is a correct answer. A code answer passing some of its tests
    scores that share (partial credit), which is not a correct answer."""
    return score >= 1.0


def accuracy(scores: list[float]) -> float:
    """The share of answers that are correct."""
    return sum(map(correct, scores)) / len(scores)


def verify(sample, response_text: str, **code_options) -> float | None:
    """Domain verifier: code by `tests`, math by `answer`; None when the sample has neither."""
    if sample.tests:
        return code_reward(sample, response_text, **code_options)
    if sample.answer is not None:
        return math_reward(sample, response_text)
    return None


def verify_batch(samples, responses: list[str], workers: int = 2, **code_options) -> list[float | None]:
    """verify() for many responses; code samples run `workers` sandboxes at a time."""
    return [score for score, _ in verify_details(samples, responses, workers, **code_options)]


def verify_details(samples, responses: list[str], workers: int = 2,
                   **code_options) -> list[tuple[float | None, str | None]]:
    """(score, how the verifier read it) for many responses: code by its tests in the sandbox
    (its status: ok, error, timeout, crash, no_tests), math by its answer ("answer", or
    "no_answer" when none could be extracted), (None, None) for a sample with neither."""
    out: list[tuple[float | None, str | None]] = [(None, None)] * len(responses)
    code_idx = [i for i, s in enumerate(samples) if s.tests]
    results = code_results_batch([samples[i] for i in code_idx], [responses[i] for i in code_idx],
                                 workers=workers, **code_options)
    for i, r in zip(code_idx, results):
        out[i] = (r.reward, r.status)
    for i, s in enumerate(samples):
        if not s.tests and s.answer is not None:
            out[i] = (math_reward(s, responses[i]), "answer" if extract_answer(responses[i]) is not None else "no_answer")
    return out


def hidden_pass(samples, responses: list[str], workers: int = 2, **code_options) -> list[bool | None]:
    """Per response, whether it passes every one of its sample's `hidden_tests` (the tests no
    reward sees), in the sandbox; None for a sample without them."""
    idx = [i for i, s in enumerate(samples) if s.hidden_tests]
    held = [dataclasses.replace(samples[i], tests=samples[i].hidden_tests) for i in idx]
    results = code_results_batch(held, [responses[i] for i in idx], workers=workers, **code_options)
    out: list[bool | None] = [None] * len(responses)
    for i, r in zip(idx, results):
        out[i] = r is not None and correct(r.reward)
    return out


def hidden_gap(visible: list[float], hidden: list[bool], threshold: float = 0.1) -> dict:
    """Over the answers whose samples have hidden tests: the share correct by the visible tests,
    the share passing the hidden ones, and a warning when the first exceeds the second by more
    than `threshold` (the policy may fit the tests it is rewarded on: reward hacking)."""
    vis, hid = accuracy(visible), sum(hidden) / len(hidden)
    out = {"visible_accuracy": vis, "hidden_accuracy": hid}
    if vis - hid > threshold:
        out["warning"] = (f"{vis:.0%} of the answers pass their visible tests but {hid:.0%} their hidden ones: the "
                          f"model may be fitting the tests it is rewarded on (reward hacking); read its answers")
    return out


__all__ = ["verify", "verify_batch", "verify_details", "hidden_pass", "hidden_gap", "code_results_batch", "build_reward", "CombinedReward", "math_reward", "extract_answer",
           "answers_match", "code_reward", "code_reward_batch", "extract_code", "run_tests", "run_many",
           "SandboxLimits", "SandboxResult"]
