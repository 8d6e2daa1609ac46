"""Synthetic, verifiable data for the demo: math, code and general, with held-out splits.

Every sample is one JSONL row in the shape `opd.data` reads:

    math     {"prompt": "47+8=", "domain": "math", "answer": "55", "response": "55"}
    code     {"prompt": "f(x): triple x, add 4\n", "domain": "code",
              "tests": "assert f(0)==4\n...", "response": "f=lambda x:x*3+4"}
             (held-out rows also "hidden_tests": "assert f(23)==73\nassert f(31)==97")
    general  {"prompt": "upper: cab\n", "domain": "general", "answer": "CAB", "response": "CAB"}

Responses are short on purpose: the demo's byte-level model emits one byte per step, and
the tokenizer's EOS closes every response (the SFT trainer appends it), so "the answer
format" a model has to learn is "the answer, then EOS".

Math answers are checked by the math verifier (last number == `answer`); code answers
by running `tests` (Python asserts) against the response in the sandbox. The generators
are seeded and the held-out prompts never occur in the train split.
"""

from __future__ import annotations

import random
from pathlib import Path

from opd.data import write_jsonl

DOMAINS = ("math", "code", "general")

_MULTIPLY_WORDS = {2: "double", 3: "triple", 4: "quadruple"}


def math_sample(rng: random.Random) -> dict:
    """A two-digit number plus or minus a one-digit one; carries and borrows are the hard part."""
    a, b = rng.randint(10, 99), rng.randint(1, 9)
    if rng.random() < 0.5:
        prompt, answer = f"{a}+{b}=", a + b
    else:
        prompt, answer = f"{a}-{b}=", a - b
    return {"prompt": prompt, "domain": "math", "answer": str(answer), "response": str(answer)}


def _code_task(rng: random.Random) -> tuple[str, str, callable]:
    """(description, python expression in x, reference function) of one templated task.

    About 300 distinct descriptions, so the held-out split holds descriptions never trained on.
    """
    kind = rng.choice(["add", "sub", "mul", "mul_add", "square_add", "mod"])
    if kind == "add":
        n = rng.randint(1, 99)
        return f"add {n}", f"x+{n}", lambda x: x + n
    if kind == "sub":
        n = rng.randint(1, 99)
        return f"subtract {n}", f"x-{n}", lambda x: x - n
    if kind == "mul":
        n = rng.randint(2, 12)
        return f"times {n}", f"x*{n}", lambda x: x * n
    if kind == "mul_add":
        m, n = rng.choice(sorted(_MULTIPLY_WORDS)), rng.randint(1, 20)
        return f"{_MULTIPLY_WORDS[m]} x, add {n}", f"x*{m}+{n}", lambda x: x * m + n
    if kind == "square_add":
        n = rng.randint(1, 20)
        return f"square x, add {n}", f"x*x+{n}", lambda x: x * x + n
    n = rng.randint(2, 12)
    return f"x modulo {n}", f"x%{n}", lambda x: x % n


def code_sample(rng: random.Random) -> dict:
    """A one-line function from a description; three asserts check it on distinct inputs, and
    two more on inputs past that range are its hidden tests (no reward sees them; kept in the
    held-out split only, where `opd validate` sets them beside the visible ones). They draw
    nothing from `rng`: the rows are the ones drawn before they existed."""
    desc, expr, fn = _code_task(rng)
    xs = rng.sample(range(0, 20), 3)
    tests = "\n".join(f"assert f({x})=={fn(x)}" for x in xs)
    hidden = "\n".join(f"assert f({x})=={fn(x)}" for x in (23, 31))
    return {"prompt": f"f(x): {desc}\n", "domain": "code", "tests": tests, "hidden_tests": hidden,
            "response": f"f=lambda x:{expr}"}


def general_sample(rng: random.Random) -> dict:
    """Small string transformations: the instruction-following mix of the SFT set."""
    word = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(3, 5)))
    kind = rng.choice(["upper", "reverse", "first"])
    if kind == "upper":
        out = word.upper()
    elif kind == "reverse":
        out = word[::-1]
    else:
        out = word[0]
    return {"prompt": f"{kind}: {word}\n", "domain": "general", "answer": out, "response": out}


GENERATORS = {"math": math_sample, "code": code_sample, "general": general_sample}


def make_split(domain: str, n_train: int, n_eval: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Disjoint train and held-out rows of one domain (held-out prompts never seen in training)."""
    rng = random.Random(f"{domain}-{seed}")
    gen = GENERATORS[domain]
    held, held_prompts = [], set()
    while len(held) < n_eval:
        row = gen(rng)
        if row["prompt"] not in held_prompts:
            held.append(row)
            held_prompts.add(row["prompt"])
    train = []
    tries = 0
    while len(train) < n_train:
        row = gen(rng)
        tries += 1
        if row["prompt"] not in held_prompts:
            train.append(row)
        if tries > 100 * (n_train + 1):
            raise ValueError(f"{domain}: cannot draw {n_train} training prompts disjoint from the "
                             f"{n_eval} held-out ones; lower n_eval")
    for row in train:   # hidden tests are for evaluation: a training set does not carry them
        row.pop("hidden_tests", None)
    return train, held


def write_demo_data(out_dir: str | Path, *, n_train: int = 2000, n_eval: int = 100, seed: int = 0,
                    domains: tuple[str, ...] = DOMAINS) -> dict[str, dict[str, Path]]:
    """Write DOMAIN_train.jsonl and DOMAIN_eval.jsonl per domain; return {domain: {split: path}}."""
    out = Path(out_dir)
    paths = {}
    for d in domains:
        train, held = make_split(d, n_train, n_eval, seed)
        paths[d] = {"train": out / f"{d}_train.jsonl", "eval": out / f"{d}_eval.jsonl"}
        write_jsonl(paths[d]["train"], train)
        write_jsonl(paths[d]["eval"], held)
    return paths
