"""Domain loss normalization, loss shares and the lopsided-student check, by hand."""

from __future__ import annotations

import pytest

from opd.routing.normalize import DomainLossNormalizer, lopsided


def test_none_mode_is_identity():
    n = DomainLossNormalizer("none")
    assert n.scale("math", 5.0) == 1.0 and n.scale("code", 0.01) == 1.0


def test_running_mean_by_hand():
    n = DomainLossNormalizer("running_mean", momentum=0.5)
    assert n.scale("math", 4.0) == pytest.approx(1 / 4.0)          # mean starts at the first value
    assert n.scale("math", 2.0) == pytest.approx(1 / 3.0)          # 0.5*4 + 0.5*2
    assert n.scale("math", 1.0) == pytest.approx(1 / 2.0)          # 0.5*3 + 0.5*1
    assert n.scale("code", 0.1) == pytest.approx(10.0)             # domains are independent
    # a domain with 40x the loss ends up contributing about as much as the other
    n2 = DomainLossNormalizer("running_mean", momentum=0.9)
    for _ in range(50):
        big, small = 40.0 * n2.scale("big", 40.0), 1.0 * n2.scale("small", 1.0)
    assert big == pytest.approx(small)


def test_state_round_trip():
    n = DomainLossNormalizer("running_mean", momentum=0.8)
    n.scale("math", 3.0)
    n.scale("math", 1.0)
    m = DomainLossNormalizer("running_mean", momentum=0.8)
    m.load_state(n.state())
    assert m.scale("math", 2.0) == n.scale("math", 2.0)
    with pytest.raises(ValueError, match="nan"):
        n.scale("math", float("nan"))


def test_shares():
    assert DomainLossNormalizer.shares({"a": 3.0, "b": 1.0}) == pytest.approx({"a": 0.75, "b": 0.25})
    assert DomainLossNormalizer.shares({"a": 0.0, "b": 0.0}) == {"a": 0.5, "b": 0.5}


def test_lopsided_names_the_drifting_domain():
    assert lopsided({"math": 0.8, "code": 0.1, "general": 0.1}) == ["math"]       # takes over
    assert lopsided({"math": 0.9, "code": 0.85, "general": 0.2}) == ["general"]   # falls behind
    assert lopsided({"math": 0.9, "code": 0.1}) == ["code"]                      # median 0.5
    assert lopsided({"math": 0.4, "code": 0.3, "general": 0.3}) == []
    assert lopsided({"math": 0.0, "code": 0.0, "general": 0.5}) == []            # median 0: nothing yet
    assert lopsided({"math": 1.0}) == []
    assert lopsided({"math": 0.5, "code": 0.2}, factor=2.0) == []
