"""Every Triton kernel specialization the CUDA path launches compiles for sm_90, on a CPU.

The interpreter (test_kernels_triton.py) executes the kernels' Python and never runs
Triton's code generator, so errors of the compiler's front end pass there and fail only on
a GPU: the first H200 run of this project failed on `X: tl.constexpr = 0` globals, which
the interpreter accepts and the compiler refuses. Triton's wheel carries ptxas, so the
whole pipeline down to a cubin runs here without a device.
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from opd.kernels import triton_kernels as K  # noqa: E402
from opd.kernels import triton_ops  # noqa: E402

INTS = {"N", "H", "vocab_size", "stride_x", "stride_w", "stride_t", "n_words", "split_cols",
        "stride_g", "col0", "col_end"}
TARGET = GPUTarget("cuda", 90, 32)   # H100 / H200


def _compile(fn, constexprs: dict, dtype: str, launch: dict):
    """triton.compile with a signature built from the kernel's parameter names."""
    signature, values = {}, {}
    for i, p in enumerate(fn.params):
        if p.is_constexpr:
            signature[p.name], values[(i,)] = "constexpr", constexprs[p.name]
        elif p.name.endswith("_ptr"):
            signature[p.name] = {"bits_ptr": "*i32", "x_ptr": dtype, "w_ptr": dtype, "t_ptr": dtype,
                                 "g_ptr": dtype}.get(p.name, "*fp32")
        else:
            signature[p.name] = "i32" if p.name in INTS else "fp32"
    return triton.compile(ASTSource(fn, signature, values), target=TARGET, options=launch)


def _specializations():
    fused = dict(triton_ops.FUSED_CONFIG)
    launch = {k: fused.pop(k) for k in ("num_warps", "num_stages")}
    for blocks, is_fused, opts in ((fused, True, launch), (dict(BLOCK_N=1, BLOCK_V=4096, BLOCK_H=16), False, {})):
        for topk in (False, True):
            yield K._stats_kernel, dict(FUSED=is_fused, TOPK=topk, **blocks), opts
            for div in (0, 1, 2):
                if not topk:
                    yield K._loss_kernel, dict(DIV=div, FUSED=is_fused, **blocks), opts
                yield K._grad_kernel, dict(DIV=div, FUSED=is_fused, TOPK=topk, **blocks), opts


@pytest.mark.parametrize("dtype", ["*bf16", "*fp32"])
def test_every_cuda_kernel_compiles_for_sm90(dtype):
    upcast = dtype == "*fp32"   # triton_ops: fp32 inputs take fp32 dots
    compiled = [_compile(fn, dict(c, UPCAST=upcast), dtype, opts) for fn, c, opts in _specializations()]
    assert len(compiled) == 22   # per config: stats x 2, loss x 3, grad x 6
    assert all(".target sm_90" in k.asm["ptx"] and k.asm["cubin"] for k in compiled)
