"""Distillation losses that never materialize [tokens x vocabulary] intermediates.

    distill_loss(student_logits, teacher, beta=..., ...)         logits [N, V] vs a teacher
    fused_linear_distill_loss(hidden, lm_head_weight, teacher)   logits built block by block
    sampled_token_reverse_kl(student_lp, teacher_lp, mask)       per-token advantage estimate

`teacher` is full logits [N, V] or a `TopKTeacher` (what the teacher server sends).
Implementations (`impl=`): "triton" (CUDA, or the Triton interpreter), "torch" (chunked,
the CPU path), "reference" (naive PyTorch, kernels/reference.py, for tests and benchmarks).
Modules: loss.py (the public functions, dispatch), maths.py (shared maths and types),
autograd.py, chunked.py, triton_ops.py + triton_kernels.py, reference.py; docs/kernels.md.
Importing this package needs only torch; Triton is imported when first used.
"""

from .loss import distill_loss, fused_linear_distill_loss, sampled_token_reverse_kl
from .maths import TAIL_LOGMASS_FLOOR, DistillOptions, TopKTeacher, divergence_name

__all__ = [
    "DistillOptions",
    "TAIL_LOGMASS_FLOOR",
    "TopKTeacher",
    "distill_loss",
    "divergence_name",
    "fused_linear_distill_loss",
    "sampled_token_reverse_kl",
]
