"""Distillation losses that never materialize [tokens x vocabulary] intermediates.

    distill_loss(student_logits, teacher, beta=..., ...)         logits [N, V] vs a teacher
    fused_linear_distill_loss(hidden, lm_head_weight, teacher)   logits built block by block
    sampled_token_reverse_kl(student_lp, teacher_lp, mask)       per-token advantage estimate

`teacher` is full logits [N, V] or a `TopKTeacher` (what the teacher server sends).
Implementations (`impl=`): "triton" (CUDA, or the Triton interpreter), "torch" (chunked,
the CPU path), "reference" (naive PyTorch, kernels/reference.py, for tests and benchmarks).
Importing this package needs only torch; Triton is imported when first used.
"""

from .loss import (
    DistillOptions,
    TopKTeacher,
    distill_loss,
    fused_linear_distill_loss,
    sampled_token_reverse_kl,
)

__all__ = [
    "DistillOptions",
    "TopKTeacher",
    "distill_loss",
    "fused_linear_distill_loss",
    "sampled_token_reverse_kl",
]
