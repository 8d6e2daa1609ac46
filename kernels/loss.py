"""The public distillation losses: argument checks, then dispatch to an implementation.

    distill_loss(student_logits, teacher, ...)             logits [N, V] vs a teacher
    fused_linear_distill_loss(hidden, lm_head_weight, ...)  logits built block by block
    sampled_token_reverse_kl(student_lp, teacher_lp, mask)  per-token advantage estimate

The maths every implementation shares, and the types (`TopKTeacher`, `DistillOptions`), are
in kernels/maths.py. An implementation is a module that provides the two functions of
`Backend`: kernels/chunked.py ("torch"), kernels/triton_ops.py ("triton"),
kernels/reference.py ("reference").
"""

from __future__ import annotations

from typing import Protocol, Union

import torch

from . import chunked, reference
from .maths import DistillOptions, TopKTeacher

IMPLS = ("auto", "triton", "torch", "reference")

Teacher = Union[torch.Tensor, TopKTeacher]   # full logits [N, V], or a top-k answer


class Backend(Protocol):
    """What an implementation module provides. Arguments arrive checked: `teacher` is detached
    (top-k: ids int64, logprobs and tail fp32, ids in [0, vocab_size)), `mask` is None or
    bool [N] on the input's device. Each returns the per-row loss [N] (fp32; the reference's
    in the input dtype), 0 on masked rows, differentiable w.r.t. student_logits or
    (hidden, weight)."""

    def distill_rows(self, student_logits: torch.Tensor, teacher: Teacher, mask: torch.Tensor | None,
                     opts: DistillOptions, /) -> torch.Tensor: ...

    def fused_linear_rows(self, hidden: torch.Tensor, weight: torch.Tensor, teacher: Teacher,
                          mask: torch.Tensor | None, opts: DistillOptions, /) -> torch.Tensor: ...


def _backend(impl: str, device: torch.device) -> Backend:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        impl = "triton" if device.type == "cuda" else "torch"
    if impl == "triton":
        # Lazy: triton is optional and heavy to import; the package imports without it.
        from . import triton_ops
        return triton_ops
    return chunked if impl == "torch" else reference


def _options(beta, temperature, vocab_size, n_cols) -> DistillOptions:
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    vocab_size = n_cols if vocab_size is None else int(vocab_size)
    if not 0 < vocab_size <= n_cols:
        raise ValueError(f"vocab_size must be in [1, {n_cols}], got {vocab_size}")
    return DistillOptions(beta=float(beta), temperature=float(temperature), vocab_size=vocab_size)


def _reduce(rows: torch.Tensor, mask: torch.Tensor | None, temperature: float,
            scale_by_t2: bool, reduction: str) -> torch.Tensor:
    if scale_by_t2:
        rows = rows * (temperature ** 2)
    if reduction == "none":
        return rows
    if reduction == "sum":
        return rows.sum()
    if reduction == "mean":
        # Over zero rows (none at all, or all masked) the mean is 0 with a zero gradient, not 0/0.
        count = mask.sum() if mask is not None else rows.new_tensor(rows.shape[0])
        return rows.sum() / count.clamp(min=1).to(rows.dtype)
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


def _check_teacher(teacher, n_rows: int, n_cols: int, vocab_size: int):
    """Shapes, and top-k ids in [0, vocab_size): every implementation is dispatched after this.

    An id in the padding columns would read the raw padding logit as a probability (bucket
    masses no longer sum to 1, the "KL" can go negative); one past the logits or negative
    indexes out of bounds (a device assert on CUDA). One min/max, one host sync.
    """
    if isinstance(teacher, TopKTeacher):
        if teacher.ids.shape[0] != n_rows or teacher.ids.shape != teacher.logprobs.shape:
            raise ValueError(f"top-k teacher ids {tuple(teacher.ids.shape)} / logprobs "
                             f"{tuple(teacher.logprobs.shape)} do not match {n_rows} rows")
        if teacher.ids.numel():
            lo, hi = torch.stack(torch.aminmax(teacher.ids.long())).tolist()
            if lo < 0 or hi >= vocab_size:
                raise ValueError(f"top-k teacher ids must be in [0, {vocab_size}) (the vocabulary), "
                                 f"got ids from {lo} to {hi}")
        return TopKTeacher(teacher.ids.long(), teacher.logprobs.detach().float(),
                           teacher.tail_logmass.detach().float())
    if teacher.shape != (n_rows, n_cols):
        raise ValueError(f"teacher logits {tuple(teacher.shape)} must be [{n_rows}, {n_cols}]")
    return teacher.detach()


def distill_loss(student_logits: torch.Tensor, teacher, *, beta: float = 0.0,
                 temperature: float = 1.0, scale_by_t2: bool = False,
                 mask: torch.Tensor | None = None, reduction: str = "mean",
                 vocab_size: int | None = None, impl: str = "auto") -> torch.Tensor:
    """Distillation divergence between student logits [N, V] and a teacher, differentiable.

    teacher: full-vocabulary logits [N, V] (any float dtype), or a `TopKTeacher`.
      - Full teacher: both sides' logits are divided by `temperature`.
      - Top-k teacher: its log-probabilities are already at the serving temperature (the
        server applies it), so `temperature` divides the student's logits only. The
        divergence is exact over the partition {teacher's k ids, one tail bucket}; the
        student's tail mass is 1 - sum of its probabilities at those ids (computed as a
        log-sum-exp over the other columns, never by subtraction). By the chain rule of KL
        (data processing) this is a lower bound of the full-vocabulary divergence, equal to
        it only when the two tails have the same shape. Nothing is renormalized over the k.
        Reverse KL reads a teacher tail of -inf as 2^-24 (TAIL_LOGMASS_FLOOR) where the
        student's tail has mass: large but finite, never +inf with a NaN gradient.
    beta: 0 forward KL(teacher||student), 1 reverse KL(student||teacher), between: TRL's
      generalized JSD. scale_by_t2 multiplies the loss by temperature**2.
    mask [N] bool: rows with False give neither loss nor gradient; "mean" averages over the
      True rows (0, with a zero gradient, over no rows at all). reduction: "mean" | "sum" | "none" (per row [N], fp32).
    vocab_size: columns >= vocab_size (LM-head padding) are -inf on both sides.
    impl: "auto" (triton on CUDA, torch otherwise) | "triton" | "torch" | "reference".
    Memory: beyond the inputs, the gradient [N, V] plus O(N + chunk) state.
    """
    n_rows, n_cols = student_logits.shape
    opts = _options(beta, temperature, vocab_size, n_cols)
    teacher = _check_teacher(teacher, n_rows, n_cols, opts.vocab_size)
    mask = None if mask is None else mask.to(device=student_logits.device, dtype=torch.bool)
    rows = _backend(impl, student_logits.device).distill_rows(student_logits, teacher, mask, opts)
    return _reduce(rows, mask, opts.temperature, scale_by_t2, reduction)


def fused_linear_distill_loss(hidden: torch.Tensor, lm_head_weight: torch.Tensor, teacher, *,
                              beta: float = 0.0, temperature: float = 1.0,
                              scale_by_t2: bool = False, mask: torch.Tensor | None = None,
                              reduction: str = "mean", vocab_size: int | None = None,
                              impl: str = "auto") -> torch.Tensor:
    """`distill_loss(hidden @ lm_head_weight.T, teacher, ...)` without the [N, V] logits.

    hidden [N, H], lm_head_weight [V, H] (no bias: LM heads have none). Student logits are
    computed block by block and never written to memory; gradients flow to both hidden and
    weight. Memory beyond the inputs: the weight gradient ([V, H]: an fp32 accumulator in the
    chunked PyTorch path, W's dtype in Triton), the hidden gradient, and O(N * chunk) state. Same options and semantics as `distill_loss`.
    """
    n_rows = hidden.shape[0]
    n_cols = lm_head_weight.shape[0]
    if hidden.shape[1] != lm_head_weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and weight {tuple(lm_head_weight.shape)} disagree on H")
    opts = _options(beta, temperature, vocab_size, n_cols)
    teacher = _check_teacher(teacher, n_rows, n_cols, opts.vocab_size)
    mask = None if mask is None else mask.to(device=hidden.device, dtype=torch.bool)
    rows = _backend(impl, hidden.device).fused_linear_rows(hidden, lm_head_weight, teacher, mask, opts)
    return _reduce(rows, mask, opts.temperature, scale_by_t2, reduction)


def sampled_token_reverse_kl(student_token_logprobs: torch.Tensor,
                             teacher_token_logprobs: torch.Tensor,
                             mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token reverse-KL estimate at the sampled tokens: log p_student(x) - log p_teacher(x).

    With x drawn from the student this is an unbiased single-sample estimate of
    KL(student || teacher) per position; on-policy distillation uses its negative as the
    advantage. Shapes [B, T] (or any shape); masked positions are 0. Not differentiated:
    the estimate is a reward signal, so both inputs are detached.
    """
    est = student_token_logprobs.detach().float() - teacher_token_logprobs.detach().float()
    if mask is None:
        return est
    return torch.where(mask.to(torch.bool), est, torch.zeros_like(est))
