"""Naive PyTorch reference: materializes every [N, V] intermediate, autograd does the rest.

Used by the tests and the benchmark as ground truth (run it in fp64 for that) and as the
baseline whose memory the other implementations avoid. It computes in the input dtype,
like a plain PyTorch training loop would, and deliberately shares no maths with the
streaming implementations (those use kernels/maths.py `bucket_terms`).
"""

from __future__ import annotations

import math

import torch

from .maths import REVERSE_KL, TAIL_LOGMASS_FLOOR, DistillOptions, TopKTeacher


def _kl_terms(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """sum of p (log p - log q) over p > 0, per row. The logs are zeroed where p = 0 before the
    product too: 0 * (-inf) in the branch torch.where drops still sends NaN into the gradient."""
    p = log_p.exp()
    live = p > 0
    zero = torch.zeros_like(p)
    return torch.where(live, p * (torch.where(live, log_p, zero) - torch.where(live, log_q, zero)), zero).sum(-1)


def divergence(log_student: torch.Tensor, log_teacher: torch.Tensor, beta: float) -> torch.Tensor:
    """TRL's generalized JSD over the last dim (log-probabilities), one value per row."""
    if beta == 0.0:   # forward_kl: KL(teacher || student)
        return _kl_terms(log_teacher, log_student)
    if beta == 1.0:   # reverse_kl: KL(student || teacher)
        return _kl_terms(log_student, log_teacher)
    # log M = log(beta T + (1 - beta) S); where both are 0, logsumexp's gradient would be NaN.
    dead = torch.isneginf(log_teacher) & torch.isneginf(log_student)
    zero = torch.zeros_like(log_teacher)
    log_m = torch.logsumexp(torch.stack([torch.where(dead, zero, log_teacher) + math.log(beta),
                                         torch.where(dead, zero, log_student) + math.log(1 - beta)]), dim=0)
    log_m = torch.where(dead, torch.full_like(log_m, float("-inf")), log_m)
    return beta * _kl_terms(log_teacher, log_m) + (1 - beta) * _kl_terms(log_student, log_m)


def log_probs(student_logits: torch.Tensor, teacher, opts: DistillOptions):
    """(log S, log T) over the buckets: all real columns, or {top-k ids, tail}."""
    s = student_logits[:, : opts.vocab_size] / opts.temperature
    log_s = torch.log_softmax(s, dim=-1)
    if not isinstance(teacher, TopKTeacher):
        t = teacher[:, : opts.vocab_size].to(s.dtype) / opts.temperature
        return log_s, torch.log_softmax(t, dim=-1)
    # Student tail: log-sum-exp over the columns that are not among the teacher's ids. Where
    # those are all -inf (banned), it is -inf; logsumexp's gradient there would be
    # exp(-inf - (-inf)) = NaN, so such rows take it over zeros and put the -inf back.
    rest = s.scatter(1, teacher.ids, float("-inf"))
    empty = torch.isneginf(rest).all(-1)                                           # [N]
    lse_rest = torch.logsumexp(torch.where(empty[:, None], torch.zeros_like(rest), rest), dim=-1)
    tail = torch.where(empty, float("-inf"), lse_rest) - torch.logsumexp(s, dim=-1)
    log_s_b = torch.cat([log_s.gather(1, teacher.ids), tail[:, None]], dim=1)
    # Reverse KL reads a teacher tail of -inf as 2^-24 (kernels/maths.py reverse_kl_teacher_tail).
    t_tail = teacher.tail_logmass
    if opts.divergence == REVERSE_KL:
        t_tail = torch.where(torch.isneginf(t_tail), TAIL_LOGMASS_FLOOR, t_tail)
    log_t_b = torch.cat([teacher.logprobs, t_tail[:, None]], dim=1).to(s.dtype)
    return log_s_b, log_t_b


def distill_rows(student_logits, teacher, mask, opts: DistillOptions) -> torch.Tensor:
    if mask is None:
        return divergence(*log_probs(student_logits, teacher, opts), opts.beta)
    # Masked rows never reach the divergence. Zeroing their loss after it is not enough: a
    # masked row whose divergence is inf sends 0 * inf = NaN back into its gradient. Only the
    # kept rows are computed; the others get loss 0 and, through the indexing, gradient 0.
    keep = mask.nonzero().squeeze(1)                                              # [n_kept]
    kept = TopKTeacher(*(part[keep] for part in teacher)) if isinstance(teacher, TopKTeacher) else teacher[keep]
    rows = divergence(*log_probs(student_logits[keep], kept, opts), opts.beta)   # [n_kept]
    return rows.new_zeros(mask.shape[0]).index_copy(0, keep, rows)


def fused_linear_rows(hidden, weight, teacher, mask, opts: DistillOptions) -> torch.Tensor:
    return distill_rows(hidden @ weight.T, teacher, mask, opts)


def student_topk_teacher(student_logits: torch.Tensor, teacher_logits: torch.Tensor, k: int,
                         temperature: float = 1.0) -> TopKTeacher:
    """A teacher's answer over the student's own support (mode student_topk), naively from
    both sides' full logits [N, V]: the student's k most likely ids under its raw logits (what
    its rollout engine returns), the teacher's log-probabilities there at `temperature`, and
    the log of the teacher's mass on every other id (-inf when k == V). The divergence over
    {these ids, the tail} is then `distill_rows` with this teacher, as for the teacher's top k."""
    ids = student_logits.topk(k, dim=-1).indices
    log_t = torch.log_softmax(teacher_logits / temperature, dim=-1)
    tail = torch.logsumexp(log_t.scatter(1, ids, float("-inf")), dim=-1)
    return TopKTeacher(ids, log_t.gather(1, ids), tail)
