"""The maths and types every implementation shares (kernels/loss.py is the public front).

Holds the divergence constants, `TopKTeacher`, `DistillOptions`, the per-bucket loss and
gradient coefficients (`bucket_terms`, `topk_rows`), the reverse-KL tail floor, and the
sparse top-k helpers of the fused path (`gather_linear_logits`, `scatter_linear_grad`).
Imports torch only.

Divergences follow Hugging Face TRL's `generalized_jsd_loss` so numbers compare:

    beta = 0      forward_kl  KL(teacher || student) = sum_i T_i (log T_i - log S_i)
    beta = 1      reverse_kl  KL(student || teacher) = sum_i S_i (log S_i - log T_i)
    0 < beta < 1  jsd         beta KL(T || M) + (1 - beta) KL(S || M),  M = beta T + (1 - beta) S

with S = softmax(student_logits / temperature) and T the teacher's distribution. As in TRL,
beta = 0 and beta = 1 are special cases (the JSD formula itself vanishes at both ends).

Gradient (w.r.t. the temperature-scaled student logits s_i, one row; derivation in
docs/kernels.md). Group the columns into buckets b (one column per bucket for a full
teacher; the teacher's top-k ids plus one tail bucket for a top-k teacher) and write
S_b for the student's bucket mass. Every divergence has

    dL/ds_i = A_b(i) * S_i / S_b(i) + B_b(i) * S_i

    forward_kl  A_b = -T_b                          B_b = sum_b T_b (= 1)
    reverse_kl  A_b = 0                             B_b = log S_b - log T_b - L
    jsd         A_b = 0                             B_b = (1-beta)(log S_b - log M_b) - c,
                                                    c   = (1-beta) KL(S || M)

so a kernel needs per row only (log-sum-exp of the student, of its tail, L, c) to write the
gradient in one streaming pass. The raw-logit gradient is dL/ds / temperature.

Reverse KL reads a top-k teacher's tail log-mass of -inf as TAIL_LOGMASS_FLOOR = log 2^-24
where the student's tail has mass (otherwise L = +inf and B_tail = inf - inf = NaN); see
`reverse_kl_teacher_tail`. Every implementation does the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

FORWARD_KL, REVERSE_KL, JSD = 0, 1, 2
DIVERGENCE_NAMES = {FORWARD_KL: "forward_kl", REVERSE_KL: "reverse_kl", JSD: "jsd"}

# What reverse KL reads a top-k teacher's tail log-mass of -inf as: fp32's resolution below 1,
# 2^-24 (teachers/backend.py `tail_logmass_from_topk` reports a tail its fp32 sum cannot
# resolve as this value too, from its own copy of the constant; tests/teachers/test_backend.py
# checks that the two agree). See reverse_kl_teacher_tail.
TAIL_LOGMASS_FLOOR = math.log(2.0 ** -24)   # -16.64 nats


class TopKTeacher(NamedTuple):
    """A teacher answer as the server sends it (teachers/protocol.py `TopK`).

    ids [N, k] int (distinct within a row; in [0, vocab_size), others raise ValueError),
    logprobs [N, k] fp32 (already at the serving temperature), tail_logmass [N] fp32 =
    log(1 - sum_j exp(logprobs_j)), may be -inf.
    """

    ids: torch.Tensor
    logprobs: torch.Tensor
    tail_logmass: torch.Tensor


@dataclass(frozen=True)
class DistillOptions:
    """The non-tensor parameters, travelling together through every layer."""

    beta: float = 0.0
    temperature: float = 1.0
    vocab_size: int = 0          # columns >= vocab_size are -inf on both sides

    @property
    def divergence(self) -> int:
        return FORWARD_KL if self.beta == 0.0 else REVERSE_KL if self.beta == 1.0 else JSD


def divergence_name(beta: float) -> str:
    return DIVERGENCE_NAMES[DistillOptions(beta=beta).divergence]


# ---- per-bucket loss and gradient coefficients (torch, small tensors) -------------------

def log_mixture(log_student: torch.Tensor, log_teacher: torch.Tensor, beta: float) -> torch.Tensor:
    """log M = log(beta T + (1 - beta) S), stably (logaddexp of the weighted logs)."""
    return torch.logaddexp(log_teacher + math.log(beta), log_student + math.log1p(-beta))


def bucket_terms(log_student: torch.Tensor, log_teacher: torch.Tensor, beta: float):
    """Loss and gradient coefficients over buckets [R, B] (log-probabilities, fp32).

    Returns (loss [R], A [R, B], B [R, B]) with dL/ds_i = A_b S_i / S_b + B_b S_i.
    Zero-probability buckets contribute 0 (never 0 * inf = nan).
    """
    S, T = log_student.exp(), log_teacher.exp()
    div = DistillOptions(beta=beta).divergence
    zero = torch.zeros_like(S)
    if div == FORWARD_KL:
        loss = torch.where(T > 0, T * (log_teacher - log_student), zero).sum(-1)
        return loss, -T, T.sum(-1, keepdim=True).expand_as(T)
    if div == REVERSE_KL:
        loss = torch.where(S > 0, S * (log_student - log_teacher), zero).sum(-1)
        coef_b = torch.where(S > 0, log_student - log_teacher - loss[:, None], zero)
        return loss, zero, coef_b
    log_m = log_mixture(log_student, log_teacher, beta)
    student_part = torch.where(S > 0, (1 - beta) * S * (log_student - log_m), zero)
    teacher_part = torch.where(T > 0, beta * T * (log_teacher - log_m), zero)
    loss = (student_part + teacher_part).sum(-1)
    c = student_part.sum(-1, keepdim=True)
    coef_b = torch.where(S > 0, (1 - beta) * (log_student - log_m) - c, zero)
    return loss, zero, coef_b


def reverse_kl_teacher_tail(tail_logmass: torch.Tensor, beta: float) -> torch.Tensor:
    """The teacher's tail log-mass [R] as the tail bucket reads it: -inf -> TAIL_LOGMASS_FLOOR
    under reverse KL (beta = 1); unchanged otherwise.

    Reverse KL's tail term S_tail (log S_tail - log T_tail) is +inf for T_tail = 0 and
    S_tail > 0, and its gradient coefficient log S_tail - log T_tail - L is inf - inf = NaN.
    A -inf tail is almost always fp32 rounding: the top-k probabilities summed to 1 (a peaked
    teacher's top log-prob comes back as 0), which hides a tail of up to about 2^-24. Reading
    it as 2^-24, the largest tail that rounding hides, gives the smallest reverse KL
    consistent with what the teacher sent (large, finite, finite gradient), in keeping with
    the top-k divergence being a lower bound of the full one. Where the teacher's tail is
    truly empty (its k span its vocabulary but not the student's), reverse KL is truly
    infinite and this reports S_tail (log S_tail + 16.64) instead.
    Nothing else changes: finite tails (even below the floor), rows where the student has no
    tail either (the term is 0 at S_tail = 0 whatever T_tail is), forward KL and JSD (finite
    with T_tail = 0: M >= (1 - beta) S).
    """
    if DistillOptions(beta=beta).divergence != REVERSE_KL:
        return tail_logmass
    return torch.where(torch.isneginf(tail_logmass), torch.full_like(tail_logmass, TAIL_LOGMASS_FLOOR),
                       tail_logmass)


def topk_rows(student_at_ids: torch.Tensor, lse: torch.Tensor, lse_tail: torch.Tensor,
              teacher: TopKTeacher, beta: float):
    """Top-k teacher: divergence over the partition {k ids, one tail bucket}, per row.

    student_at_ids [R, k]: scaled student logits at the teacher's ids; lse / lse_tail [R]:
    log-sum-exp of the scaled student logits over all columns / over the columns outside
    the ids. Returns (loss [R], coef_topk [R, k] = dL/ds at the ids, A_tail [R], B_tail [R]).
    The teacher's tail goes through `reverse_kl_teacher_tail` (-inf read as 2^-24 under
    reverse KL). Shared by the chunked and Triton paths.
    """
    log_s = torch.cat([student_at_ids - lse[:, None], (lse_tail - lse)[:, None]], dim=1)
    tail_t = reverse_kl_teacher_tail(teacher.tail_logmass.float(), beta)                   # [R]
    log_t = torch.cat([teacher.logprobs.float(), tail_t[:, None]], dim=1)
    loss, a, b = bucket_terms(log_s, log_t, beta)
    # top-k buckets hold one column each: S_i / S_b = 1.
    coef_topk = a[:, :-1] + b[:, :-1] * log_s[:, :-1].exp()
    return loss, coef_topk, a[:, -1], b[:, -1]


def safe_lse(lse: torch.Tensor) -> torch.Tensor:
    """An lse usable as a shift: -inf (empty bucket) becomes 0 so exp(-inf - 0) = 0."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


# ---- the fused path's sparse top-k part -------------------------------------------------

def gather_linear_logits(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor,
                         rows_per_chunk: int = 16) -> torch.Tensor:
    """hidden[n] . weight[ids[n, j]] as [N, k] fp32, never building more than a chunk of W[ids]."""
    out = torch.empty(ids.shape, dtype=torch.float32, device=hidden.device)
    for r0 in range(0, ids.shape[0], rows_per_chunk):
        r1 = min(r0 + rows_per_chunk, ids.shape[0])
        w_rows = weight[ids[r0:r1]].float()                          # [R, k, H]
        out[r0:r1] = torch.einsum("rkh,rh->rk", w_rows, hidden[r0:r1].float())
    return out


def scatter_linear_grad(coef: torch.Tensor, ids: torch.Tensor, hidden: torch.Tensor,
                        weight: torch.Tensor, grad_hidden: torch.Tensor, grad_weight: torch.Tensor,
                        rows_per_chunk: int = 16) -> None:
    """Adds the sparse top-k part of a fused gradient: dlogits[n, ids[n, j]] = coef[n, j].

    grad_hidden[n] += sum_j coef[n, j] W[ids[n, j]];  grad_weight[ids[n, j]] += coef[n, j] h[n].
    """
    for r0 in range(0, ids.shape[0], rows_per_chunk):
        r1 = min(r0 + rows_per_chunk, ids.shape[0])
        c = coef[r0:r1]                                             # [R, k]
        grad_hidden[r0:r1] += torch.einsum("rk,rkh->rh", c, weight[ids[r0:r1]].float())
        contrib = c[:, :, None] * hidden[r0:r1].float()[:, None, :]  # [R, k, H]
        grad_weight.index_add_(0, ids[r0:r1].reshape(-1),
                               contrib.reshape(-1, hidden.shape[1]).to(grad_weight.dtype))
