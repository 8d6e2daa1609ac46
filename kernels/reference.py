"""Naive PyTorch reference: materializes every [N, V] intermediate, autograd does the rest.

Used by the tests and the benchmark as ground truth (run it in fp64 for that) and as the
baseline whose memory the other implementations avoid. It computes in the input dtype,
like a plain PyTorch training loop would, and deliberately shares no maths with the
streaming implementations (those use kernels/loss.py `bucket_terms`).
"""

from __future__ import annotations

import math

import torch

from .loss import DistillOptions, TopKTeacher


def divergence(log_student: torch.Tensor, log_teacher: torch.Tensor, beta: float) -> torch.Tensor:
    """TRL's generalized JSD over the last dim (log-probabilities), one value per row."""
    S, T = log_student.exp(), log_teacher.exp()
    zero = torch.zeros_like(S)
    if beta == 0.0:   # forward_kl: KL(teacher || student)
        return torch.where(T > 0, T * (log_teacher - log_student), zero).sum(-1)
    if beta == 1.0:   # reverse_kl: KL(student || teacher)
        return torch.where(S > 0, S * (log_student - log_teacher), zero).sum(-1)
    log_m = torch.logsumexp(torch.stack([log_teacher + math.log(beta),
                                         log_student + math.log(1 - beta)]), dim=0)
    kl_teacher = torch.where(T > 0, T * (log_teacher - log_m), zero).sum(-1)
    kl_student = torch.where(S > 0, S * (log_student - log_m), zero).sum(-1)
    return beta * kl_teacher + (1 - beta) * kl_student


def log_probs(student_logits: torch.Tensor, teacher, opts: DistillOptions):
    """(log S, log T) over the buckets: all real columns, or {top-k ids, tail}."""
    s = student_logits[:, : opts.vocab_size] / opts.temperature
    log_s = torch.log_softmax(s, dim=-1)
    if not isinstance(teacher, TopKTeacher):
        t = teacher[:, : opts.vocab_size].to(s.dtype) / opts.temperature
        return log_s, torch.log_softmax(t, dim=-1)
    # Student tail: log-sum-exp over the columns that are not among the teacher's ids.
    tail = torch.logsumexp(s.scatter(1, teacher.ids, float("-inf")), dim=-1) - torch.logsumexp(s, dim=-1)
    log_s_b = torch.cat([log_s.gather(1, teacher.ids), tail[:, None]], dim=1)
    log_t_b = torch.cat([teacher.logprobs, teacher.tail_logmass[:, None]], dim=1).to(s.dtype)
    return log_s_b, log_t_b


def distill_rows(student_logits, teacher, mask, opts: DistillOptions) -> torch.Tensor:
    log_s, log_t = log_probs(student_logits, teacher, opts)
    rows = divergence(log_s, log_t, opts.beta)
    if mask is not None:
        rows = torch.where(mask, rows, torch.zeros_like(rows))
    return rows


def fused_linear_rows(hidden, weight, teacher, mask, opts: DistillOptions) -> torch.Tensor:
    return distill_rows(hidden @ weight.T, teacher, mask, opts)
