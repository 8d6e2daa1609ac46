"""Triton kernels: streaming passes over vocabulary blocks, fp32 accumulation.

Pointer shapes (row-major; strides passed explicitly):
    x  [N, V] student logits (bf16/fp16/fp32)       or hidden [N, H] when FUSED
    w  [V, H] LM-head weight (FUSED only)
    t  [N, V] teacher logits (full teacher only)
    bits [N, ceil(V/32)] int32: bit (c % 32) of word c // 32 is set when column c is one
       of the row's top-k teacher ids (top-k teacher only)
    per-row vectors [N] fp32: lse_s, lse_2 (teacher lse or student tail lse), c, a, b, wr
    g  [N, C] the gradient dL/ds for columns [col0, col0 + C) (all V when not FUSED)
A program owns BLOCK_N rows and one slice of the vocabulary (grid axis 1). A student tile
s [BLOCK_N, BLOCK_V] is loaded (logits) or computed as hidden[rows] @ w[cols].T with tl.dot
over BLOCK_H slices (FUSED) and never written. s and t are already divided by the
temperature (x * inv_t).

    _stats_kernel  per slice: lse_s = logsumexp_i s_i and lse_2 = logsumexp_i t_i, or (TOPK)
                   only lse_2 = logsumexp over s_i, i not in ids; one pass, online:
                   m' = max(m, max_i x_i); l' = l e^(m - m') + sum_i e^(x_i - m').
                   Slices are combined by the caller.
    _loss_kernel   per slice: L = sum_i term_i(log S_i, log T_i), c = sum of the student part
    _grad_kernel   dL/ds_i (kernels/maths.py), scaled by wr (upstream grad / T), stored to g.
                   FUSED: the caller pushes g through the linear layer with two matmuls per
                   vocabulary chunk (dH += g @ W[chunk], dW[chunk] = g^T @ h), so no [V, H]
                   fp32 accumulator and no atomics exist.

UPCAST (interpreter, fp32 inputs): operands go to fp32 before tl.dot with ieee precision
(the interpreter computes bf16 dots wrongly; fp32 on GPU would otherwise use tf32).
"""

from __future__ import annotations

import triton
import triton.language as tl

FORWARD_KL = tl.constexpr(0)
REVERSE_KL = tl.constexpr(1)


@triton.jit
def _student_tile(x_ptr, w_ptr, rows, cols, row_ok, col_ok, H, stride_x, stride_w, inv_t,
                  FUSED: tl.constexpr, UPCAST: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr):
    if FUSED:
        acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            hs = h0 + tl.arange(0, BLOCK_H)
            h_ok = hs < H
            a = tl.load(x_ptr + rows[:, None] * stride_x + hs[None, :],
                        mask=row_ok[:, None] & h_ok[None, :], other=0.0)          # [BN, BH]
            b = tl.load(w_ptr + cols[:, None] * stride_w + hs[None, :],
                        mask=col_ok[:, None] & h_ok[None, :], other=0.0)          # [BV, BH]
            if UPCAST:
                acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(b), acc)
        s = acc * inv_t
    else:
        s = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :],
                    mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32) * inv_t
    # Padding columns (>= vocab_size) are -inf, never 0. Rows past N stay finite (unused).
    return tl.where(col_ok[None, :], s, float("-inf"))


@triton.jit
def _teacher_tile(t_ptr, rows, cols, row_ok, col_ok, stride_t, inv_t):
    t = tl.load(t_ptr + rows[:, None] * stride_t + cols[None, :],
                mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32) * inv_t
    return tl.where(col_ok[None, :], t, float("-inf"))


@triton.jit
def _hit_tile(bits_ptr, rows, cols, row_ok, col_ok, n_words):
    word = tl.load(bits_ptr + rows[:, None] * n_words + (cols // 32)[None, :],
                   mask=row_ok[:, None] & col_ok[None, :], other=0)
    return ((word >> (cols % 32)[None, :]) & 1) != 0


@triton.jit
def _lse_update(m, l, x):
    m_new = tl.maximum(m, tl.max(x, 1))
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)     # all -inf so far: keep l = 0
    l = l * tl.exp(m - shift) + tl.sum(tl.exp(x - shift[:, None]), 1)
    return m_new, l


@triton.jit
def _log_mixture(log_s, log_t, log_beta, log_1mb):
    # log M = log(beta T + (1 - beta) S)
    a = log_t + log_beta
    b = log_s + log_1mb
    mx = tl.maximum(a, b)
    shift = tl.where(mx == float("-inf"), 0.0, mx)
    return shift + tl.log(tl.exp(a - shift) + tl.exp(b - shift))


@triton.jit
def _stats_kernel(x_ptr, w_ptr, t_ptr, bits_ptr, lse_s_ptr, lse_2_ptr,
                  N, H, vocab_size, stride_x, stride_w, stride_t, n_words, split_cols, inv_t,
                  FUSED: tl.constexpr, TOPK: tl.constexpr, UPCAST: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    first = tl.program_id(1) * split_cols           # this program's slice of the vocabulary
    last = tl.minimum(first + split_cols, vocab_size)
    m_s = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    l_s = tl.zeros((BLOCK_N,), tl.float32)
    m_2 = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    l_2 = tl.zeros((BLOCK_N,), tl.float32)
    for v0 in range(first, last, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < last
        s = _student_tile(x_ptr, w_ptr, rows, cols, row_ok, col_ok, H, stride_x, stride_w, inv_t,
                          FUSED, UPCAST, BLOCK_N, BLOCK_V, BLOCK_H)
        if TOPK:   # student tail: the columns that are not among the teacher's ids
            other = tl.where(_hit_tile(bits_ptr, rows, cols, row_ok, col_ok, n_words), float("-inf"), s)
        else:
            other = _teacher_tile(t_ptr, rows, cols, row_ok, col_ok, stride_t, inv_t)
        if not TOPK:   # top-k: lse_s is built from the k + 1 buckets (autograd.py); -inf here
            m_s, l_s = _lse_update(m_s, l_s, s)
        m_2, l_2 = _lse_update(m_2, l_2, other)
    out = tl.program_id(1) * N + rows                # [splits, N]
    tl.store(lse_s_ptr + out, m_s + tl.log(l_s), mask=row_ok)
    tl.store(lse_2_ptr + out, m_2 + tl.log(l_2), mask=row_ok)


@triton.jit
def _loss_kernel(x_ptr, w_ptr, t_ptr, lse_s_ptr, lse_t_ptr, loss_ptr, c_ptr,
                 N, H, vocab_size, stride_x, stride_w, stride_t, split_cols,
                 inv_t, beta, log_beta, log_1mb,
                 DIV: tl.constexpr, FUSED: tl.constexpr, UPCAST: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    first = tl.program_id(1) * split_cols
    last = tl.minimum(first + split_cols, vocab_size)
    lse_s = tl.load(lse_s_ptr + rows, mask=row_ok, other=0.0)
    lse_t = tl.load(lse_t_ptr + rows, mask=row_ok, other=0.0)
    loss = tl.zeros((BLOCK_N,), tl.float32)
    c = tl.zeros((BLOCK_N,), tl.float32)
    for v0 in range(first, last, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < last
        log_s = _student_tile(x_ptr, w_ptr, rows, cols, row_ok, col_ok, H, stride_x, stride_w, inv_t,
                              FUSED, UPCAST, BLOCK_N, BLOCK_V, BLOCK_H) - lse_s[:, None]
        log_t = _teacher_tile(t_ptr, rows, cols, row_ok, col_ok, stride_t, inv_t) - lse_t[:, None]
        S = tl.exp(log_s)
        T = tl.exp(log_t)
        if DIV == FORWARD_KL:      # T (log T - log S)
            loss += tl.sum(tl.where(T > 0, T * (log_t - log_s), 0.0), 1)
        elif DIV == REVERSE_KL:    # S (log S - log T)
            loss += tl.sum(tl.where(S > 0, S * (log_s - log_t), 0.0), 1)
        else:                      # beta T (log T - log M) + (1 - beta) S (log S - log M)
            log_m = _log_mixture(log_s, log_t, log_beta, log_1mb)
            student_part = tl.where(S > 0, (1 - beta) * S * (log_s - log_m), 0.0)
            teacher_part = tl.where(T > 0, beta * T * (log_t - log_m), 0.0)
            loss += tl.sum(student_part + teacher_part, 1)
            c += tl.sum(student_part, 1)
    out = tl.program_id(1) * N + rows                # [splits, N]
    tl.store(loss_ptr + out, loss, mask=row_ok)
    if DIV == REVERSE_KL:
        tl.store(c_ptr + out, loss, mask=row_ok)
    else:
        tl.store(c_ptr + out, c, mask=row_ok)


@triton.jit
def _grad_kernel(x_ptr, w_ptr, t_ptr, bits_ptr, lse_s_ptr, lse_2_ptr, c_ptr, a_ptr, b_ptr, wr_ptr, g_ptr,
                 N, H, stride_x, stride_w, stride_t, n_words, stride_g, col0, col_end,
                 inv_t, beta, log_beta, log_1mb,
                 DIV: tl.constexpr, FUSED: tl.constexpr, TOPK: tl.constexpr, UPCAST: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = col0 + tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < N
    col_ok = cols < col_end
    wr = tl.load(wr_ptr + rows, mask=row_ok, other=0.0)
    lse_s = tl.load(lse_s_ptr + rows, mask=row_ok, other=0.0)
    lse_2 = tl.load(lse_2_ptr + rows, mask=row_ok, other=0.0)
    s = _student_tile(x_ptr, w_ptr, rows, cols, row_ok, col_ok, H, stride_x, stride_w, inv_t,
                      FUSED, UPCAST, BLOCK_N, BLOCK_V, BLOCK_H)
    log_s = s - lse_s[:, None]
    S = tl.exp(log_s)
    if TOPK:
        # tail columns: A_tail S_i / S_tail + B_tail S_i; the ids get their part sparsely
        a = tl.load(a_ptr + rows, mask=row_ok, other=0.0)
        b = tl.load(b_ptr + rows, mask=row_ok, other=0.0)
        shift = tl.where(lse_2 == float("-inf"), 0.0, lse_2)
        g = a[:, None] * tl.exp(s - shift[:, None]) + b[:, None] * S
        g = tl.where(_hit_tile(bits_ptr, rows, cols, row_ok, col_ok, n_words), 0.0, g)
    else:
        c = tl.load(c_ptr + rows, mask=row_ok, other=0.0)
        log_t = _teacher_tile(t_ptr, rows, cols, row_ok, col_ok, stride_t, inv_t) - lse_2[:, None]
        if DIV == FORWARD_KL:      # S_i - T_i
            g = S - tl.exp(log_t)
        elif DIV == REVERSE_KL:    # S_i (log S_i - log T_i - L)
            g = tl.where(S > 0, S * (log_s - log_t - c[:, None]), 0.0)
        else:                      # S_i ((1 - beta)(log S_i - log M_i) - c)
            log_m = _log_mixture(log_s, log_t, log_beta, log_1mb)
            g = tl.where(S > 0, S * ((1 - beta) * (log_s - log_m) - c[:, None]), 0.0)
    keep = row_ok[:, None] & col_ok[None, :] & (wr != 0)[:, None]
    g = tl.where(keep, g * wr[:, None], 0.0)                                   # [BN, BV] fp32
    tl.store(g_ptr + rows[:, None] * stride_g + (cols - col0)[None, :], g.to(g_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])
