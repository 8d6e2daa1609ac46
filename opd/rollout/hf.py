"""Rollouts with transformers `generate`: the reference engine, exact and slow."""

from __future__ import annotations

import torch

from opd.rollout.base import Rollout, RolloutEngine, SamplingParams


class HFRolloutEngine(RolloutEngine):
    """Samples from the very model object the trainer updates, so it is always on-policy."""

    def __init__(self, model, tokenizer, *, batch_size: int = 64):
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def sync_weights(self, model) -> None:
        self.model = model  # same object as the trainer's: nothing to copy

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Rollout]:
        out: list[Rollout] = []
        if params.seed is not None:
            torch.manual_seed(params.seed)
        expanded = [(i, p) for i, p in enumerate(prompts) for _ in range(params.n)]
        for start in range(0, len(expanded), self.batch_size):
            out.extend(self._generate_batch(expanded[start:start + self.batch_size], params))
        return out

    def _generate_batch(self, items: list[tuple[int, list[int]]], params: SamplingParams) -> list[Rollout]:
        model = self.model
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        width = max(len(p) for _, p in items)
        # Left padding so every prompt ends at the same column and generation continues it.
        input_ids = torch.full((len(items), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(items), width), dtype=torch.long)
        for r, (_, p) in enumerate(items):
            input_ids[r, width - len(p):] = torch.tensor(p)
            attn[r, width - len(p):] = 1
        stops = sorted({self.tokenizer.eos_token_id, *params.stop_token_ids} - {None})
        greedy = params.temperature <= 0
        gen = model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attn.to(device),
            do_sample=not greedy,
            temperature=None if greedy else params.temperature,
            top_p=None if greedy else params.top_p,
            top_k=0 if not greedy else None,
            max_new_tokens=params.max_new_tokens,
            eos_token_id=stops,
            pad_token_id=self.pad_id,
            return_dict_in_generate=True,
            output_logits=True,  # raw logits, before temperature/top-p
        )
        model.train(was_training)
        new = gen.sequences[:, width:].cpu()
        # [B, steps, V] -> raw log-probs of the sampled tokens
        logits = torch.stack(gen.logits, dim=1).float().cpu()
        lp = torch.log_softmax(logits, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        rollouts = []
        for r, (pi, p) in enumerate(items):
            resp, lps, reason = [], [], "length"
            for t in range(new.shape[1]):
                tok = int(new[r, t])
                resp.append(tok)
                lps.append(float(lp[r, t]))
                if tok in stops:
                    reason = "eos"
                    break
            rollouts.append(Rollout(prompt_ids=list(p), response_ids=resp, logprobs=lps,
                                    finish_reason=reason, prompt_index=pi))
        return rollouts
