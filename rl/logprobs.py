"""GRPO's per-token log-probabilities and entropies of packed rows, without [B, T, V] logits.

Taking the model's logits at every position of the batch ([B, L, V]), an fp32 log-softmax of
them, and in backward their gradient holds several tensors of that size at once (what GRPO did
before; tests/oracles.py:response_logits keeps the plain computation as the reference). At
V = 152,064 that is what runs out of memory first. Here the decoder body runs alone, its hidden
states are taken at the N rows (the positions that predict a sampled response token:
opd.spine.rows.student_rows, as opd train takes them), and the LM head meets them vocabulary
chunk by vocabulary chunk, so what is held grows with N, not with B x L x V:

    token_logprobs_and_entropy(model, packed) -> logprobs [N] (grad), entropy [N] (no grad)
    rows_logprobs_and_entropy(hidden, weight, targets) -> the same on rows, for a plain head
    chunked_entropy(hidden, weight)          -> entropy [N], one [rows, chunk] tile at a time

The log-prob of the sampled token is minus the forward KL to a one-hot teacher, which is what
opd.kernels.fused_linear_distill_loss computes without [N, V] (Triton on CUDA, chunked PyTorch
on CPU) with its gradient to both hidden and lm_head.weight (opd.spine.rows.token_logprobs). The
entropy is a metric only: it is streamed under no_grad, unless a term trains it. A head the
fused loss cannot see through (`opd.lm_head.head_form`: a soft-cap or scale after it, a bias, a
LoRA adapter on it) gets its logits for the N rows only, [N, V], and the plain functions on
them; a head of no known form, the rows of the model's own forward.

Shapes are in the names: N rows, H hidden, V vocabulary.
"""

from __future__ import annotations

import torch

from opd.kernels import chunked
from opd.spine import terms
from opd.spine.rows import Packed, rows_head_form, student_rows, token_logprobs

# Entropy tiles: rows per block, and about this many fp32 elements per [rows, chunk] tile
# (4 MiB: the size kernels/chunked.py found fast on CPU, large enough for BLAS).
ENTROPY_ROWS = 4096
ENTROPY_TILE_ELEMENTS = 1 << 20


# ---- the maths on rows ----------------------------------------------------------------------

@torch.no_grad()
def chunked_entropy(hidden_N_H: torch.Tensor, weight_V_H: torch.Tensor, *,
                    chunk: int | None = None) -> torch.Tensor:
    """Entropy (nats, fp32 [N]) of softmax(hidden @ weight.T) per row, no grad, never [N, V].

    Streams vocabulary chunks of at most `chunk` columns (None: about ENTROPY_TILE_ELEMENTS
    per [rows, chunk] tile) with an online log-sum-exp. Per row, relative to the running max m:
        s = sum_i e^(z_i - m),  a = sum_i e^(z_i - m) (z_i - m),  H = log s - a / s
    Both terms are >= 0 (a <= 0): no cancellation between lse and E[z] at large logits.
    When the max rises from m to m', s and a rescale by e^(m - m') and a gains s (m - m').
    """
    n_rows = hidden_N_H.shape[0]
    out_N = torch.zeros(n_rows, dtype=torch.float32, device=hidden_N_H.device)
    rows = max(1, min(n_rows, ENTROPY_ROWS))
    cols = chunk if chunk is not None else max(64, ENTROPY_TILE_ELEMENTS // rows)
    # kernels/chunked.py's thread setting for tiles: many small ops, slower with more threads on a
    # busy machine (docs/kernels.md).
    with chunked.tile_threads():
        _entropy_tiles(hidden_N_H, weight_V_H, rows, cols, out_N)
    return out_N


def _entropy_tiles(hidden_N_H, weight_V_H, rows: int, cols: int, out_N: torch.Tensor) -> None:
    """chunked_entropy's loop: blocks of `rows` rows, `cols` vocabulary columns per tile."""
    n_rows, n_cols = hidden_N_H.shape[0], weight_V_H.shape[0]
    for r0 in range(0, n_rows, rows):
        h = hidden_N_H[r0:r0 + rows].float()
        m = s = a = None
        for c0 in range(0, n_cols, cols):
            z = h @ weight_V_H[c0:c0 + cols].float().T                  # [R, C], the only tile
            m_c = z.max(dim=-1).values
            if m is None:
                m_new = m_c
            else:
                m_new = torch.maximum(m, m_c)
                scale = torch.exp(m - m_new)
                a = (a + s * (m - m_new)) * scale
                s = s * scale
            z.sub_(m_new[:, None])                                      # z - m', in place
            e = z.exp()
            s_c, a_c = e.sum(-1), e.mul_(z).sum(-1)
            s, a = (s_c, a_c) if m is None else (s + s_c, a + a_c)
            m = m_new
            del z, e
        if m is not None:
            out_N[r0:r0 + rows] = torch.log(s) - a / s


def rows_logprobs_and_entropy(hidden_N_H: torch.Tensor, weight_V_H: torch.Tensor, targets_N: torch.Tensor, *,
                              with_entropy: bool = True, chunk: int | None = None,
                              impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor | None]:
    """For a plain head (logits = hidden @ weight.T): (log softmax(logits)[target] fp32 [N], with
    grad to hidden and weight; entropy fp32 [N] without grad, or None), never [N, V].

    The log-prob is -KL(one-hot(target) || softmax(logits)), forward KL (beta = 0) to a top-1
    teacher holding all the mass (log-prob 0, tail -inf): the fused loss's gradient is then
    softmax - one-hot, that of log_softmax.gather. impl as the fused loss takes it: "auto"
    (Triton on CUDA, chunked PyTorch elsewhere), "torch", "triton", "reference" (naive, [N, V]).
    The chunked path computes in fp32 whatever the inputs' dtype (fp64 in, fp32 out).
    """
    lp_N = token_logprobs((hidden_N_H, weight_V_H), targets_N, impl=impl)
    ent_N = chunked_entropy(hidden_N_H.detach(), weight_V_H.detach(), chunk=chunk) if with_entropy else None
    return lp_N, ent_N


# ---- the batch -------------------------------------------------------------------------------

def token_logprobs_and_entropy(model, packed: Packed, *, with_entropy: bool = True,
                               chunk: int | None = None, impl: str = "auto",
                               entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logprobs_N, entropy_N) of the packed rows' tokens, fp32 on the model's device: what
    log_softmax(logits).gather and opd.spine.terms.entropy give on the model's own logits at those rows
    (tests/oracles.py:response_logits), without [B, L, V].

    logprobs_N carries the gradient to the model; entropy_N (None unless with_entropy) has none,
    unless entropy_grad (a term trains it, opd.spine.terms): then the rows' logits [N, V] are
    held, as for any other head. A plain head goes through rows_logprobs_and_entropy: memory
    beyond the model is O(N x H + N x chunk) plus the head's weight gradient. Any other head
    (soft-cap, scale, bias, LoRA on lm_head) gets logits for the N rows only (student_rows).
    """
    rows = student_rows(model, packed, fused=rows_head_form(model).fusable)
    if isinstance(rows, tuple):
        hidden_N_H, weight_V_H = rows
        targets_N = packed.targets_N.to(hidden_N_H.device)
        if not entropy_grad:
            return rows_logprobs_and_entropy(hidden_N_H, weight_V_H, targets_N, with_entropy=with_entropy,
                                             chunk=chunk, impl=impl)
        rows = hidden_N_H @ weight_V_H.T     # a term trains the entropy: the rows' logits [N, V]
    targets_N = packed.targets_N.to(rows.device)
    lp_N = token_logprobs(rows, targets_N)
    ent_N = terms.entropy(rows if entropy_grad else rows.detach()) if with_entropy else None
    return lp_N, ent_N
