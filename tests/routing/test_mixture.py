"""Mixture ratios are honoured over many batches, and a resumed sampler draws the same samples."""

from __future__ import annotations

import pytest

from opd.data import Sample
from opd.routing.mixture import MixtureSampler


def datasets() -> dict[str, list[Sample]]:
    return {d: [Sample(prompt=f"{d}-{i}", domain=d) for i in range(n)]
            for d, n in (("math", 37), ("code", 11), ("general", 5))}


@pytest.mark.parametrize("batch_size", [1, 3, 7, 16])
def test_ratios_honoured_over_many_batches(batch_size):
    s = MixtureSampler(datasets(), {"math": 0.5, "code": 0.3, "general": 0.2}, seed=0)
    n_batches = 500
    counts = {"math": 0, "code": 0, "general": 0}
    for _ in range(n_batches):
        batch = s.sample(batch_size)
        assert len(batch) == batch_size
        for x in batch:
            counts[x.domain] += 1
    total = n_batches * batch_size
    # largest remainder with carry: within one sample of the exact share, at any batch size
    for d, r in {"math": 0.5, "code": 0.3, "general": 0.2}.items():
        assert abs(counts[d] - r * total) <= 1, (d, counts)
    assert s.drawn == counts


def test_a_domain_served_ahead_never_makes_a_batch_too_large():
    # Two large ratios and four tiny ones at batch size 3: tiny domains run a negative carry
    # that a plain floor would clamp to 0, giving out 4 samples (batch 57 here, before).
    ratios = {"a": 0.5, "b": 0.46, "c": 0.01, "d": 0.01, "e": 0.01, "f": 0.01}
    s = MixtureSampler({d: [Sample(prompt=f"{d}{i}", domain=d) for i in range(3)] for d in ratios}, ratios)
    for n in range(1, 2001):
        assert len(s.sample(3)) == 3, n
        assert abs(sum(s.carry.values())) < 1e-6 and all(abs(c) <= 1 + 1e-9 for c in s.carry.values()), (n, s.carry)
    for d, r in ratios.items():
        assert abs(s.drawn[d] - r * 6000) <= 1, (d, s.drawn)


def test_ratios_are_normalized_and_zero_ratio_domains_never_drawn():
    s = MixtureSampler(datasets(), {"math": 3, "code": 1, "general": 0}, seed=1)
    drawn = [x.domain for _ in range(100) for x in s.sample(4)]
    assert drawn.count("general") == 0
    assert drawn.count("math") == 300 and drawn.count("code") == 100


def test_every_sample_of_a_domain_is_seen_once_per_epoch():
    s = MixtureSampler(datasets(), {"math": 1, "code": 1, "general": 1}, seed=2)
    general = [x.prompt for _ in range(5) for x in s.sample(3) if x.domain == "general"]
    assert sorted(general) == sorted(f"general-{i}" for i in range(5))


def test_resume_draws_exactly_the_same_samples():
    ratios = {"math": 0.45, "code": 0.35, "general": 0.2}
    a = MixtureSampler(datasets(), ratios, seed=3)
    for _ in range(13):
        a.sample(6)
    state = a.state()
    expected = [[x.prompt for x in a.sample(6)] for _ in range(20)]

    b = MixtureSampler(datasets(), ratios, seed=3)
    b.load_state(state)
    assert [[x.prompt for x in b.sample(6)] for _ in range(20)] == expected
    # a different seed draws a different stream
    c = MixtureSampler(datasets(), ratios, seed=4)
    c.load_state(state)
    assert [[x.prompt for x in c.sample(6)] for _ in range(20)] != expected


def test_bad_ratios_are_refused():
    with pytest.raises(ValueError, match="no data set"):
        MixtureSampler(datasets(), {"biology": 1.0}, seed=0)
    with pytest.raises(ValueError, match="positive"):
        MixtureSampler(datasets(), {"math": 0.0}, seed=0)
