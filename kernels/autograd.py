"""One autograd Function for every streaming implementation (chunked torch, Triton).

An implementation ("ops" module) provides these streaming passes over vocabulary blocks;
the student source is either logits [N, V] ("logits", x) or hidden @ weight.T ("linear",
hidden [N, H], weight [V, H]) computed per block:

    full_forward(src, t, opts)                       -> lse_s, lse_t, loss, c  [N] each
        (c: what the gradient needs besides the lse's: L for reverse KL, (1-beta) KL(S||M) for JSD)
    full_grad(src, t, lse_s, lse_t, loss, c, w, opts) -> grads
    topk_stats(src, ids, opts)                       -> lse_tail [N] (the student outside the ids)
    topk_grad_dense(src, ids, lse_s, lse_tail, a_tail, b_tail, w, opts) -> grads, 0 at ids

grads is grad_x (x's dtype) for "logits" and (grad_hidden, grad_weight) for "linear", each
fp32 or already in its input's dtype.
w [N] = upstream gradient per row / temperature, 0 on masked rows. The top-k buckets'
own gradient (one column each) is added here as a sparse scatter.
"""

from __future__ import annotations

import torch

from .maths import DistillOptions, TopKTeacher, gather_linear_logits, scatter_linear_grad, topk_rows


class StreamingDistill(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, t_logits, t_ids, t_logprobs, t_tail, mask, opts: DistillOptions, ops):
        src = ("logits", x) if weight is None else ("linear", x, weight)
        inv_t = 1.0 / opts.temperature
        if t_ids is None:
            lse_s, lse_t, loss, c = ops.full_forward(src, t_logits, opts)
            saved = (lse_s, lse_t, loss, c)
        else:
            teacher = TopKTeacher(t_ids, t_logprobs, t_tail)
            lse_tail = ops.topk_stats(src, t_ids, opts)
            if weight is None:
                s_ids = x.gather(1, t_ids).float() * inv_t
            else:
                s_ids = gather_linear_logits(x, weight, t_ids) * inv_t
            # lse_s from the k + 1 buckets themselves, not from the stats pass: fused, the ids'
            # logits come from a separate product (gather_linear_logits) whose rounding differs
            # from the tiles', and buckets that do not sum to 1 cost several times the fp32
            # gradient error (docs/kernels.md, the CUDA tests).
            lse_s = torch.logaddexp(lse_tail, s_ids.logsumexp(-1))
            loss, coef_topk, a_tail, b_tail = topk_rows(s_ids, lse_s, lse_tail, teacher, opts.beta)
            saved = (lse_s, lse_tail, coef_topk, a_tail, b_tail)
        if mask is not None:
            loss = torch.where(mask, loss, torch.zeros_like(loss))
        ctx.save_for_backward(x, weight, t_logits, t_ids, mask, *saved)
        ctx.opts, ctx.ops = opts, ops
        return loss

    @staticmethod
    def backward(ctx, grad_rows):
        x, weight, t_logits, t_ids, mask, *saved = ctx.saved_tensors
        opts, ops = ctx.opts, ctx.ops
        src = ("logits", x) if weight is None else ("linear", x, weight)
        w = grad_rows.float() / opts.temperature
        if mask is not None:
            w = torch.where(mask, w, torch.zeros_like(w))
        if t_ids is None:
            grads = ops.full_grad(src, t_logits, *saved, w, opts)
        else:
            lse_s, lse_tail, coef_topk, a_tail, b_tail = saved
            grads = ops.topk_grad_dense(src, t_ids, lse_s, lse_tail, a_tail, b_tail, w, opts)
            coef = torch.where(w[:, None] != 0, coef_topk * w[:, None], torch.zeros_like(coef_topk))
            if weight is None:
                grads.scatter_add_(1, t_ids, coef.to(grads.dtype))
            else:
                scatter_linear_grad(coef, t_ids, x, weight, grads[0], grads[1])
        if weight is None:
            return grads, None, None, None, None, None, None, None, None
        grad_h, grad_w = grads
        return grad_h.to(x.dtype), grad_w.to(weight.dtype), None, None, None, None, None, None, None


def apply(x, weight, teacher, mask, opts: DistillOptions, ops) -> torch.Tensor:
    if isinstance(teacher, TopKTeacher):
        return StreamingDistill.apply(x, weight, None, teacher.ids, teacher.logprobs,
                                      teacher.tail_logmass, mask, opts, ops)
    return StreamingDistill.apply(x, weight, teacher, None, None, None, mask, opts, ops)
