"""Diagnostics against hand-computed values."""

import torch

from opd.diagnostics import DomainTally, repeated_ngram_ratio, response_stats, topk_overlap


def test_repeated_ngram_ratio():
    assert repeated_ngram_ratio([1, 2, 3, 4], 2) == 0.0
    # bigrams (1,2) (2,1) (1,2) (2,1): 2 distinct of 4
    assert repeated_ngram_ratio([1, 2, 1, 2, 1], 2) == 0.5
    assert repeated_ngram_ratio([7, 7, 7, 7], 1) == 0.75
    assert repeated_ngram_ratio([1], 2) == 0.0


def test_topk_overlap():
    student = torch.tensor([[5.0, 4.0, 3.0, 0.0], [0.0, 1.0, 2.0, 3.0]])   # top-2: {0,1} and {3,2}
    teacher = torch.tensor([[1, 3], [2, 3]])
    assert topk_overlap(student, teacher).tolist() == [0.5, 1.0]


def test_response_stats():
    eos = 0
    s = response_stats([[1, 2, 0], [0], [3, 3, 3, 3]], ["eos", "eos", "length"], {eos}, ngram=1)
    assert s["response_len"] == (3 + 1 + 4) / 3
    assert s["length_limit_share"] == 1 / 3
    assert s["eos_rate"] == 2 / 3
    assert s["empty_share"] == 1 / 3
    assert abs(s["repeat_ngram"] - (0 + 0 + 0.75) / 3) < 1e-12


def test_domain_tally_per_domain_and_shares():
    t = DomainTally()
    t.add_rows("math", "kl", torch.tensor([1.0, 3.0]))
    t.add_rows("code", "kl", torch.tensor([4.0]))
    t.add_response("math", [1, 0], "eos")
    t.add_response("math", [2, 0], "eos")
    t.add_response("code", [5, 6], "length")
    t.add_loss("math", 1.0)
    t.add_loss("code", 3.0)
    m = t.metrics({0}, ngram=2)
    assert m["diag/math/kl"] == 2.0 and m["diag/code/kl"] == 4.0
    assert abs(t.row_mean("kl") - (1 + 3 + 4) / 3) < 1e-6
    assert m["diag/math/sample_share"] == 2 / 3
    assert m["diag/code/loss_share"] == 0.75
    assert m["diag/code/length_limit_share"] == 1.0 and m["diag/math/eos_rate"] == 1.0
