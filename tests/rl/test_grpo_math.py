"""GRPO maths against hand-computed values."""

import math

import pytest
import torch

from opd.rl.grpo import aggregate, clipped_surrogate, equal_groups, group_advantages, kl_to_reference
from opd.spine.terms import entropy


def test_grpo_advantage_hand_computed():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    # mean 0.5, unbiased std = sqrt(4 * 0.25 / 3) = 0.57735
    adv = group_advantages(r, "grpo", eps=0.0)
    assert torch.allclose(adv, torch.tensor([[0.8660254, -0.8660254, -0.8660254, 0.8660254]]), atol=1e-6)


def test_dr_grpo_and_rloo_and_batch_std():
    r = torch.tensor([[1.0, 0.0, 0.0], [2.0, 2.0, 5.0]])
    dr = group_advantages(r, "dr_grpo")
    assert torch.allclose(dr, torch.tensor([[2 / 3, -1 / 3, -1 / 3], [-1.0, -1.0, 2.0]]), atol=1e-6)
    rloo = group_advantages(r, "rloo")
    # r_i - mean of the others: 1 - 0 = 1; 0 - 0.5 = -0.5; 2 - 3.5 = -1.5; 5 - 2 = 3
    assert torch.allclose(rloo, torch.tensor([[1.0, -0.5, -0.5], [-1.5, -1.5, 3.0]]), atol=1e-6)
    bs = group_advantages(r, "batch_std", eps=0.0)
    std = r.std()
    assert torch.allclose(bs, dr / std, atol=1e-6)


@pytest.mark.parametrize("est", ["grpo", "dr_grpo", "batch_std", "rloo"])
def test_all_equal_group_is_zero_not_nan(est):
    r = torch.tensor([[0.1, 0.1, 0.1], [1.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    adv = group_advantages(r, est)
    assert torch.isfinite(adv).all()
    assert (adv[:2] == 0).all()
    assert (adv[2] != 0).all()
    assert equal_groups(r).tolist() == [True, True, False]
    assert (group_advantages(torch.ones(2, 1), est) == 0).all()   # G = 1


def test_clipped_surrogate_hand_computed():
    old = torch.zeros(1, 4)
    new = torch.log(torch.tensor([[1.5, 0.5, 1.1, 0.9]]))
    # positive advantage: ratio clipped at 1+eps_high only when it rises above
    loss, clipped = clipped_surrogate(new, old, torch.tensor([2.0]), eps_low=0.2, eps_high=0.28)
    assert torch.allclose(loss, -torch.tensor([[1.28 * 2, 0.5 * 2, 1.1 * 2, 0.9 * 2]]), atol=1e-6)
    assert clipped.tolist() == [[True, False, False, False]]
    # negative advantage: clipped at 1-eps_low when the ratio falls below
    loss, clipped = clipped_surrogate(new, old, torch.tensor([-1.0]), eps_low=0.2, eps_high=0.28)
    assert torch.allclose(loss, torch.tensor([[1.5, 0.8, 1.1, 0.9]]), atol=1e-6)
    assert clipped.tolist() == [[False, True, False, False]]


def test_clipped_surrogate_gradient_is_policy_gradient_at_ratio_one():
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, _ = clipped_surrogate(lp, lp.detach(), torch.tensor([3.0]))
    loss.sum().backward()
    assert torch.allclose(lp.grad, torch.tensor([[-3.0, -3.0]]))


def test_kl_estimators_hand_computed():
    lp = torch.log(torch.tensor([[0.5, 0.2]]))
    ref = torch.log(torch.tensor([[0.25, 0.4]]))
    k1 = kl_to_reference(lp, ref, "k1")
    assert torch.allclose(k1, torch.tensor([[math.log(2.0), math.log(0.5)]]), atol=1e-6)
    k3 = kl_to_reference(lp, ref, "k3")
    # ref/pi = 0.5 and 2: 0.5 - 1 - log 0.5 ; 2 - 1 - log 2
    assert torch.allclose(k3, torch.tensor([[-0.5 + math.log(2.0), 1 - math.log(2.0)]]), atol=1e-6)
    assert (kl_to_reference(lp, lp, "k3") == 0).all()


def test_k1_k3_are_unbiased_for_the_true_kl():
    g = torch.Generator().manual_seed(0)
    pi = torch.tensor([0.6, 0.3, 0.1])
    ref = torch.tensor([0.3, 0.3, 0.4])
    true_kl = float((pi * (pi / ref).log()).sum())
    idx = torch.multinomial(pi, 200_000, replacement=True, generator=g)
    lp, rl = pi.log()[idx][None], ref.log()[idx][None]
    for est in ("k1", "k3"):
        assert abs(float(kl_to_reference(lp, rl, est).mean()) - true_kl) < 0.01


def test_aggregation_modes():
    # rows of two sequences: 4 tokens of loss 1, one of loss 4
    loss, lengths = torch.tensor([1.0, 1.0, 1.0, 1.0, 4.0]), [4, 1]
    assert float(aggregate(loss, lengths, "token_mean")) == pytest.approx(8 / 5)
    assert float(aggregate(loss, lengths, "seq_mean")) == pytest.approx((1 + 4) / 2)
    assert float(aggregate(loss, lengths, "dr_grpo", max_tokens=8)) == pytest.approx(8 / 16)
    # micro-batches with global normalizers sum to the full-batch value
    seqs = [(loss[:4], [4]), (loss[4:], [1])]
    parts = sum(float(aggregate(x, n, "token_mean", num_sequences=2, num_tokens=5)) for x, n in seqs)
    assert parts == pytest.approx(8 / 5)
    parts = sum(float(aggregate(x, n, "seq_mean", num_sequences=2)) for x, n in seqs)
    assert parts == pytest.approx(2.5)


def test_entropy():
    logits = torch.zeros(1, 1, 4)
    assert float(entropy(logits)) == pytest.approx(math.log(4))
    assert float(entropy(torch.tensor([[[0.0, -1e4]]]))) == pytest.approx(0.0, abs=1e-6)
