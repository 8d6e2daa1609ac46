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
from .maths import DistillOptions

try:
    import triton
    from . import triton_kernels as K
except ImportError as exc:   # pragma: no cover - exercised only on machines without triton
    raise ImportError("impl='triton' needs the `triton` package (pip install 'opd[triton]')") from exc


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


# Fused tiles on a GPU: tl.dot on [BLOCK_N, BLOCK_H] x [BLOCK_H, BLOCK_V]. The fastest of the
# launch configs measured on an H200 (docs/kernels.md), although ptxas reports register spills
# in the stats and loss kernels at 64x128 and none at 64x64x64.
FUSED_CONFIG = dict(BLOCK_N=64, BLOCK_V=128, BLOCK_H=64, num_warps=8, num_stages=3)
GRAD_CHUNK_ELEMENTS = 1 << 26   # fused backward: [N, C] gradient chunk (128 MB in bf16)


def _config(src, opts: DistillOptions) -> dict:
    """Block sizes (and launch options). Interpreter: tiny blocks so tests cross several."""
    fused = src[0] == "linear"
    if _interpreting():
        return dict(BLOCK_N=16 if fused else 2, BLOCK_V=32, BLOCK_H=16)
    if fused:
        return dict(FUSED_CONFIG)
    return dict(BLOCK_N=1, BLOCK_V=min(4096, triton.next_power_of_2(opts.vocab_size)), BLOCK_H=16)


def _split(src, n_rows: int, opts: DistillOptions, cfg: dict) -> tuple[int, int]:
    """(slices, columns per slice) of the vocabulary for the stats and loss passes.

    Unfused, a program per row is parallel enough. Fused, there are only N / BLOCK_N row
    blocks (128 at N=8192), so each also gets a slice of the vocabulary: about four
    programs per multiprocessor. The slices' partial results are combined in PyTorch.
    """
    block_v = cfg["BLOCK_V"]
    n_blocks = triton.cdiv(opts.vocab_size, block_v)
    if src[0] != "linear":
        return 1, n_blocks * block_v
    if _interpreting():
        want = 2
    else:
        sms = torch.cuda.get_device_properties(src[1].device).multi_processor_count
        want = triton.cdiv(4 * sms, triton.cdiv(n_rows, cfg["BLOCK_N"]))
    per = triton.cdiv(n_blocks, max(1, min(want, n_blocks))) * block_v
    return triton.cdiv(opts.vocab_size, per), per


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


def _grid(n, splits, cfg):
    return (triton.cdiv(n, cfg["BLOCK_N"]), splits)


def _lse_of_slices(lse: torch.Tensor) -> torch.Tensor:
    """[slices, N] -> [N]; all -inf stays -inf."""
    return lse[0] if lse.shape[0] == 1 else torch.logsumexp(lse, 0)


def full_stats(src, t, opts: DistillOptions):
    x, w, n, h, sx, sw, upcast = _common(src, opts)
    t = _teacher(t)
    cfg = _config(src, opts)
    splits, per = _split(src, n, opts, cfg)
    lse_s = torch.empty(splits, n, dtype=torch.float32, device=x.device)
    lse_t = torch.empty_like(lse_s)
    K._stats_kernel[_grid(n, splits, cfg)](
        x, w, t, lse_s, lse_s, lse_t, n, h, opts.vocab_size, sx, sw, t.stride(0), 0, per,
        1.0 / opts.temperature, FUSED=src[0] == "linear", TOPK=False, UPCAST=upcast, **cfg)
    return _lse_of_slices(lse_s), _lse_of_slices(lse_t)


def full_forward(src, t, opts: DistillOptions):
    lse_s, lse_t = full_stats(src, t, opts)
    return (lse_s, lse_t, *full_loss(src, t, lse_s, lse_t, opts))


def full_loss(src, t, lse_s, lse_t, opts: DistillOptions):
    x, w, n, h, sx, sw, upcast = _common(src, opts)
    t = _teacher(t)
    cfg = _config(src, opts)
    splits, per = _split(src, n, opts, cfg)
    loss = torch.empty(splits, n, dtype=torch.float32, device=x.device)
    c = torch.empty_like(loss)
    log_beta, log_1mb = _mixture_logs(opts)
    K._loss_kernel[_grid(n, splits, cfg)](
        x, w, t, lse_s, lse_t, loss, c, n, h, opts.vocab_size, sx, sw, t.stride(0), per,
        1.0 / opts.temperature, opts.beta, log_beta, log_1mb,
        DIV=opts.divergence, FUSED=src[0] == "linear", UPCAST=upcast, **cfg)
    return loss.sum(0), c.sum(0)


def _grad(src, t, bits, lse_s, lse_2, c, a, b, wr, opts: DistillOptions, topk: bool):
    x, w, n, h, sx, sw, upcast = _common(src, opts)
    cfg = _config(src, opts)
    log_beta, log_1mb = _mixture_logs(opts)
    wr = wr.contiguous()

    def launch(g, col0, col1):   # g[:, j] = dL/ds for column col0 + j, col0 <= col < col1
        grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(col1 - col0, cfg["BLOCK_V"]))
        K._grad_kernel[grid](
            x, w, t, bits, lse_s, lse_2, c, a, b, wr, g,
            n, h, sx, sw, t.stride(0), bits.shape[-1] if topk else 0, g.stride(0),
            col0, col1, 1.0 / opts.temperature, opts.beta, log_beta, log_1mb,
            DIV=opts.divergence, FUSED=src[0] == "linear", TOPK=topk, UPCAST=upcast, **cfg)

    if src[0] == "logits":
        gx = torch.zeros(x.shape, dtype=x.dtype, device=x.device)   # padding columns keep 0
        launch(gx, 0, opts.vocab_size)
        return gx
    # Fused: the gradient of one vocabulary chunk at a time, pushed through the linear layer
    # by two matmuls. dW[chunk] is complete after one matmul over all N rows, so it is written
    # once in W's dtype (fp32 accumulation inside the matmul); dH accumulates in fp32.
    vocab = opts.vocab_size
    chunk = 2 * cfg["BLOCK_V"] if _interpreting() else \
        max(cfg["BLOCK_V"], GRAD_CHUNK_ELEMENTS // max(n, 1) // cfg["BLOCK_V"] * cfg["BLOCK_V"])
    chunk = min(chunk, triton.cdiv(vocab, cfg["BLOCK_V"]) * cfg["BLOCK_V"])
    g_dtype = torch.float32 if upcast else x.dtype
    gh = torch.zeros(n, h, dtype=torch.float32, device=x.device)
    gw = torch.empty(w.shape, dtype=w.dtype, device=x.device)
    gw[vocab:].zero_()                                               # padding rows
    g_buf = torch.empty(n, chunk, dtype=g_dtype, device=x.device)
    for c0 in range(0, vocab, chunk):
        c1 = min(c0 + chunk, vocab)
        g = g_buf[:, :c1 - c0]
        launch(g, c0, c1)
        _push_through_linear(g, x, w[c0:c1], gh, gw[c0:c1])
    return gh, gw


def _push_through_linear(g, hidden, w_chunk, gh, gw_chunk) -> None:
    """gh += g @ w_chunk (fp32); gw_chunk = g^T @ hidden, rounded once to its dtype."""
    if g.dtype == torch.float32:   # fp32 inputs, or the interpreter
        gh.addmm_(g, w_chunk.float())
        if gw_chunk.dtype == hidden.dtype == torch.float32:
            torch.mm(g.T, hidden, out=gw_chunk)           # in place: no [chunk, H] temporary
        else:                                             # the interpreter's fp32 g, bf16 weights
            gw_chunk.copy_(g.T @ hidden.float())
    else:                          # bf16/fp16 on CUDA: tensor cores, fp32 accumulation
        torch.addmm(gh, g, w_chunk, out_dtype=torch.float32, out=gh)
        torch.mm(g.T, hidden, out=gw_chunk)


def full_grad(src, t, lse_s, lse_t, loss, c, wr, opts: DistillOptions):
    t = _teacher(t)
    return _grad(src, t, t, lse_s, lse_t, c, c, c, wr, opts, topk=False)


def topk_stats(src, ids, opts: DistillOptions):
    x, w, n, h, sx, sw, upcast = _common(src, opts)
    cfg = _config(src, opts)
    bits = topk_bits(ids, opts.vocab_size)
    splits, per = _split(src, n, opts, cfg)
    lse_s = torch.empty(splits, n, dtype=torch.float32, device=x.device)
    lse_tail = torch.empty_like(lse_s)
    K._stats_kernel[_grid(n, splits, cfg)](
        x, w, x, bits, lse_s, lse_tail, n, h, opts.vocab_size, sx, sw, 0, bits.shape[1], per,
        1.0 / opts.temperature, FUSED=src[0] == "linear", TOPK=True, UPCAST=upcast, **cfg)
    return _lse_of_slices(lse_tail)   # lse_s comes from the k + 1 buckets (autograd.py)


def topk_grad_dense(src, ids, lse_s, lse_tail, a_tail, b_tail, wr, opts: DistillOptions):
    bits = topk_bits(ids, opts.vocab_size)
    return _grad(src, src[1], bits, lse_s, lse_tail, lse_s, a_tail.contiguous(), b_tail.contiguous(),
                 wr, opts, topk=True)


def distill_rows(x, teacher, mask, opts: DistillOptions) -> torch.Tensor:
    return autograd.apply(x, None, teacher, mask, opts, sys.modules[__name__])


def fused_linear_rows(hidden, weight, teacher, mask, opts: DistillOptions) -> torch.Tensor:
    return autograd.apply(hidden, weight, teacher, mask, opts, sys.modules[__name__])
