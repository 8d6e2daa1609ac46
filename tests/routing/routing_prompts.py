"""Synthetic labelled prompts for the routing tests: three domains with varied wording."""

from __future__ import annotations

import random


def _math(rng: random.Random) -> str:
    a, b, op = rng.randint(2, 999), rng.randint(2, 99), rng.choice("+-*/")
    return rng.choice([f"What is {a} {op} {b}?", f"Compute {a}{op}{b}.", f"Solve for x: x {op} {a} = {b}",
                       f"If Sam has {a} marbles and gives away {b}, how many are left?",
                       f"Find the sum of the first {b} odd numbers.", f"{a}{op}{b}="])


def _code(rng: random.Random) -> str:
    f = rng.choice(["add", "reverse", "is_prime", "count_words", "fib", "merge_lists", "parse_csv"])
    return rng.choice([f"Write a Python function {f}(x) that returns the result.",
                       f"def {f}(n):\n    # complete this function", f"Implement {f} in Python with a loop.",
                       f"Fix the bug in this code: return {f}(x[::-1])",
                       f"Write unit tests for the function {f}.", f"class Solver:\n    def {f}(self, items):"])


def _general(rng: random.Random) -> str:
    t = rng.choice(["the weather", "a good book", "your weekend", "cats", "the history of Rome", "tea", "music"])
    return rng.choice([f"Tell me about {t}.", f"Write a short poem about {t}.", f"Summarize {t} in one sentence.",
                       f"Why do people like {t}?", f"Give me three tips about {t}.",
                       f"Translate 'I love {t}' into French."])


GENERATORS = {"math": _math, "code": _code, "general": _general}


def labelled_prompts(n_per_domain: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    rows = [(GENERATORS[d](rng), d) for _ in range(n_per_domain) for d in GENERATORS]
    rng.shuffle(rows)
    return rows
