"""The divergences of a cross-tokenizer teacher (`tokenizer: cross`), in plain PyTorch.

A teacher with another vocabulary answers top-k over its own ids. At a student row whose
context the teacher shares (teachers/align.py: the first row of an aligned span), the two
next-token distributions are compared in two parts, and every row takes a third:

    shared_divergence   the exact part: over the partition {the student ids the teacher's top-k
                        ids map to (teachers/align.py VocabMap), one bucket for all else}, as
                        top-k distillation's {top k, tail} is exact: teacher mass on unmapped
                        ids and its tail join the bucket, never renormalized; teacher ids that
                        map to one student id add up. Forward
                        KL at beta 0, reverse at 1, the generalized JSD between
                        (kernels/reference.py `divergence`).
    sorted_l1           the ULD term for the rest: the teacher's m unmapped top-k probabilities
                        and the student's m largest over its ids that no teacher id maps to,
                        each sorted, L1 apart (Universal Logit Distillation's Wasserstein-1
                        between sorted distributions, cut to the m places the answer knows).
    span_logratio       the sampled-token form: per aligned span, the student's log-prob of its
                        tokens less the teacher's of its own tokens for the same text; summed
                        over a response it is log S(text) - log T(text) (each side's chain rule),
                        the sampled estimate of the text-level reverse KL.

Deviation from TRL's GOLD: GOLD multiplies a span's first-row distribution by the rest of the
span's sampled-token probabilities (an unnormalized vector) and compares those; here the first
rows' normalized distributions are compared, and the rest of the span is the third term's.
Shapes: n rows, V the student's vocabulary (LM-head rows), k the teacher's answer size.
These hold [n, V] intermediates: they run on a span's first rows only (docs/teachers.md).
"""

from __future__ import annotations

import torch

from .maths import TAIL_LOGMASS_FLOOR
from .reference import divergence

NEG_INF = float("-inf")


def _masked_logsumexp(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """logsumexp over the `keep` entries of each row; -inf (with a zero gradient, not NaN) where none."""
    empty = ~keep.any(-1)
    x = torch.where(keep, x, torch.full_like(x, NEG_INF))
    lse = torch.logsumexp(torch.where(empty[:, None], torch.zeros_like(x), x), dim=-1)
    return torch.where(empty, torch.full_like(lse, NEG_INF), lse)


def shared_divergence(student_logits: torch.Tensor, mapped_ids: torch.Tensor, teacher_logprobs: torch.Tensor,
                      teacher_tail: torch.Tensor, beta: float = 0.0, temperature: float = 1.0) -> torch.Tensor:
    """[n]: the divergence over {mapped student ids, one bucket}. student_logits [n, V]; mapped_ids
    [n, k] student ids of the teacher's top k (-1: none; several teacher ids may map to one
    student id: their probabilities add up); teacher_logprobs [n, k] (at the teacher's
    temperature), teacher_tail [n] its log-mass outside its top k."""
    log_s = torch.log_softmax(student_logits.float() / temperature, dim=-1)        # [n, V]
    mapped = mapped_ids >= 0
    ids = mapped_ids.clamp_min(0)
    # Slots naming one student id: the first holds their summed teacher log-mass, the others
    # leave the partition (-inf on both sides). [n, k, k] compares, no [n, V] teacher tensor.
    same = (ids[:, :, None] == ids[:, None, :]) & mapped[:, :, None] & mapped[:, None, :]      # [n, k, k]
    first = mapped & ~torch.tril(same, diagonal=-1).any(-1)                                  # [n, k]
    t_lp = teacher_logprobs.float()
    t_sum = torch.logsumexp(torch.where(same, t_lp[:, None, :], torch.full_like(same, NEG_INF, dtype=t_lp.dtype)),
                            dim=-1)                                                           # [n, k]
    log_t = torch.where(first, t_sum, torch.full_like(t_lp, NEG_INF))
    t_rest = torch.logsumexp(torch.cat([torch.where(mapped, torch.full_like(t_lp, NEG_INF), t_lp),
                                        teacher_tail.float()[:, None]], dim=1), dim=1)
    if beta == 1.0:   # reverse KL reads an empty teacher bucket as 2^-24, as top-k distillation does
        t_rest = torch.where(torch.isneginf(t_rest), torch.full_like(t_rest, TAIL_LOGMASS_FLOOR), t_rest)
    hit = torch.zeros_like(log_s).scatter_add_(1, ids, mapped.to(log_s.dtype)) > 0   # [n, V] the mapped columns
    s_rest = _masked_logsumexp(log_s, ~hit)
    s_at = torch.where(first, log_s.gather(1, ids), torch.full_like(t_lp, NEG_INF))
    return divergence(torch.cat([s_at, s_rest[:, None]], 1), torch.cat([log_t, t_rest[:, None]], 1), beta)


def sorted_l1(student_logits: torch.Tensor, student_unshared: torch.Tensor, teacher_logprobs: torch.Tensor,
              teacher_unmapped: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """[n]: sum_j<m |p_student_(j) - p_teacher_(j)|, each side's probabilities of the ids the
    other vocabulary lacks sorted, over the m places the teacher's answer knows: its m unmapped
    top-k entries are its m largest unmapped probabilities (anything outside its top k is
    smaller). student_unshared [V] bool; teacher_unmapped [n, k] bool: which of the teacher's
    top-k entries map to no student id (m = their count per row)."""
    k = teacher_logprobs.shape[1]
    p_s = torch.softmax(student_logits.float() / temperature, dim=-1)[:, student_unshared]   # [n, V_u]
    top_s = p_s.topk(min(k, p_s.shape[1]), dim=-1).values if p_s.shape[1] else p_s
    top_s = torch.nn.functional.pad(top_s, (0, k - top_s.shape[1]))
    p_t = torch.where(teacher_unmapped, teacher_logprobs.float().exp(), torch.zeros_like(teacher_logprobs.float()))
    top_t = p_t.sort(dim=-1, descending=True).values
    known = torch.arange(k, device=p_t.device)[None, :] < teacher_unmapped.sum(-1, keepdim=True)   # [n, k]
    return torch.where(known, (top_s - top_t).abs(), torch.zeros_like(top_t)).sum(-1)


def span_logratio(student_lp: torch.Tensor, span_of: torch.Tensor, teacher_span_lp: torch.Tensor) -> torch.Tensor:
    """[S]: per span, sum of the student's token log-probs [N] over its rows (span_of [N] in
    0..S-1) less the teacher's log-prob of the span (teacher_span_lp [S])."""
    s = torch.zeros_like(teacher_span_lp, dtype=student_lp.dtype).index_add(0, span_of, student_lp)
    return s - teacher_span_lp.to(student_lp.dtype)
