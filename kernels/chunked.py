"""Chunked PyTorch implementation: the streaming algorithm of the Triton kernels, on CPU.

Rows are cut into blocks and the vocabulary into chunks; each chunk of student logits
(a slice of x, or hidden @ weight[chunk].T) is an fp32 tile [R, C] of about
TILE_ELEMENTS elements. Per row we carry log-sum-exps across chunks (online, combined with
logaddexp), so memory beyond the inputs is the gradient plus a few tiles:

    pass 1  stats: lse_s = logsumexp(s), lse_t = logsumexp(t)   (top-k: lse over non-ids);
            for KL the loss comes from the same pass (chain rule over chunks, full_forward)
    pass 2  loss:  sum_i term_i(log S_i, log T_i)   (JSD; top-k uses k+1 buckets instead)
    pass 3  grad:  dL/ds_i = A_b S_i / S_b + B_b S_i (see kernels/maths.py), in backward

s, t are logits / temperature (top-k teachers arrive already at their temperature).
"""

from __future__ import annotations

import contextlib
import functools
import sys

import torch

from . import autograd
from .maths import FORWARD_KL, REVERSE_KL, DistillOptions, log_mixture, safe_lse

TILE_ELEMENTS = 1 << 18          # 1 MB of fp32 per tile: stays in cache, few Python calls
LOGITS_CHUNK = 8192              # vocabulary chunk for logits input (long contiguous runs)
LINEAR_ROWS = 4096               # fused: rows per block (weight is re-read once per block)
LINEAR_TILE_ELEMENTS = 1 << 20   # fused: 4 MB tiles, so each matmul is large enough for BLAS

# Intra-op threads while streaming over logits tiles (None: leave PyTorch's setting). One:
# on a busy machine OpenMP workers wait for busy cores on every small op, and the tiles are
# many small ops (docs/kernels.md). Set it to None on an idle many-core machine.
TILE_THREADS: int | None = 1

NEG_INF = float("-inf")


@contextlib.contextmanager
def tile_threads():
    """TILE_THREADS intra-op threads for a streaming pass (rl/logprobs.py's entropy uses it too)."""
    before = torch.get_num_threads()
    change = TILE_THREADS is not None and before != TILE_THREADS
    if change:
        torch.set_num_threads(TILE_THREADS)
    try:
        yield
    finally:
        if change:
            torch.set_num_threads(before)


def _tile_threads(fn):
    """Run a streaming pass with TILE_THREADS intra-op threads."""
    @functools.wraps(fn)
    def wrapper(src, *args, **kwargs):
        with tile_threads():
            return fn(src, *args, **kwargs)
    return wrapper


def distill_rows(x, teacher, mask, opts: DistillOptions) -> torch.Tensor:
    return autograd.apply(x, None, teacher, mask, opts, sys.modules[__name__])


def fused_linear_rows(hidden, weight, teacher, mask, opts: DistillOptions) -> torch.Tensor:
    return autograd.apply(hidden, weight, teacher, mask, opts, sys.modules[__name__])


# ---- tiling ---------------------------------------------------------------------------

def _tiles(src, opts: DistillOptions):
    """(r0, r1, c0, c1) over the real vocabulary; padding columns are never visited."""
    n_rows = src[1].shape[0]
    if src[0] == "logits":
        chunk = min(LOGITS_CHUNK, opts.vocab_size)
        rows = max(1, TILE_ELEMENTS // chunk)
    else:
        rows = max(1, min(n_rows, LINEAR_ROWS))     # zero rows: no tiles, not a division by 0
        chunk = max(64, LINEAR_TILE_ELEMENTS // rows)
    for r0 in range(0, n_rows, rows):
        for c0 in range(0, opts.vocab_size, chunk):
            yield r0, min(r0 + rows, n_rows), c0, min(c0 + chunk, opts.vocab_size)


def _student(src, r0, r1, c0, c1, inv_t):
    if src[0] == "logits":
        return src[1][r0:r1, c0:c1].float() * inv_t
    _, hidden, weight = src
    return (hidden[r0:r1].float() @ weight[c0:c1].float().T).mul_(inv_t)


def _teacher(t, r0, r1, c0, c1, inv_t):
    return t[r0:r1, c0:c1].float() * inv_t


def _hits(ids, r0, r1, c0, c1):
    """Bool [R, C]: column c0 + j is one of the row's teacher ids."""
    local = ids[r0:r1] - c0
    local = torch.where((local >= 0) & (local < c1 - c0), local, c1 - c0)  # dump column
    hit = torch.zeros(r1 - r0, c1 - c0 + 1, dtype=torch.bool, device=ids.device)
    return hit.scatter_(1, local, True)[:, :-1]


def _new_grads(src):
    if src[0] == "logits":
        # Padding columns never get visited: their gradient is 0.
        return torch.zeros_like(src[1])
    _, hidden, weight = src
    return (torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device),
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device))


def _put_grad(src, grads, g, r0, r1, c0, c1):
    """g = dL/d(raw logits) on a tile: store it, or push it through the linear layer."""
    if src[0] == "logits":
        grads[r0:r1, c0:c1] = g
        return
    _, hidden, weight = src
    grads[0][r0:r1] += g @ weight[c0:c1].float()          # dH = dlogits @ W    [R, H]
    grads[1][c0:c1] += g.T @ hidden[r0:r1].float()        # dW = dlogits^T @ h  [C, H]


def _scale_rows(g, w_rows):
    """g * w per row, in place; rows with w = 0 become exactly 0 (even where g is inf/nan)."""
    g.mul_(w_rows[:, None])
    if not bool(w_rows.all()):
        g.masked_fill_(w_rows[:, None] == 0, 0.0)
    return g


# ---- full-vocabulary teacher ----------------------------------------------------------

@_tile_threads
def full_forward(src, t, opts: DistillOptions):
    """(lse_s, lse_t, loss, c). Forward KL: one pass; reverse KL and JSD: two.

    Reverse KL and JSD take two passes because their gradient subtracts c (= L) from
    per-column terms; c must be summed from exactly those terms, or with +-1e4 logits its
    rounding (|L| ~ 1e4 * eps) swamps gradients that are mathematically ~0.
    """
    if opts.divergence != FORWARD_KL:
        lse_s, lse_t = full_stats(src, t, opts)
        return (lse_s, lse_t, *full_loss(src, t, lse_s, lse_t, opts))
    # One pass, exact: the chain rule over the partition into chunks. With chunk-local
    # distributions S^c, T^c and chunk masses v_c = e^(lse_s_c - lse_s), w_c = e^(lse_t_c - lse_t):
    #   KL(T || S) = sum_c w_c [KL(T^c || S^c) + log w_c - log v_c]
    # Every term is a difference of log-probabilities, so +-1e4 logits cancel nothing.
    n = src[1].shape[0]
    inv_t = 1.0 / opts.temperature
    zero = torch.zeros((), device=t.device)
    tiles = list(_tiles(src, opts))
    column = {c0: j for j, c0 in enumerate(sorted({c0 for _, _, c0, _ in tiles}))}
    # Per-chunk results [N, chunks], allocated before the loop. Appending them tile by tile
    # left small live tensors between the freed [R, C] tiles; glibc then carved those holes
    # up and took fresh memory for every tile: +1.6 to 3.4 GB of RSS at N=2048, V=152,064, by
    # the heap's state (importing argparse first was enough to trigger it).
    ls_c, lt_c, local = (torch.empty(n, len(column), device=t.device) for _ in range(3))
    for r0, r1, c0, c1 in tiles:
        j = column[c0]
        s = _student(src, r0, r1, c0, c1, inv_t)
        tt = _teacher(t, r0, r1, c0, c1, inv_t)
        ls_c[r0:r1, j], lt_c[r0:r1, j] = s.logsumexp(-1), tt.logsumexp(-1)
        log_s, log_t = s.sub_(ls_c[r0:r1, j, None]), tt.sub_(lt_c[r0:r1, j, None])
        p = log_t.exp()
        local[r0:r1, j] = torch.where(p > 0, p * (log_t - log_s), zero).sum(-1)
    # A chunk where the student has no mass at all (every logit -inf) made log_s NaN; the term
    # -log v_c = +inf says all there is (the loss is +inf where the teacher has mass there).
    local = torch.where(torch.isneginf(ls_c), zero, local)
    lse_s, lse_t = ls_c.logsumexp(-1), lt_c.logsumexp(-1)
    log_v, log_w = ls_c - lse_s[:, None], lt_c - lse_t[:, None]
    mass = log_w.exp()
    loss = torch.where(mass > 0, mass * (local + log_w - log_v), zero).sum(-1)
    return lse_s, lse_t, loss, torch.zeros_like(loss)   # forward KL's gradient needs no c


def _stats(src, opts: DistillOptions, device, *parts) -> list[torch.Tensor]:
    """One online log-sum-exp [N] per part(s, r0, r1, c0, c1) of the student tiles s, in order
    (a part may change s in place for the parts after it)."""
    n = src[1].shape[0]
    inv_t = 1.0 / opts.temperature
    out = [torch.full((n,), NEG_INF, device=device) for _ in parts]
    for r0, r1, c0, c1 in _tiles(src, opts):
        s = _student(src, r0, r1, c0, c1, inv_t)
        for lse, part in zip(out, parts):
            lse[r0:r1] = torch.logaddexp(lse[r0:r1], part(s, r0, r1, c0, c1).logsumexp(-1))
    return out


@_tile_threads
def full_stats(src, t, opts: DistillOptions):
    inv_t = 1.0 / opts.temperature
    return _stats(src, opts, t.device, lambda s, *_: s, lambda s, r0, r1, c0, c1: _teacher(t, r0, r1, c0, c1, inv_t))


@_tile_threads
def full_loss(src, t, lse_s, lse_t, opts: DistillOptions):
    """Reverse KL and JSD only (full_forward computes forward KL in its single pass)."""
    n = src[1].shape[0]
    inv_t, beta, div = 1.0 / opts.temperature, opts.beta, opts.divergence
    loss = torch.zeros(n, device=t.device)
    c = torch.zeros(n, device=t.device)
    zero = torch.zeros((), device=t.device)
    for r0, r1, c0, c1 in _tiles(src, opts):
        log_s = _student(src, r0, r1, c0, c1, inv_t).sub_(lse_s[r0:r1, None])
        log_t = _teacher(t, r0, r1, c0, c1, inv_t).sub_(lse_t[r0:r1, None])
        if div == REVERSE_KL:      # S (log S - log T)
            S = log_s.exp()
            loss[r0:r1] += torch.where(S > 0, S * (log_s - log_t), zero).sum(-1)
        else:                      # beta T (log T - log M) + (1-beta) S (log S - log M)
            S, T, log_m = log_s.exp(), log_t.exp(), log_mixture(log_s, log_t, beta)
            student_part = torch.where(S > 0, (1 - beta) * S * (log_s - log_m), zero).sum(-1)
            teacher_part = torch.where(T > 0, beta * T * (log_t - log_m), zero).sum(-1)
            loss[r0:r1] += student_part + teacher_part
            c[r0:r1] += student_part
    if div == REVERSE_KL:
        c = loss.clone()
    return loss, c


@_tile_threads
def full_grad(src, t, lse_s, lse_t, loss, c, w, opts: DistillOptions):
    inv_t, beta, div = 1.0 / opts.temperature, opts.beta, opts.divergence
    grads = _new_grads(src)
    zero = torch.zeros((), device=t.device)
    for r0, r1, c0, c1 in _tiles(src, opts):
        log_s = _student(src, r0, r1, c0, c1, inv_t).sub_(lse_s[r0:r1, None])
        log_t = _teacher(t, r0, r1, c0, c1, inv_t).sub_(lse_t[r0:r1, None])
        S = log_s.exp()
        if div == FORWARD_KL:      # S_i - T_i
            g = S.sub_(log_t.exp_())
        elif div == REVERSE_KL:    # S_i (log S_i - log T_i - L)
            g = torch.where(S > 0, S * (log_s - log_t - c[r0:r1, None]), zero)
        else:                      # S_i ((1-beta)(log S_i - log M_i) - c)
            log_m = log_mixture(log_s, log_t, beta)
            g = torch.where(S > 0, S * ((1 - beta) * (log_s - log_m) - c[r0:r1, None]), zero)
        _put_grad(src, grads, _scale_rows(g, w[r0:r1]), r0, r1, c0, c1)
    return grads


# ---- top-k teacher --------------------------------------------------------------------

@_tile_threads
def topk_stats(src, ids, opts: DistillOptions):
    """lse_tail [N]: the student over the columns outside the ids. (lse_s comes from the k + 1
    buckets, kernels/autograd.py.)"""
    return _stats(src, opts, ids.device,
                  lambda s, r0, r1, c0, c1: s.masked_fill_(_hits(ids, r0, r1, c0, c1), NEG_INF))[0]


@_tile_threads
def topk_grad_dense(src, ids, lse_s, lse_tail, a_tail, b_tail, w, opts: DistillOptions):
    """Tail columns: A_tail S_i / S_tail + B_tail S_i; the teacher's ids: 0 (added sparsely)."""
    inv_t = 1.0 / opts.temperature
    shift_tail = safe_lse(lse_tail)
    grads = _new_grads(src)
    for r0, r1, c0, c1 in _tiles(src, opts):
        s = _student(src, r0, r1, c0, c1, inv_t)
        g = (s - shift_tail[r0:r1, None]).exp_().mul_(a_tail[r0:r1, None])
        g += s.sub_(lse_s[r0:r1, None]).exp_().mul_(b_tail[r0:r1, None])
        g.masked_fill_(_hits(ids, r0, r1, c0, c1), 0.0)
        _put_grad(src, grads, _scale_rows(g, w[r0:r1]), r0, r1, c0, c1)
    return grads
