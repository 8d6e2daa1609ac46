"""The tail mass a top-k-only backend (vLLM) reports: exact where fp32 resolves it, never -inf
for a tail that fp32 merely cannot see."""

from __future__ import annotations

import math

import pytest
import torch

from opd.kernels import TAIL_LOGMASS_FLOOR, TopKTeacher, distill_loss
from opd.teachers.backend import TAIL_LOGMASS_FLOOR as TEACHER_TAIL_LOGMASS_FLOOR
from opd.teachers.backend import tail_logmass_from_topk


def _topk(logits: torch.Tensor, k: int):
    lp = torch.log_softmax(logits.float(), -1)   # fp32, as a serving engine computes it
    vals, ids = lp.topk(k, -1)
    exact = torch.log_softmax(logits.double(), -1)
    tail = exact.scatter(-1, ids, -math.inf).logsumexp(-1)   # float64 log-mass outside the top k
    return vals, ids, tail


def test_the_teacher_side_tail_floor_is_the_loss_one():
    # Two copies, so that the teacher side need not import the loss package: they must not drift.
    assert TEACHER_TAIL_LOGMASS_FLOOR == TAIL_LOGMASS_FLOOR == math.log(2.0 ** -24)


def test_a_resolved_tail_is_exact():
    vals, _, exact = _topk(torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 2, k=8)
    got = tail_logmass_from_topk(vals, vocab_size=50)
    torch.testing.assert_close(got.double(), exact, rtol=0, atol=1e-5)


def test_a_tail_below_fp32_resolution_is_its_upper_bound_and_reverse_kl_stays_finite():
    # A peaked teacher (top logit 30 nats above the rest): the true tail is 99 e^-30 ~ 9e-12,
    # fp32's log-softmax gives the top token log-prob 0 and the old formula log(0) = -inf.
    logits = torch.zeros(2, 100)
    logits[:, 0] = 30.0
    vals, ids, exact = _topk(logits, k=1)
    assert vals[0, 0].item() == 0.0 and exact[0].item() < TAIL_LOGMASS_FLOOR
    tail = tail_logmass_from_topk(vals, vocab_size=100)
    assert tail.tolist() == [pytest.approx(math.log(2.0 ** -24), abs=1e-6)] * 2
    # The student spreads mass outside the teacher's top token: reverse KL is large but finite
    # (it was inf, with a NaN gradient that AdamW wrote into every weight).
    student = torch.zeros(2, 100, requires_grad=True)
    loss = distill_loss(student, TopKTeacher(ids, vals, tail), beta=1.0, impl="torch")
    loss.backward()
    assert math.isfinite(loss.item()) and loss.item() > 4.0 and torch.isfinite(student.grad).all()


def test_a_top_k_spanning_the_vocabulary_has_no_tail():
    vals, _, _ = _topk(torch.randn(3, 16), k=16)
    assert torch.isneginf(tail_logmass_from_topk(vals, vocab_size=16)).all()
