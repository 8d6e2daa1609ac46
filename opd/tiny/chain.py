"""A verifiable task whose answers are long chains: a program's trace, written out.

    prompt   "37*4="                    start at 37 and take four steps of the program
    response "4:82 3:15 2:60 1:09"      each step "k:vv": a countdown k (so the model knows when
                                        to stop) and the next value, NEXT[previous value]
    answer   "09"                       the last value, two digits (the math verifier reads the last number)

The program is one fixed table NEXT over 00..99, a single cycle through all hundred values
(seeded; no chain of fewer than 100 steps repeats a value), which a model has to learn: the
task is knowing a hundred facts and applying them in order. Each value depends on the one
before it, so one wrong step makes every later value, and the answer, wrong: a student right
at a step with probability p answers correctly with p**n. `steps` is the length knob: 3, 12 and
44 steps give responses of about 16, 64 and 256 tokens with the byte-level tokenizer (one token
a character, plus EOS). Every step is local (the previous value, 5 or 6 tokens back, and a
decrement), so tiny models learn it; the difficulty is holding it exactly for many steps.
There are 100 prompts per length, and the evaluation asks every one (chain_split says why).
"""

from __future__ import annotations

import random
from pathlib import Path

from opd.data import write_jsonl

# steps per response for the three lengths the long-horizon bench uses (tokens, about)
STEPS_FOR_TOKENS = {16: 3, 64: 12, 256: 44}


def program(seed: int = 0) -> list[int]:
    """NEXT: a random cyclic permutation of 0..99 (one cycle through all of them)."""
    order = list(range(100))
    random.Random(f"chain-program-{seed}").shuffle(order)
    nxt = [0] * 100
    for a, b in zip(order, order[1:] + order[:1]):
        nxt[a] = b
    return nxt


NEXT = program()


def chain(start: int, steps: int, table: list[int] = NEXT) -> list[int]:
    """The values after each step: v_1 = table[start], v_{i+1} = table[v_i]."""
    out, v = [], start
    for _ in range(steps):
        v = table[v]
        out.append(v)
    return out


def chain_sample(rng: random.Random, steps: int, start: int | None = None) -> dict:
    start = rng.randint(0, 99) if start is None else start
    values = chain(start, steps)
    response = " ".join(f"{steps - i}:{v:02d}" for i, v in enumerate(values))
    return {"prompt": f"{start:02d}*{steps}=", "domain": "chain", "answer": f"{values[-1]:02d}",
            "response": response}


def chain_split(steps: int | list[int], n_train: int, n_eval: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Training rows (random starts; `steps` a list draws each row's length from it) and the
    evaluation rows: each start in turn, with each length (at most n_eval rows). The task is
    executing a learned program, so the evaluation asks the same hundred starts as training
    does: a start only ever seen inside responses is another skill (naming the value that
    follows a number written in the prompt), which held-out starts would measure instead."""
    lengths = [steps] if isinstance(steps, int) else list(steps)
    rng = random.Random(f"chain-{lengths}-{seed}")
    heldout = [chain_sample(rng, n, start) for start in range(100) for n in lengths][:n_eval]
    train = [chain_sample(rng, rng.choice(lengths)) for _ in range(n_train)]
    return train, heldout


def write_chain_data(out_dir: str | Path, steps: int | list[int], *, n_train: int, n_eval: int,
                     seed: int = 0) -> dict[str, Path]:
    """chain_train.jsonl and chain_eval.jsonl under out_dir: {"train": path, "eval": path}."""
    out = Path(out_dir)
    train, held = chain_split(steps, n_train, n_eval, seed)
    paths = {"train": out / "chain_train.jsonl", "eval": out / "chain_eval.jsonl"}
    write_jsonl(paths["train"], train)
    write_jsonl(paths["eval"], held)
    return paths
