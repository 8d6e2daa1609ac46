"""Shaping rewards: a format reward and a length penalty (both optional, both weighted).

format: 1.0 when the response matches a regular expression (default: it gives a final
        answer in a recognisable form: \\boxed{}, "Answer:", "####" or a ```python block).
length: 0 up to `soft_max` characters, then falling linearly to -1 at `hard_max` (DAPO's
        overlong shaping, counted in characters so it does not depend on the tokenizer).
"""

from __future__ import annotations

import re

DEFAULT_FORMAT = r"\\boxed\{.+\}|(?i:answer)\s*[:=]\s*\S|####\s*\S|```(?:python|py)?\s*\n.+"


def format_reward(sample, response: str, pattern: str = DEFAULT_FORMAT) -> float:
    return 1.0 if re.search(pattern, response, re.DOTALL) else 0.0


def length_penalty(sample, response: str, soft_max: int = 512, hard_max: int = 1024) -> float:
    if hard_max <= soft_max:
        raise ValueError(f"length penalty needs hard_max > soft_max, got {soft_max}, {hard_max}")
    n = len(response)
    if n <= soft_max:
        return 0.0
    return -min(1.0, (n - soft_max) / (hard_max - soft_max))
