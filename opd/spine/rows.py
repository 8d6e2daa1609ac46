"""Response rows: from rollouts to the rows a loss is taken over, for every loop.

Shapes use suffixes: B sequences, L padded length, N response rows (all sequences'
response tokens concatenated, sequence by sequence), V vocabulary, H hidden, k top-k.

Row convention (the same as the teacher protocol): row i of sequence b is the token at
position p_b + i, where p_b = len(prompt_b); the student's distribution for it comes from
the logits at position p_b + i - 1. Only response rows carry loss: prompt and padding
positions are masked out, and rows after the answer's end are trimmed off before the
teacher ever sees them. A multi-turn trajectory (opd.agent) also masks out the response
tokens the model did not sample (tool observations, the template between turns): they are
context, and its rows are its kept assistant tokens alone (`trim_turns`, `pack(masks=)`).

Per-row weights implement the merge loss  sum_d lambda_d * L^d  where L^d is domain d's
mean loss (per token, or per sequence then over sequences). Weights are computed over the
whole step batch before it is cut into micro-batches, so the step's loss and gradient do
not depend on the micro-batch size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch.distributed.fsdp import FSDPModule

from opd.kernels import TopKTeacher, fused_linear_distill_loss
from opd.lm_head import FUSED_REFUSED, HeadForm, head_form, last_hidden, parts
from opd.rope import rope_groups


# ---- trimming ---------------------------------------------------------------------------

def trim_length(response_ids: list[int], *, eos_ids: set[int], trim: str, marker: str | None = None,
                tokenizer=None) -> int:
    """How many response tokens to keep: all of them, through the first EOS, or through the
    token that completes the first occurrence of `marker` (whichever comes first)."""
    n = len(response_ids)
    if trim == "none":
        return n
    keep = n
    for i, t in enumerate(response_ids):
        if t in eos_ids:
            keep = i + 1
            break
    if trim == "marker" and marker:
        if marker in tokenizer.decode(response_ids[:keep]):
            # Smallest prefix whose text holds the marker (monotone in the prefix length).
            lo, hi = 1, keep
            while lo < hi:
                mid = (lo + hi) // 2
                if marker in tokenizer.decode(response_ids[:mid]):
                    hi = mid
                else:
                    lo = mid + 1
            keep = lo
    return keep


def trim_turns(rollout, trim_fn) -> tuple[int, list[bool] | None]:
    """(keep, mask) of a rollout: how many response tokens stay in the sequence, and per kept
    token whether it is a row (trained, scored); mask None for a single turn (every kept
    token a row, keep = trim_fn(response)). Each assistant turn (a run of `rollout.mask` ones)
    is trimmed by trim_fn(its ids) -> kept length (`trim_length`'s rule); what a turn loses is
    context for the turns after it (mask 0), and keep ends at the last row, so a trailing
    observation is never sent."""
    ids = rollout.response_ids
    if rollout.mask is None:
        return trim_fn(ids), None
    mask = [False] * len(ids)
    i = 0
    while i < len(ids):
        if not rollout.mask[i]:
            i += 1
            continue
        j = i
        while j < len(ids) and rollout.mask[j]:
            j += 1
        k = trim_fn(ids[i:j])
        mask[i:i + k] = [True] * k
        i = j
    keep = max((k + 1 for k, m in enumerate(mask) if m), default=0)
    return keep, mask[:keep]


# ---- packing and masks ------------------------------------------------------------------

@dataclass
class Packed:
    """A right-padded batch and where its response rows are."""
    input_ids_B_L: torch.Tensor       # long, padding = pad_id
    attention_B_L: torch.Tensor       # long, 1 on real tokens
    row_b_N: torch.Tensor             # long, sequence of each row
    row_pos_N: torch.Tensor           # long, logit position that predicts the row's token
    targets_N: torch.Tensor           # long, the row's token
    row_offsets: list[int]            # [B + 1]: sequence b owns rows row_offsets[b]:row_offsets[b+1]


def response_mask(prompt_lens: list[int], response_lens: list[int], length: int) -> torch.Tensor:
    """bool [B, length]: True at logit positions whose next token is a response token.

    Position t predicts token t + 1, so sequence b's rows sit at t = p_b - 1 ... p_b + n_b - 2.
    Prompt positions and right padding are False.
    """
    mask = torch.zeros(len(prompt_lens), length, dtype=torch.bool)
    for b, (p, n) in enumerate(zip(prompt_lens, response_lens)):
        mask[b, p - 1:p - 1 + n] = True
    return mask


def pack(prompts: list[list[int]], responses: list[list[int]], pad_id: int,
         masks: list[list[bool] | None] | None = None) -> Packed:
    """Right-pad prompt + response sequences and index their response rows. masks[b] (bools
    over responses[b], None: all True): which response tokens are rows; the others (a
    trajectory's tool observations) are in the sequence as context only."""
    if any(len(p) < 1 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    lens = [len(p) + len(r) for p, r in zip(prompts, responses)]
    width = max(lens)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(prompts), width), dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        ids[b, :lens[b]] = torch.tensor(p + r, dtype=torch.long)
        attn[b, :lens[b]] = 1
    mask = response_mask([len(p) for p in prompts], [len(r) for r in responses], width)
    masks = masks or [None] * len(prompts)
    for b, (p, r, m) in enumerate(zip(prompts, responses, masks)):
        if m is not None:
            if len(m) != len(r):
                raise ValueError(f"sequence {b}: a row mask of {len(m)} for {len(r)} response tokens")
            mask[b, len(p) - 1:len(p) - 1 + len(r)] = torch.tensor(m, dtype=torch.bool)
    row_b, row_pos = mask.nonzero(as_tuple=True)      # row-major: sequence by sequence, in order
    offsets = [0]
    for r, m in zip(responses, masks):
        offsets.append(offsets[-1] + (len(r) if m is None else sum(map(bool, m))))
    return Packed(ids, attn, row_b, row_pos, ids[row_b, row_pos + 1], offsets)


# ---- per-row weights (normalization) ----------------------------------------------------

def group_counts(row_offsets: list[int], groups: list[str]) -> dict[str, float]:
    """{"tokens/<g>": rows of group g, "seqs/<g>": its sequences with rows}: what `row_weights`
    normalizes by (summed over the ranks when the batch is one rank's share of a step)."""
    counts: dict[str, float] = {}
    for b, g in enumerate(groups):
        n = row_offsets[b + 1] - row_offsets[b]
        if n > 0:
            counts[f"tokens/{g}"] = counts.get(f"tokens/{g}", 0) + n
            counts[f"seqs/{g}"] = counts.get(f"seqs/{g}", 0) + 1
    return counts


def sequence_weights(lengths: list[int], groups: list[str], group_weight: dict[str, float],
                     norm: Literal["token", "sequence", "constant"], counts: dict[str, float],
                     max_tokens: int | None = None) -> list[float]:
    """The weight w_b of every token of sequence b, so that sum_b w_b * (its tokens' summed loss)
    = sum_g lambda_g * L^g, L^g the loss of group g aggregated as `norm` says:

        token      its tokens' mean (DAPO's token mean)                      lambda_g / tokens_g
        sequence   the mean over its sequences of each one's token mean     lambda_g / (seqs_g * len_b)
                   (GRPO's)
        constant   its tokens' sum over seqs_g * max_tokens (Dr. GRPO's:    lambda_g / (seqs_g * max_tokens)
                   no length bias either way)

    The one loss aggregation of opd train (`row_weights`, groups the domains) and opd rl
    (`rl.grpo.aggregate`, one group). counts: {"tokens/<g>", "seqs/<g>"} (`group_counts`, or the
    whole step's when the sequences are one micro-batch or one rank's share of it); a sequence
    without tokens gets 0."""
    out = []
    for g, n in zip(groups, lengths):
        if n == 0:
            out.append(0.0)
            continue
        lam, tokens, seqs = group_weight.get(g, 1.0), counts[f"tokens/{g}"], counts[f"seqs/{g}"]
        out.append(lam / max(tokens, 1.0) if norm == "token" else
                   lam / max(seqs * n, 1.0) if norm == "sequence" else
                   lam / max(seqs * max_tokens, 1.0))
    return out


def row_weights(row_offsets: list[int], groups: list[str], group_weight: dict[str, float],
                length_norm: Literal["token", "sequence"], counts: dict[str, float] | None = None) -> torch.Tensor:
    """fp32 [N]: the weight of each row so that sum(w * loss_row) = sum_g lambda_g * L^g.

    groups[b] is sequence b's group (domain); L^g is the mean over g's rows ("token") or
    the mean over g's sequences of each sequence's mean row loss ("sequence"): `sequence_weights`.
    Sequences without rows contribute nothing. counts: `group_counts` of the whole step when
    these rows are one rank's share of it (then the ranks' weighted sums add up to L).
    """
    lens = [row_offsets[b + 1] - row_offsets[b] for b in range(len(groups))]
    counts = group_counts(row_offsets, groups) if counts is None else counts
    per_seq = sequence_weights(lens, groups, group_weight, length_norm, counts)
    return torch.tensor(per_seq, dtype=torch.float32).repeat_interleave(torch.tensor(lens, dtype=torch.long))


# ---- the student side -------------------------------------------------------------------

def student_rows(model, packed: Packed, *, fused: bool):
    """The student's response rows: logits [N, V], or (hidden [N, H], lm_head weight [V, H]) when fused.

    Both run the decoder body, gather the N response rows of [B, L, H], and (not fused) apply
    the LM head to those rows only: [B, L, V] logits, prompt and padding positions included,
    are never built (how much larger they would be: docs/benchmarks.md). What the model applies after
    its head (a soft-cap, a scale) is applied to those rows too; a model whose logits are not of
    that form goes through its own forward (`head_form`). One whose logits are not
    hidden @ lm_head.weight.T cannot be fused: ValueError (`opd train` refuses the config first).
    A longrope model gets one pass per side of its switch length (opd.rope), so that each
    sequence's rows are what they are alone.
    """
    form = rows_head_form(model)
    if fused and not form.fusable:
        raise ValueError(FUSED_REFUSED)
    groups = rope_groups(model, packed.attention_B_L.sum(1).tolist())
    if len(groups) > 1:   # a longrope model: each side of its switch length in a pass of its own
        outs = [_student_rows(model, subset(packed, g), fused, form) for g in groups]
        # outs' rows, concatenated, are packed's rows `order`: index them back into packed's order
        order = torch.cat([rows_of(packed, g) for g in groups])
        if fused:
            hidden = torch.cat([h for h, _ in outs])
            return hidden[torch.argsort(order).to(hidden.device)], outs[0][1]
        logits = torch.cat(outs)
        return logits[torch.argsort(order).to(logits.device)]
    return _student_rows(model, packed, fused, form)


def rows_head_form(model) -> HeadForm:
    """`head_form(model)`, what `student_rows` can do with the model's head; a model without a
    transformers body / LM head split (a test's stand-in) has none it knows: its own forward."""
    if hasattr(model, "get_decoder") or hasattr(model, "get_base_model"):
        return head_form(model)
    return HeadForm(None, False)


def _student_rows(model, packed: Packed, fused: bool, form):
    device = next(model.parameters()).device
    ids, attn = packed.input_ids_B_L.to(device), packed.attention_B_L.to(device)
    b, pos = packed.row_b_N.to(device), packed.row_pos_N.to(device)
    if not fused and form.post is None:
        return model(input_ids=ids, attention_mask=attn, use_cache=False).logits[b, pos]
    _, head = parts(model)
    embed = _tied_embedding(model, head)
    inputs = {"input_ids": ids} if embed is None else {"inputs_embeds": _RowsEmbedding.apply(ids, embed.weight,
                                                                                           embed.padding_idx)}
    hidden_N_H = last_hidden(model, **inputs, attention_mask=attn, use_cache=False)[b, pos]
    return (hidden_N_H, head.weight) if fused else form.post(head(hidden_N_H))


def _tied_embedding(model, head):
    """The input embedding when it is a plain nn.Embedding whose weight is the trained LM head's
    (tied, as in small Llama, Qwen and SmolLM models), else None."""
    if isinstance(model, FSDPModule) or not torch.is_grad_enabled():
        return None
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    embed = base.get_input_embeddings()
    if type(embed) is not torch.nn.Embedding or embed.max_norm is not None or embed.sparse:
        return None
    return embed if embed.weight is head.weight and embed.weight.requires_grad else None


class _RowsEmbedding(torch.autograd.Function):
    """nn.Embedding's lookup whose weight gradient is sparse: the rows of the looked-up ids.

    A tied LM head's gradient is dense anyway, and autograd adds this one into it row by row;
    the dense embedding backward would build a zero [V, H] tensor, scatter into it and add all
    V rows (at V = 49,152, H = 576: 113 MB written, then read, per backward). The same sums;
    the padding row gets none, as nn.Embedding(padding_idx=...) gives it."""

    @staticmethod
    def forward(ctx, ids, weight, padding_idx):
        ctx.save_for_backward(ids)
        ctx.shape, ctx.padding_idx = weight.shape, padding_idx
        return torch.nn.functional.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        ids, grad = ids.reshape(-1), grad.reshape(-1, grad.shape[-1])
        if ctx.padding_idx is not None:
            keep = ids != ctx.padding_idx
            ids, grad = ids[keep], grad[keep]
        return None, torch.sparse_coo_tensor(ids[None], grad, ctx.shape, check_invariants=False), None


def rows_of(packed: Packed, seqs: list[int]) -> torch.Tensor:
    """long [n]: the indices in `packed` of the rows of sequences `seqs`, in order."""
    o = packed.row_offsets
    return torch.cat([torch.arange(o[b], o[b + 1]) for b in seqs]) if len(seqs) else torch.zeros(0, dtype=torch.long)


def subset(packed: Packed, seqs: list[int]) -> Packed:
    """The batch of sequences `seqs` alone, as `pack` would have built it (no sequences: the
    batch's width, no rows; a sharded model's rank still runs its passes on it)."""
    seqs = [int(b) for b in seqs]
    index = torch.tensor(seqs, dtype=torch.long)
    width = int(packed.attention_B_L[index].sum(1).max()) if seqs else packed.input_ids_B_L.shape[1]
    ids, attn = packed.input_ids_B_L[index, :width], packed.attention_B_L[index, :width]
    rows = rows_of(packed, seqs)
    new_b = torch.full((len(packed.row_offsets) - 1,), -1, dtype=torch.long)
    new_b[index] = torch.arange(len(seqs))
    offsets = [0]
    for b in seqs:
        offsets.append(offsets[-1] + packed.row_offsets[b + 1] - packed.row_offsets[b])
    return Packed(ids, attn, new_b[packed.row_b_N[rows]], packed.row_pos_N[rows], packed.targets_N[rows], offsets)


def token_logprobs(rows, targets: torch.Tensor, *, temperature: float = 1.0, impl: str = "auto") -> torch.Tensor:
    """fp32 log-probs of the sampled tokens under softmax(logits / temperature), with grad: the
    one way opd train, opd rl and their tests take them. rows: logits [..., V] (targets [...]),
    or (hidden [N, H], lm_head weight [V, H]) as `student_rows` gives a plain head (targets [N]).
    The second form never holds [N, V]: the log-prob is -KL(one-hot(target) || student), the
    fused loss's forward KL (beta 0) to a top-1 teacher holding all the mass, whose gradient is
    softmax - one-hot, that of log_softmax.gather (impl as the fused loss takes it); the
    temperature divides the hidden states, as (hidden / T) @ W.T = logits / T."""
    if isinstance(rows, tuple):
        hidden, weight = rows
        hidden = hidden if temperature == 1.0 else hidden / temperature
        n = hidden.shape[0]
        one_hot = TopKTeacher(targets[:, None].long(), torch.zeros(n, 1, dtype=torch.float32, device=hidden.device),
                              torch.full((n,), float("-inf"), dtype=torch.float32, device=hidden.device))
        return -fused_linear_distill_loss(hidden, weight, one_hot, beta=0.0, reduction="none", impl=impl)
    return torch.log_softmax(rows.float() / temperature, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def rows_logits(rows, chunk: int = 4096) -> torch.Tensor:
    """Student logits [N, V] without grad from either form of `student_rows` (for diagnostics)."""
    if isinstance(rows, tuple):
        hidden, weight = rows
        with torch.no_grad():
            return torch.cat([hidden[a:a + chunk].detach() @ weight.detach().T
                              for a in range(0, max(len(hidden), 1), chunk)])[:len(hidden)]
    return rows.detach()


def take_rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t[index], without the copy when index is every row in order (one teacher for the whole
    micro-batch, the usual case: at V = 152,064 a copy of 256 rows is 155 MB). `t` may also be
    a full-mode teacher stream (opd.teachers.session.RowStream), which gathers rows itself."""
    if not isinstance(t, torch.Tensor):
        return t[index]
    n, index = len(t), index.to(t.device)
    if len(index) == n and bool((index == torch.arange(n, device=t.device)).all()):
        return t
    return t[index]


def select_rows(rows, index: torch.Tensor):
    """Rows `index` of either form of `student_rows` (`take_rows` of the logits or hidden states)."""
    if isinstance(rows, tuple):
        return take_rows(rows[0], index), rows[1]
    return take_rows(rows, index)


def padded_cross_entropy(model, input_B_L: torch.Tensor, labels_B_L: torch.Tensor,
                          mask_B_L: torch.Tensor | None = None, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross-entropy of a right-padded batch over the tokens whose label is not -100:
    their mean, or their sum (`reduction`): `opd sft`'s loss. A longrope
    model gets one pass per side of its switch length (opd.rope), each cut to its last real
    column, so no sequence's loss depends on its batch."""
    def cross_entropy(rows=slice(None), width=None, reduction=reduction) -> torch.Tensor:
        logits = model(input_ids=input_B_L[rows, :width],
                       attention_mask=None if mask_B_L is None else mask_B_L[rows, :width]).logits[:, :-1]
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                 labels_B_L[rows, 1:width].reshape(-1), ignore_index=-100,
                                                 reduction=reduction)

    groups = [[]] if mask_B_L is None else rope_groups(model, mask_B_L.sum(1).tolist())
    if len(groups) == 1:
        return cross_entropy()
    total = sum(cross_entropy(g, int(mask_B_L[g].any(0).nonzero().max()) + 1, "sum") for g in map(torch.tensor, groups))
    return total if reduction == "sum" else total / (labels_B_L[:, 1:] != -100).sum()


def sft_loss(model, prompts: list[list[int]], responses: list[list[int]], pad_id: int,
             tokens: float | None = None) -> torch.Tensor:
    """Mean cross-entropy of the reference response tokens given their prompts. tokens: the
    response tokens of the whole step when these pairs are one rank's share of it (their summed
    cross-entropy over that count)."""
    packed = pack(prompts, responses, pad_id)
    logits_N_V = student_rows(model, packed, fused=False).float()
    targets = packed.targets_N.to(logits_N_V.device)
    if tokens is None:
        return torch.nn.functional.cross_entropy(logits_N_V, targets)
    return torch.nn.functional.cross_entropy(logits_N_V, targets, reduction="sum") / max(tokens, 1.0)
