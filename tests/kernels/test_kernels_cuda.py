"""Triton kernels compiled for a real GPU vs the fp64 reference (skipped without CUDA).

The same comparison as test_kernels_triton.py, which runs the kernels in Triton's CPU
interpreter; here they go through the real compiler, with bf16 dots and the launch
configs of triton_ops._config. CI has no GPU: run on one with
`python -m pytest tests/kernels/test_kernels_cuda.py` (scripts/gpu_check.sh does).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernels_cases import CUDA_CASES, check  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("case", CUDA_CASES, ids=lambda c: c.name())
def test_triton_on_cuda_matches_reference(case):
    row = check(case, device="cuda")
    assert row["ok"], row


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_fused_linear_matches_liger(beta):
    """Same numbers as Liger-Kernel's fused linear JSD (when installed), the GPU side-by-side
    of `opd bench kernels`: its beta is ours, both ends exact; the loss is a mean over rows."""
    liger = pytest.importorskip("liger_kernel.transformers")
    g = torch.Generator(device="cuda").manual_seed(0)
    n, h, v = 96, 128, 3000
    hidden, t_hidden = (torch.randn(n, h, device="cuda", generator=g) for _ in range(2))
    weight, t_weight = (torch.randn(v, h, device="cuda", generator=g) * h ** -0.5 for _ in range(2))
    runs = []
    for which in ("opd", "liger"):
        x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if which == "opd":
            from opd.kernels import fused_linear_distill_loss
            loss = fused_linear_distill_loss(x, w, t_hidden @ t_weight.T, beta=beta, impl="triton")
        else:
            loss = liger.LigerFusedLinearJSD(jsd_beta=beta)(x, w, t_hidden, t_weight, None)
        loss.backward()
        runs.append((loss.item(), x.grad, w.grad))
    (a, ax, aw), (b, bx, bw) = runs
    assert a == pytest.approx(b, rel=1e-4, abs=1e-6)
    for got, want in ((ax, bx), (aw, bw)):
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-3
