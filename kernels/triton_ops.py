"""Triton implementation: launches kernels/triton_kernels.py for the autograd Function.

Imported only when impl="triton" is used (directly or through "auto" on CUDA), so the
package imports without Triton. On CPU it runs under the interpreter (TRITON_INTERPRET=1).
One launch configuration per mode (no autotune: the interpreter accepts a single config).
"""

from __future__ import annotations

import math
import os
import sys

import torch

from . import autograd
from .loss import DistillOptions

try:
    import triton
    from . import triton_kernels as K
except ImportError as exc:   # pragma: no cover - exercised only on machines without triton
    raise ImportError("impl='triton' needs the `triton` package (pip install 'opd[triton]')") from exc


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _config(src, opts: DistillOptions) -> dict:
    """Block sizes. Interpreter: tiny blocks so tests cross several blocks."""
    fused = src[0] == "linear"
    if _interpreting():
        return dict(BLOCK_N=16 if fused else 2, BLOCK_V=32, BLOCK_H=16)
    if fused:
        return dict(BLOCK_N=64, BLOCK_V=64, BLOCK_H=64)
    return dict(BLOCK_N=1, BLOCK_V=min(4096, triton.next_power_of_2(opts.vocab_size)), BLOCK_H=16)


def _check_device(t: torch.Tensor) -> None:
    if t.device.type != "cuda" and not _interpreting():
        raise RuntimeError("impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1 for the CPU interpreter)")


def _common(src, opts: DistillOptions):
    """Arguments every kernel takes: (x, w, N, H, stride_x, stride_w, upcast)."""
    x = src[1]
    _check_device(x)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if src[0] == "logits":
        upcast = _interpreting() or x.dtype == torch.float32
        return x, x, x.shape[0], 1, x.stride(0), 0, upcast
    w = src[2] if src[2].stride(-1) == 1 else src[2].contiguous()
    upcast = _interpreting() or x.dtype == torch.float32 or w.dtype == torch.float32
    if not upcast and x.dtype != w.dtype:
        raise TypeError(f"hidden {x.dtype} and weight {w.dtype} must share a dtype")
    return x, w, x.shape[0], x.shape[1], x.stride(0), w.stride(0), upcast


def _teacher(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def topk_bits(ids: torch.Tensor, n_cols: int) -> torch.Tensor:
    """[N, ceil(V/32)] int32 bitmap of the teacher's ids (ids distinct within a row)."""
    n_words = (n_cols + 31) // 32
    words = torch.zeros(ids.shape[0], n_words, dtype=torch.int64, device=ids.device)
    words.scatter_add_(1, ids // 32, torch.ones_like(ids) << (ids % 32))
    words = torch.where(words >= 2**31, words - 2**32, words)   # as two's-complement int32
    return words.to(torch.int32)


def _mixture_logs(opts: DistillOptions):
    beta = opts.beta
    return (math.log(beta) if beta > 0 else 0.0), (math.log1p(-beta) if beta < 1 else 0.0)


def _rows_grid(n, cfg):
    return (triton.cdiv(n, cfg["BLOCK_N"]),)


def full_stats(src, t, opts: DistillOptions):
    x, w, n, h, sx, sw, upcast = _common(src, opts)
    t = _teacher(t)
    cfg = _config(src, opts)
    lse_s = torch.empty(n, dtype=torch.float32, device=x.device)
    lse_t = torch.empty_like(lse_s)
    K._stats_kernel[_rows_grid(n, cfg)](
        x, w, t, lse_s, lse_s, lse_t, n, h, opts.vocab_size, sx, sw, t.stride(0), 0,
        1.0 / opts.temperature, FUSED=src[0] == "linear", TOPK=False, UPCAST=upcast, **cfg)
    return lse_s, lse_t


def full_forward(src, t, opts: DistillOptions):
    lse_s, lse_t = full_stats(src, t, opts)
    return (lse_s, lse_t, *full_loss(src, t, lse_s, lse_t, opts))


def full_loss(src, t, lse_s, lse_t, opts: DistillOptions):
    x, w, n, h, sx, sw, upcast = _common(src, opts)
    t = _teacher(t)
    cfg = _config(src, opts)
    loss = torch.empty(n, dtype=torch.float32, device=x.device)
    c = torch.empty_like(loss)
    log_beta, log_1mb = _mixture_logs(opts)
    K._loss_kernel[_rows_grid(n, cfg)](
        x, w, t, lse_s, lse_t, loss, c, n, h, opts.vocab_size, sx, sw, t.stride(0),
        1.0 / opts.temperature, opts.beta, log_beta, log_1mb,
        DIV=opts.divergence, FUSED=src[0] == "linear", UPCAST=upcast, **cfg)
    return loss, c


def _grad(src, t, bits, lse_s, lse_2, c, a, b, wr, opts: DistillOptions, topk: bool):
    x, w, n, h, sx, sw, upcast = _common(src, opts)
    cfg = _config(src, opts)
    fused = src[0] == "linear"
    if fused:
        gx = lse_s    # unused
        gh = torch.zeros(n, h, dtype=torch.float32, device=x.device)
        gw = torch.zeros(w.shape, dtype=torch.float32, device=x.device)
        sg = 0
    else:
        gx = torch.zeros(x.shape, dtype=x.dtype, device=x.device)   # padding columns keep 0
        gh = gw = lse_s
        sg = gx.stride(0)
    log_beta, log_1mb = _mixture_logs(opts)
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(opts.vocab_size, cfg["BLOCK_V"]))
    K._grad_kernel[grid](
        x, w, t, bits, lse_s, lse_2, c, a, b, wr.contiguous(), gx, gh, gw,
        n, h, opts.vocab_size, sx, sw, t.stride(0), bits.shape[-1] if topk else 0, sg,
        1.0 / opts.temperature, opts.beta, log_beta, log_1mb,
        DIV=opts.divergence, FUSED=fused, TOPK=topk, UPCAST=upcast, **cfg)
    if fused:
        return gh, gw
    return gx


def full_grad(src, t, lse_s, lse_t, loss, c, wr, opts: DistillOptions):
    t = _teacher(t)
    return _grad(src, t, t, lse_s, lse_t, c, c, c, wr, opts, topk=False)


def topk_stats(src, ids, opts: DistillOptions):
    x, w, n, h, sx, sw, upcast = _common(src, opts)
    cfg = _config(src, opts)
    bits = topk_bits(ids, opts.vocab_size)
    lse_s = torch.empty(n, dtype=torch.float32, device=x.device)
    lse_tail = torch.empty_like(lse_s)
    K._stats_kernel[_rows_grid(n, cfg)](
        x, w, x, bits, lse_s, lse_tail, n, h, opts.vocab_size, sx, sw, 0, bits.shape[1],
        1.0 / opts.temperature, FUSED=src[0] == "linear", TOPK=True, UPCAST=upcast, **cfg)
    return lse_s, lse_tail


def topk_grad_dense(src, ids, lse_s, lse_tail, a_tail, b_tail, wr, opts: DistillOptions):
    bits = topk_bits(ids, opts.vocab_size)
    return _grad(src, src[1], bits, lse_s, lse_tail, lse_s, a_tail.contiguous(), b_tail.contiguous(),
                 wr, opts, topk=True)


def distill_rows(x, teacher, mask, opts: DistillOptions) -> torch.Tensor:
    return autograd.apply(x, None, teacher, mask, opts, sys.modules[__name__])


def fused_linear_rows(hidden, weight, teacher, mask, opts: DistillOptions) -> torch.Tensor:
    return autograd.apply(hidden, weight, teacher, mask, opts, sys.modules[__name__])
