"""GRPO's per-token log-probabilities and entropies without [B, T, V] logits.

`opd.spine.rows.token_logprobs(logits_B_T_V, ...)` and `rl/grpo.py`'s `entropy(...)` take
the model's logits at every response column, padding included ([B, T, V], sliced from the
forward's [B, L, V]), an fp32 log-softmax of them, and in backward their gradient: several
[B, T, V] tensors at once (what GRPO did before; tests/oracles.py:response_logits keeps it as
the reference). At V = 152,064 that is what runs out of memory first. Here the decoder body
runs alone, the hidden states are taken at the N positions that predict a real response
token (mask_B_T = 1), and the LM head meets them vocabulary chunk by vocabulary chunk, so
what is held grows with N (<= B x T), not with B x T x V:

    response_hidden(model, batch)            -> ResponseRows: hidden [N, H], targets [N], (b, t) [N]
    token_logprobs_and_entropy(model, batch) -> logprobs [B, T] (grad), entropy [B, T] (no grad)
    rows_logprobs_and_entropy(hidden, weight, targets) -> the same on rows, for a plain head
    chunked_entropy(hidden, weight)          -> entropy [N], one [rows, chunk] tile at a time
    to_B_T(values_N, rows, shape)            -> [B, T] with zeros off the mask

The log-prob of the sampled token is minus the forward KL to a one-hot teacher, which is what
opd.kernels.fused_linear_distill_loss computes without [N, V] (Triton on CUDA, chunked PyTorch
on CPU) with its gradient to both hidden and lm_head.weight. The entropy is a metric only: it
is streamed under no_grad. A head the fused loss cannot see through (`opd.lm_head.head_form`:
a soft-cap or scale after it, a bias, a LoRA adapter on it) gets its logits for the N rows
only, [N, V], and rl/grpo.py's own functions on them: never [B, L, V] over prompt and padding.

Shapes are in the names: B sequences, L = prompt width + T columns, T response positions,
N real response tokens (the mask's ones, row-major), H hidden, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from opd.kernels import chunked
from opd.lm_head import HeadForm, head_form, last_hidden, parts
from opd.rl import grpo
from opd.rl.batch import PaddedRollouts
from opd.rope import rope_groups
from opd.spine import terms
from opd.spine.rows import token_logprobs

# Entropy tiles: rows per block, and about this many fp32 elements per [rows, chunk] tile
# (4 MiB: the size kernels/chunked.py found fast on CPU, large enough for BLAS).
ENTROPY_ROWS = 4096
ENTROPY_TILE_ELEMENTS = 1 << 20


class ResponseRows(NamedTuple):
    """The rows that predict real response tokens, in `mask_B_T.nonzero()` order (row-major)."""
    hidden_N_H: torch.Tensor   # the body's last hidden state at column start - 1 + t of sequence b
    targets_N: torch.Tensor    # long: the response token there, response_B_T[b, t]
    b_N: torch.Tensor          # long: its sequence
    t_N: torch.Tensor          # long: its response position


# ---- rows of a batch ----------------------------------------------------------------------

def _per_rope_group(model, batch: PaddedRollouts,
                    rows_of: Callable[[PaddedRollouts, torch.Tensor, torch.Tensor], torch.Tensor]) -> ResponseRows:
    """rows_of(sub_batch, b_n, col_n) -> [n, ...] for each forward pass the batch needs, put
    together in row-major order: ResponseRows whose first field holds what rows_of returned
    (hidden states, or for _response_logits_rows logits).

    One pass for the whole batch, or for a longrope model one per side of its switch length
    (opd.rope), as the model's own forward needs: a short sequence batched with a long one
    would otherwise get the long RoPE factors. A sub-batch keeps the batch's width, so every
    response still starts at column `start`.
    """
    device = next(model.parameters()).device
    groups = rope_groups(model, batch.attention_B_L.sum(1).tolist())
    outs, bs, ts = [], [], []
    for g in groups:
        index = torch.tensor(g)
        sub = batch if len(groups) == 1 else batch.rows(index)
        b_n, t_n = (sub.mask_B_T > 0).nonzero(as_tuple=True)
        outs.append(rows_of(sub, b_n.to(device), (batch.start - 1 + t_n).to(device)))
        bs.append(index[b_n])
        ts.append(t_n)
    b_N, t_N = torch.cat(bs), torch.cat(ts)
    values = torch.cat(outs)
    if len(groups) > 1:   # back to row-major order over the whole batch
        order = torch.argsort(b_N * batch.mask_B_T.shape[1] + t_N)
        b_N, t_N, values = b_N[order], t_N[order], values[order.to(device)]
    targets_N = batch.response_B_T[b_N, t_N].to(device)
    return ResponseRows(values, targets_N, b_N.to(device), t_N.to(device))


def _forward_args(sub: PaddedRollouts, device) -> dict:
    return dict(input_ids=sub.input_ids_B_L.to(device), attention_mask=sub.attention_B_L.to(device),
                position_ids=sub.position_B_L.to(device), use_cache=False)


def response_hidden(model, batch: PaddedRollouts) -> ResponseRows:
    """The decoder body's last hidden states [N, H] at the positions that predict each real
    response token (columns start - 1 ... start - 1 + T - 1, where mask_B_T is 1), with those
    tokens and their (b, t). The LM head does not run: nothing of size V is made here.
    Differentiable w.r.t. the body's parameters. (A model sharded with FSDP2 runs its own
    forward for them: opd.lm_head.last_hidden.)"""
    device = next(model.parameters()).device

    def hidden(sub, b_n, col_n):
        return last_hidden(model, **_forward_args(sub, device))[b_n, col_n]

    return _per_rope_group(model, batch, hidden)


def _response_logits_rows(model, batch: PaddedRollouts) -> ResponseRows:
    """Logits [N, V] of the N rows by the model's own forward (a head `head_form` cannot
    describe as post(lm_head(hidden))): the forward makes [B, L, V], but only its N rows are
    kept, and the log-softmax runs on those."""
    device = next(model.parameters()).device

    def logits(sub, b_n, col_n):   # the forward's own arguments (no use_cache, as a plain call)
        args = _forward_args(sub, device)
        args.pop("use_cache")
        return model(**args).logits[b_n, col_n]

    return _per_rope_group(model, batch, logits)


def to_B_T(values_N: torch.Tensor, rows: ResponseRows, shape: tuple[int, int]) -> torch.Tensor:
    """[B, T] with values_N at (rows.b_N, rows.t_N) and 0 elsewhere; differentiable w.r.t.
    values_N (the gradient of the zeros goes nowhere)."""
    return values_N.new_zeros(shape).index_put((rows.b_N, rows.t_N), values_N)


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

def token_logprobs_and_entropy(model, batch: PaddedRollouts, *, with_entropy: bool = True,
                               chunk: int | None = None, impl: str = "auto",
                               entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logprobs_B_T, entropy_B_T) of the sampled response tokens, fp32 on the model's device,
    0 where mask_B_T is 0: what spine.rows.token_logprobs and grpo.entropy give there on the model's
    own [B, T, V] logits (tests/oracles.py:response_logits), without [B, T, V].

    logprobs_B_T carries the gradient to the model; entropy_B_T (None unless with_entropy) has
    none, unless entropy_grad (a term trains it, opd.spine.terms): then the rows' logits [N, V]
    are held, as for any other head. A plain head (`head_form(model).fusable`) goes through rows_logprobs_and_entropy:
    memory beyond the model is O(N x H + N x chunk) plus the head's weight gradient. Any other
    head (soft-cap, scale, bias, LoRA on lm_head) gets logits for the N rows only, [N, V]:
    post(lm_head(hidden)) when head_form knows `post`, else the rows of the model's own forward.
    """
    shape = tuple(batch.mask_B_T.shape)
    # A model without a transformers body / LM head split (a test's stand-in) uses its own forward.
    form = head_form(model) if hasattr(model, "get_decoder") or hasattr(model, "get_base_model") \
        else HeadForm(None, False)
    if form.fusable and not entropy_grad:
        rows = response_hidden(model, batch)
        _, head = parts(model)
        lp_N, ent_N = rows_logprobs_and_entropy(rows.hidden_N_H, head.weight, rows.targets_N,
                                                with_entropy=with_entropy, chunk=chunk, impl=impl)
    else:
        if form.post is not None or form.fusable:
            rows = response_hidden(model, batch)
            _, head = parts(model)
            logits_N_V = head(rows.hidden_N_H) if form.post is None else form.post(head(rows.hidden_N_H))
        else:
            rows = _response_logits_rows(model, batch)
            logits_N_V = rows.hidden_N_H      # this ResponseRows holds the rows' logits
        lp_N = token_logprobs(logits_N_V, rows.targets_N)
        ent_N = (terms.entropy(logits_N_V) if entropy_grad else grpo.entropy(logits_N_V.detach())) \
            if with_entropy else None
    lp_B_T = to_B_T(lp_N.float(), rows, shape)
    ent_B_T = to_B_T(ent_N.float(), rows, shape) if ent_N is not None else None
    return lp_B_T, ent_B_T
