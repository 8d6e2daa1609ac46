"""Diagnostics against hand-computed values."""

import pytest
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


def test_position_buckets_and_kl_along_the_response():
    from opd.diagnostics import position_buckets

    pos = torch.tensor([0, 15, 16, 63, 64, 300, 2000])
    b = position_buckets(pos)
    assert list(b) == ["0-15", "16-63", "64-255", "256-1023", "1024+"]
    assert [pos[m].tolist() for m in b.values()] == [[0, 15], [16, 63], [64], [300], [2000]]
    assert list(position_buckets(torch.tensor([3, 4]))) == ["0-15"]   # empty buckets are left out

    t = DomainTally()
    kl = torch.tensor([1.0, 3.0, 10.0, 20.0, 5.0])
    t.add_rows_by_position("math", "kl", kl, torch.tensor([0, 1, 16, 17, 70]))
    m = t.metrics(set(), ngram=2)
    assert m["diag/math/kl@0-15"] == 2.0 and m["diag/math/kl@16-63"] == 15.0 and m["diag/math/kl@64-255"] == 5.0
    assert "diag/math/kl@256-1023" not in m


def test_step_stats_entropy_is_the_mean_surprise_of_the_sampled_tokens_and_kl_goes_by_position():
    from opd.distill.batch import Batch
    from opd.distill.stats import StepStats
    from opd.rollout.base import Rollout
    from opd.routing import Route

    ros = [Rollout([1], [5, 6, 0], [-0.5, -1.5, -1.0], "eos", prompt_index=0),
           Rollout([1], [7, 8], [-2.0, -9.0], "length", prompt_index=1, mask=[1, 0]),   # 8: an observation
           Rollout([2], [9], [-4.0], "eos", prompt_index=2)]
    routes = [Route(teacher="t", weights={"t": 1.0}, rule="domain_field", reason="", domain="math"), Route(teacher="t", weights={"t": 1.0}, rule="domain_field", reason="", domain="math"),
              Route(teacher="t", weights={"t": 1.0}, rule="domain_field", reason="", domain="code")]
    stats = StepStats()
    stats.add_batch(Batch(index=0, samples=[None] * 3, routes=routes, rollouts=ros, keep=[3, 2, 1],
                          policy_version=0), version=0)
    kl = torch.tensor([0.1, 0.3, 0.2, 0.7])
    stats.add_teacher_rows("t", ["math", "math", "math", "code"], kl, kl, None, None, {"math": 1.0, "code": 1.0},
                           torch.tensor([0, 1, 20, 0]))
    row = stats.row(lr=0.0, grad_norm=0.0, elapsed=1.0, stop_ids={0}, ngram=2)
    assert abs(row["diag/math/entropy"] - (0.5 + 1.5 + 1.0 + 2.0) / 4) < 1e-6   # the observation is not the model's
    assert row["diag/code/entropy"] == 4.0
    assert abs(row["entropy"] - (0.5 + 1.5 + 1.0 + 2.0 + 4.0) / 5) < 1e-6
    assert abs(row["diag/math/kl@0-15"] - 0.2) < 1e-6 and abs(row["diag/math/kl@16-63"] - 0.2) < 1e-6
    assert abs(row["diag/code/kl@0-15"] - 0.7) < 1e-6


def test_a_warning_when_held_out_kl_falls_while_accuracy_falls():
    from opd.distill.stats import History

    h = History.start(["t"], quiet=True)
    h.evals.append({"step": 0, "eval/kl": 1.0, "eval/accuracy": 0.5, "eval/scored": 100})
    h.warn_kl_without_accuracy(10, {"eval/kl": 1.2, "eval/accuracy": 0.2, "eval/scored": 100})   # KL rose
    h.warn_kl_without_accuracy(10, {"eval/kl": 0.8, "eval/accuracy": 0.45, "eval/scored": 100})  # within 0.07
    assert h.warnings == []
    h.warn_kl_without_accuracy(10, {"eval/kl": 0.8, "eval/accuracy": 0.3, "eval/scored": 100})
    assert len(h.warnings) == 1 and "held-out KL fell (1 -> 0.8)" in h.warnings[0] and "since step 0" in h.warnings[0]


def test_bucket_entropy_is_the_entropy_of_the_answered_tokens_and_one_tail_bucket():
    import math

    from opd.diagnostics import bucket_entropy

    p = torch.tensor([[0.5, 0.25], [1.0, 0.0]])
    tail = torch.tensor([math.log(0.25), float("-inf")])   # the second row: no tail at all
    lp = torch.where(p > 0, p.log(), torch.full_like(p, float("-inf")))
    h = bucket_entropy(lp, tail)
    assert h[0].item() == pytest.approx(-(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25)))
    assert h[1].item() == 0.0
    # a lower bound: merging the last two of four equal tokens into the tail bucket
    full = -4 * 0.25 * math.log(0.25)
    assert bucket_entropy(torch.log(torch.tensor([[0.25, 0.25]])), torch.tensor([math.log(0.5)])).item() < full
