"""The agentic demo's task: products too large for a tiny model to compute, easy with a calculator.

    prompt   "417*3829="           a 3-digit times a 4-digit number (an N-digit times an M-digit one)
    answer   "1596693"             checked by the math verifier (the last number == `answer`); every
                                   product has N + M digits

A byte-level model of a few hundred thousand parameters cannot multiply numbers this large
(one token per digit, no room for the partial products), but it can learn to copy: the
expression into a call of the calculator tool (opd.agent's built-in, exact integers) and the
tool's answer into its own. The files, every row in the shape opd.data reads:

    teacher_sft.jsonl   two `messages` rows per problem, the skill with the tool:
                        [user] -> <tool_call>{"name": "calculator", "arguments": {"expression": "417*3829"}}</tool_call>
                        [user, assistant (that call), tool "1596693"] -> "1596693"
    student_sft.jsonl   the student's start: [user] -> "1596693" directly (the answer format, not the skill)
    train.jsonl         prompt rows with `answer`, for opd train / opd rl (never held out)
    eval.jsonl          held-out prompt rows with `answer`: no problem of it occurs in any file above

The call's text is what the chat template's `tojson` writes for a structured call (opd.tiny.models'
CHAT_TEMPLATE), so a call learnt as text and one rendered from `tool_calls` are the same tokens.
Seeded: the same arguments give the same files.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from opd.data import write_jsonl

TOOL = "calculator"


def call_text(expression: str) -> str:
    """The assistant turn that calls the calculator on `expression` (Hermes / Qwen format)."""
    return "<tool_call>" + json.dumps({"name": TOOL, "arguments": {"expression": expression}}) + "</tool_call>"


def problems(n: int, rng: random.Random, digits: tuple[int, int], taken: set) -> list[tuple[int, int]]:
    """n distinct (a, b) pairs, a with digits[0] digits and b with digits[1], whose product has
    digits[0] + digits[1] digits, none in `taken` (which they are added to).

    One length for every product: a tiny model copies the tool's answer by its position (the
    template between the tool message and its own turn is fixed), and one that learnt 7-digit
    copies shifts 6-digit ones by a digit (417*3829 has 7, 141*5242 = 739122 only 6; 14 of 100
    held-out answers failed so, all 6-digit, when both lengths were drawn)."""
    lo_a, lo_b = 10 ** (digits[0] - 1), 10 ** (digits[1] - 1)
    space = 9 * lo_a * 9 * lo_b // 2   # about half of the pairs have the full length; a bound, not a count
    if len(taken) + n > space // 2:
        raise ValueError(f"{n} more problems of {digits} digits: too many for their pairs")
    out = []
    while len(out) < n:
        pair = (rng.randrange(lo_a, 10 * lo_a), rng.randrange(lo_b, 10 * lo_b))
        if len(str(pair[0] * pair[1])) == sum(digits) and pair not in taken:
            taken.add(pair)
            out.append(pair)
    return out


def prompt_of(a: int, b: int) -> str:
    return f"{a}*{b}="


def expression_of(a: int, b: int) -> str:
    return f"{a}*{b}"


def teacher_rows(a: int, b: int) -> list[dict]:
    """The two turns of solving a*b with the tool, one `messages` row each."""
    user = {"role": "user", "content": prompt_of(a, b)}
    call = {"role": "assistant", "content": call_text(expression_of(a, b))}
    answer = str(a * b)
    return [{"messages": [user, call], "domain": "math", "answer": answer},
            {"messages": [user, call, {"role": "tool", "content": answer},
                          {"role": "assistant", "content": answer}], "domain": "math", "answer": answer}]


def prompt_row(a: int, b: int) -> dict:
    return {"prompt": prompt_of(a, b), "domain": "math", "answer": str(a * b)}


def write_agentic_data(out_dir: str | Path, *, n_sft: int = 2000, n_train: int = 1000, n_eval: int = 100,
                       digits: tuple[int, int] = (3, 4), seed: int = 0) -> dict[str, Path]:
    """Write the four files of the module docstring to out_dir; returns their paths by name.

    n_sft problems give the teacher's and the student's SFT rows (the same problems: the two
    models differ in what they learn from them, not in which products they saw), n_train the
    prompts of distillation and RL, n_eval the held-out prompts; all three sets are disjoint."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng, taken = random.Random(seed), set()
    held_out = problems(n_eval, rng, digits, taken)     # drawn first: the test does not move with n_sft
    sft = problems(n_sft, rng, digits, taken)
    train = problems(n_train, rng, digits, taken)
    paths = {
        "teacher_sft": write_jsonl(out / "teacher_sft.jsonl", [r for a, b in sft for r in teacher_rows(a, b)]),
        "student_sft": write_jsonl(out / "student_sft.jsonl",
                                   [{**prompt_row(a, b), "response": str(a * b)} for a, b in sft]),
        "train": write_jsonl(out / "train.jsonl", [prompt_row(a, b) for a, b in train]),
        "eval": write_jsonl(out / "eval.jsonl", [prompt_row(a, b) for a, b in held_out]),
    }
    return paths
