"""Rollouts with transformers models and a plain KV-cached decoding loop: the reference engine.

One prefill, then one forward of one token per step, sampling what `model.generate` samples
(greedy: the same tokens; otherwise temperature, then transformers' top-p rule, then one
exact draw from the resulting distribution). These things make it faster than `generate` on
small models, where Python per step, not arithmetic, is the cost (measured in
docs/benchmarks.md, "The hf rollout engine's decode loop"):
  - no per-step generate machinery (logits processors, stopping criteria, cache bookkeeping);
  - for full-attention models under SDPA, the 4-D boolean attention mask is built here and
    grown by one column per step; transformers would rebuild it from the 2-D mask every
    step. Other models get the 2-D mask and build their own;
  - the draw inverts the cumulative distribution with one uniform per row, exact like
    `torch.multinomial` and far cheaper at real vocabulary sizes; the random stream
    therefore differs from generate's, the distribution does not;
  - the LM head of a decode step is computed as (W @ h.T).T rather than F.linear(h, W): the
    same product, for which MKL picks a far better kernel when h has a few rows (`python -m
    opd.benchmarks.step_profile`). Where logits are not a plain head's output (a LoRA adapter
    on it, a soft-cap, a sharded model) the model's own forward runs;
  - on the CPU, so are the body's nn.Linear layers while fewer than 8 rows go through them
    (`few_row_linears`); from 8 rows on the two forms are within the noise (`step_profile
    --linears`).
"""

from __future__ import annotations

import types
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from opd.lm_head import head_form, parts
from opd.rollout.base import Rollout, RolloutEngine, SamplingParams, eos_ids


def top_p_filter(logits_B_V: torch.Tensor, top_p: float) -> torch.Tensor:
    """transformers' `TopPLogitsWarper`: set to -inf the tokens outside the nucleus.

    Sort ascending, take the cumulative softmax, drop the tokens whose cumulative probability
    is <= 1 - top_p (the improbable tail), and always keep the most probable token.
    """
    if top_p >= 1.0:
        return logits_B_V  # generate adds no warper then (it would drop underflowed tokens)
    sorted_B_V, order_B_V = torch.sort(logits_B_V, descending=False)
    cum_B_V = sorted_B_V.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted_B_V = cum_B_V <= (1 - top_p)
    drop_sorted_B_V[..., -1:] = False
    drop_B_V = drop_sorted_B_V.scatter(-1, order_B_V, drop_sorted_B_V)
    return logits_B_V.masked_fill(drop_B_V, float("-inf"))


def pick_tokens(logits_B_V: torch.Tensor, temperature: float, top_p: float,
                share: tuple[int, int] | None = None) -> torch.Tensor:
    """[B, V] float logits -> [B] token ids: argmax if temperature <= 0, else temperature,
    then top-p, then one exact draw per row from the global RNG (seeded by `params.seed`).
    share (first row, rows in all): these B rows are part of a bigger batch: the draws are
    that batch's, rows first..first+B of them (rows past its end, a rank's padding, draw 0.5)."""
    if temperature <= 0:
        return logits_B_V.argmax(dim=-1)
    probs_B_V = top_p_filter(logits_B_V / temperature, top_p).softmax(dim=-1)
    # Inverse CDF: one uniform per row, the first token whose cumulative probability exceeds
    # it. fp64 so the sum over 152k tokens does not drift; a token of probability 0 (cut by
    # top-p) adds no width and is never chosen. One pass instead of one random number per
    # token (docs/benchmarks.md).
    cdf_B_V = probs_B_V.double().cumsum(dim=-1)
    B = cdf_B_V.shape[0]
    first, rows = share if share is not None else (0, B)
    u_B_1 = torch.rand(rows, 1, dtype=torch.float64, device=cdf_B_V.device)[first:first + B]
    if len(u_B_1) < B:   # rows past the whole batch's (a rank's padding): a fixed draw, not the stream's
        u_B_1 = torch.cat([u_B_1, u_B_1.new_full((B - len(u_B_1), 1), 0.5)])
    u_B_1 = u_B_1 * cdf_B_V[:, -1:]
    return torch.searchsorted(cdf_B_V, u_B_1, right=True).squeeze(1)


def last_logits(model, sharded: bool) -> Callable[..., torch.Tensor]:
    """forward(**inputs) -> fp32 logits [B, V] of the last position, as `model(**inputs)` gives
    them; for a plain nn.Linear head, as (W @ h.T).T of the body's last hidden state h [B, H]
    (the module docstring says why)."""
    def whole(**inputs) -> torch.Tensor:
        return model(**inputs, logits_to_keep=1).logits[:, -1].float()

    if sharded:   # FSDP2: the root's forward gathers the body's and the head's shards
        return whole
    body, head = parts(model)
    post = head_form(model).post
    if post is None or type(head) is not torch.nn.Linear:
        return whole

    def transposed(**inputs) -> torch.Tensor:
        return post(transposed_linear(body(**inputs).last_hidden_state[:, -1], head.weight, head.bias)).float()
    return transposed


def transposed_linear(x_M_K: torch.Tensor, w_N_K: torch.Tensor, b_N: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, w, b) for x [M, K] as (w @ x.T).T: the same product, [M, N] contiguous."""
    z_N_M = w_N_K @ x_M_K.T
    if b_N is not None:
        z_N_M = z_N_M + b_N[:, None]
    return z_N_M.T.contiguous()


FEW_ROWS = 8   # fewer rows than this through a linear: the transposed product (measured, module docstring)


def _few_row_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    if rows >= FEW_ROWS:
        return F.linear(x, self.weight, self.bias)
    return transposed_linear(x.reshape(rows, x.shape[-1]), self.weight, self.bias).reshape(*x.shape[:-1], -1)


@contextmanager
def few_row_linears(model, sharded: bool) -> Iterator[None]:
    """While inside: every plain nn.Linear of `model` on the CPU computes inputs of fewer than
    FEW_ROWS rows as `transposed_linear` (a decode step's rows), others as F.linear. Its
    instances' forward is replaced and restored on exit; subclasses (peft's LoRA layers wrap a
    plain base layer, which is covered) and FSDP2's sharded modules keep their own."""
    linears = [] if sharded else [m for m in model.modules()
                                  if type(m) is torch.nn.Linear and m.weight.device.type == "cpu"]
    for m in linears:
        m.forward = types.MethodType(_few_row_forward, m)
    try:
        yield
    finally:
        for m in linears:
            del m.forward


def _builds_own_mask(config) -> bool:
    """True when this loop may hand the model a ready 4-D boolean mask: SDPA attention and
    every layer full causal attention (a sliding window would need a banded mask)."""
    layer_types = getattr(config, "layer_types", None) or []
    sliding = getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)
    return (getattr(config, "_attn_implementation", None) == "sdpa" and not sliding
            and all(t == "full_attention" for t in layer_types))


class HFRolloutEngine(RolloutEngine):
    """Samples from the very model object the trainer updates, so it is always on-policy."""

    def __init__(self, model, tokenizer, *, batch_size: int = 64, agree: Callable[[bool], bool] = bool,
                 sharded: bool = False):
        """agree(flag): whether every process holding a shard of `model` says `flag` (a sharded
        model's forward is a collective, so its ranks stop decoding together; one process: the
        flag itself). sharded: `model` is an FSDP2 module: sampling runs under no_grad rather
        than inference_mode, whose tensors FSDP would keep as the buffers it gathers layers
        into, which training's forward then cannot write."""
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.agree = agree
        self.sharded = sharded
        # partial(rows): called at a quarter, half and three quarters of max_new_tokens with each
        # row's (prompt index, tokens so far), for a teacher to prefill them (opd.distill.trainer).
        self.partial: Callable[[list[tuple[int, list[int]]]], None] | None = None
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def sync_weights(self, model) -> None:
        self.model = model  # same object as the trainer's: nothing to copy

    # inference_mode rather than no_grad: no version counters or view tracking per op, which
    # weigh on a small model's decode step of many small ops (docs/benchmarks.md). Nothing
    # made here outlives the call but Python lists, and buffers a dynamic RoPE replaces, which
    # training then reads without saving them for backward (tests/rollout/test_hf_rollout.py).
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Rollout]:
        with torch.no_grad() if self.sharded else torch.inference_mode():
            return self._generate(prompts, params)

    def _generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Rollout]:
        out: list[Rollout] = []
        if params.seed is not None:
            torch.manual_seed(params.seed)
        expanded = [(i, p) for i, p in enumerate(prompts) for _ in range(params.n)]
        # A share of a batch that fits one of this engine's batches draws that batch's numbers.
        share = params.share if params.share is not None and params.share[1] <= self.batch_size else None
        model = self.model
        was_training = model.training
        model.eval()  # no dropout while sampling
        try:
            with few_row_linears(model, self.sharded):
                for start in range(0, len(expanded), self.batch_size):
                    out.extend(self._generate_batch(expanded[start:start + self.batch_size], params, share))
        finally:
            model.train(was_training)
        return out

    def _generate_batch(self, items: list[tuple[int, list[int]]], params: SamplingParams,
                        share: tuple[int, int] | None = None) -> list[Rollout]:
        if params.max_new_tokens <= 0:
            return [Rollout(list(p), [], [], "length", prompt_index=pi) for pi, p in items]
        model = self.model
        device = next(model.parameters()).device
        B, width = len(items), max(len(p) for _, p in items)
        # Left padding so every prompt ends at the same column and each step appends one column.
        ids_B_P = torch.full((B, width), self.pad_id, dtype=torch.long)
        mask_B_P = torch.zeros((B, width), dtype=torch.long)
        for r, (_, p) in enumerate(items):
            ids_B_P[r, width - len(p):] = torch.tensor(p)
            mask_B_P[r, width - len(p):] = 1
        ids_B_P, mask = ids_B_P.to(device), mask_B_P.to(device)
        # Positions count real tokens only, so a padded prompt sees the same RoPE phases as alone.
        pos_B_P = (mask.cumsum(-1) - 1).clamp(min=0)
        stops = torch.tensor(sorted(eos_ids(self.tokenizer, getattr(model, "generation_config", None))
                                    | set(params.stop_token_ids)), dtype=torch.long, device=device)

        cache = DynamicCache(config=model.config)
        own_mask = _builds_own_mask(model.config)
        keys_B_K = mask.bool()  # which cached positions are real tokens (K grows by one per step)
        if own_mask:  # [B, 1, P, P]: causal and not padding, True = attend
            causal_P_P = torch.ones(width, width, dtype=torch.bool, device=device).tril()
            attn = causal_P_P[None, None] & keys_B_K[:, None, None, :]
        else:
            attn = mask
        # Prefill; the LM head runs on the last position only.
        forward = last_logits(model, self.sharded)
        logits_B_V = forward(input_ids=ids_B_P, attention_mask=attn, position_ids=pos_B_P, past_key_values=cache,
                             use_cache=True)
        next_pos_B = pos_B_P[:, -1] + 1
        done_B = torch.zeros(B, dtype=torch.bool, device=device)
        toks, lps, tops = [], [], []  # per step: [B] token ids, [B] raw log-probs, [B, k] top ids
        for step in range(params.max_new_tokens):
            tok_B = pick_tokens(logits_B_V, params.temperature, params.top_p, share)
            # Raw log-prob: temperature 1, before top-p (what a plain forward pass gives).
            lps.append(torch.log_softmax(logits_B_V, dim=-1).gather(1, tok_B[:, None]).squeeze(1))
            if params.topk:
                tops.append(logits_B_V.topk(params.topk, dim=-1).indices)
            toks.append(tok_B)
            done_B |= torch.isin(tok_B, stops)
            if step + 1 == params.max_new_tokens or self.agree(bool(done_B.all())):
                break
            quarter = params.max_new_tokens // 4
            if self.partial is not None and quarter >= 2 and (step + 1) % quarter == 0:
                so_far = torch.stack(toks, dim=1).tolist()
                self.partial([(pi, row) for (pi, _), row in zip(items, so_far)])
            # Stopped rows keep decoding (their tokens are cut below): one static batch.
            keys_B_K = torch.cat([keys_B_K, keys_B_K.new_ones(B, 1)], dim=1)
            attn = keys_B_K[:, None, None, :] if own_mask else keys_B_K.long()  # [B, 1, 1, K] or [B, K]
            logits_B_V = forward(input_ids=tok_B[:, None], attention_mask=attn, position_ids=next_pos_B[:, None],
                                 past_key_values=cache, use_cache=True)
            next_pos_B = next_pos_B + 1

        new_B_T = torch.stack(toks, dim=1).cpu()
        lp_B_T = torch.stack(lps, dim=1).cpu()
        top_B_T_K = torch.stack(tops, dim=1).cpu() if tops else None
        is_stop_B_T = torch.isin(new_B_T, stops.cpu())
        rollouts = []
        for r, (pi, p) in enumerate(items):
            hits = is_stop_B_T[r].nonzero()
            end, reason = (int(hits[0]) + 1, "eos") if len(hits) else (new_B_T.shape[1], "length")
            rollouts.append(Rollout(prompt_ids=list(p), response_ids=new_B_T[r, :end].tolist(),
                                    logprobs=lp_B_T[r, :end].tolist(), finish_reason=reason, prompt_index=pi,
                                    topk_ids=None if top_B_T_K is None else top_B_T_K[r, :end].tolist()))
        return rollouts
