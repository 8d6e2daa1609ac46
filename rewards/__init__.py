"""Verifiable rewards for GRPO and the domain verifiers used for accuracy.

`verify(sample, response_text)` is the domain verifier: the code reward (fraction of unit
tests passed, sandboxed) when the sample has `tests`, else the math reward (1.0 or 0.0)
when it has an `answer`, else None (nothing to check). The distillation trainer, `opd
validate` and the demo all measure accuracy with it.
"""

from __future__ import annotations

from opd.agent.sandbox import SandboxLimits, SandboxResult, run_many, run_tests
from opd.rewards.code import code_reward, code_reward_batch, extract_code
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
    out: list[float | None] = [None] * len(responses)
    code_idx = [i for i, s in enumerate(samples) if s.tests]
    code_vals = code_reward_batch([samples[i] for i in code_idx], [responses[i] for i in code_idx],
                                  workers=workers, **code_options)
    for i, v in zip(code_idx, code_vals):
        out[i] = v
    for i, s in enumerate(samples):
        if not s.tests and s.answer is not None:
            out[i] = math_reward(s, responses[i])
    return out


__all__ = ["verify", "verify_batch", "build_reward", "CombinedReward", "math_reward", "extract_answer",
           "answers_match", "code_reward", "code_reward_batch", "extract_code", "run_tests", "run_many",
           "SandboxLimits", "SandboxResult"]
