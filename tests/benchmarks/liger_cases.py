"""The kernels benchmark's Liger steps next to our reference, run under Triton's interpreter
in their own process (see test_kernels_bench.py): Liger is Triton only, and TRITON_INTERPRET
must be set before triton is imported. Prints one JSON line per (fused, beta)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import json  # noqa: E402

import torch  # noqa: E402

from opd.benchmarks.kernels import _inputs, _step_fn  # noqa: E402
from opd.kernels import distill_loss, fused_linear_distill_loss  # noqa: E402


def case(fused: bool, beta: float) -> dict:
    """The student's gradient from the bench's Liger step and from our reference loss on the
    same inputs (for the fused case, the teacher's logits are its hidden states times its head)."""
    spec = dict(case="liger-check", fused=fused, teacher="full", beta=beta, N=8, V=64, H=16 if fused else 0,
                provider="liger", dtype="float32", device="cpu")
    inputs = _inputs(spec, torch, "cpu")
    step, leaves = _step_fn(spec, inputs, torch)
    step()
    if fused:
        x = inputs["hidden"].detach().clone().requires_grad_(True)
        teacher = inputs["teacher_hidden"] @ inputs["teacher_weight"].T
        fused_linear_distill_loss(x, inputs["weight"].detach(), teacher, beta=beta, impl="reference").backward()
    else:
        x = inputs["student"].detach().clone().requires_grad_(True)
        distill_loss(x, inputs["teacher"], beta=beta, impl="reference").backward()
    return {"fused": fused, "beta": beta, "max_abs_diff": (x.grad - leaves[0].grad).abs().max().item(),
            "scale": x.grad.abs().max().item()}


if __name__ == "__main__":
    for fused in (False, True):
        for beta in (0.0, 0.5, 1.0):
            print(json.dumps(case(fused, beta)), flush=True)
