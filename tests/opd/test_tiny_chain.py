"""opd.tiny.chain: the long-horizon task's program, traces, lengths and verification."""

import random

from opd.data import Sample
from opd.rewards import math_reward
from opd.tiny.chain import NEXT, STEPS_FOR_TOKENS, chain, chain_sample, chain_split, program


def test_the_program_is_one_cycle_through_every_value():
    assert sorted(NEXT) == list(range(100))
    assert len(set(chain(0, 100))) == 100 and chain(0, 100)[-1] == 0    # back to the start after 100 steps
    assert program(0) == NEXT and program(1) != NEXT


def test_a_trace_by_hand():
    row = chain_sample(random.Random(0), 4)
    start, steps = row["prompt"].rstrip("=").split("*")
    v1 = NEXT[int(start)]
    assert row["response"].startswith(f"4:{v1:02d} 3:{NEXT[v1]:02d} ")
    assert row["response"].endswith(f"1:{row['answer']}") and row["answer"] == f"{chain(int(start), 4)[-1]:02d}"


def test_lengths_are_the_knob():
    rng = random.Random(1)
    for tokens, steps in STEPS_FOR_TOKENS.items():
        lengths = [len(chain_sample(rng, steps)["response"]) + 1 for _ in range(200)]   # + EOS, a byte a token
        assert 0.85 * tokens < sum(lengths) / len(lengths) < 1.05 * tokens, (tokens, sum(lengths) / len(lengths))


def test_the_math_verifier_reads_the_last_value_and_a_wrong_step_fails():
    row = chain_sample(random.Random(2), 12)
    sample = Sample(prompt=row["prompt"], answer=row["answer"])
    assert math_reward(sample, row["response"]) == 1.0
    steps = row["response"].split(" ")
    k, v = steps[5].split(":")
    off = (int(v) + 1) % 100                                     # one wrong step, the program followed from it
    wrong = steps[:5] + [f"{k}:{off:02d}"] + [f"{s.split(':')[0]}:{x:02d}" for s, x in zip(steps[6:], chain(off, 6))]
    assert math_reward(sample, " ".join(wrong)) == 0.0
    assert math_reward(sample, " ".join(steps[:-1])) == 0.0      # stopped a step early


def test_split_evaluates_every_start_and_mixes_lengths():
    train, evaluation = chain_split([3, 12], 500, 200, seed=0)
    assert {r["prompt"].split("*")[1] for r in train} == {"3=", "12="}
    assert [r["prompt"] for r in evaluation[:4]] == ["00*3=", "00*12=", "01*3=", "01*12="]
    assert len({r["prompt"] for r in evaluation}) == 200
