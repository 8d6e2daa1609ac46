"""GRPO's batch as tensors: rollouts left-padded so every response starts at one column.

    collate(rollouts, pad_id) -> PaddedRollouts   ids, masks, positions, the rollout log-probs

A multi-turn trajectory (opd.agent) is one rollout whose response holds the model's turns and
the tool observations between them: all of it is in the input (the context each turn saw),
and `mask_B_T` is 1 only on the tokens the model sampled (`Rollout.sampled`), so the loss, the
KL, the entropy, every normalizer and the teachers' terms count assistant tokens alone.

The policy's log-probs of a batch are rl/logprobs.py's (never [B, T, V]); the plain [B, T, V]
computation they are held to is tests/oracles.py:response_logits.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class PaddedRollouts:
    """A batch of rollouts as tensors, every response starting at column `start`."""
    input_ids_B_L: torch.Tensor
    attention_B_L: torch.Tensor
    position_B_L: torch.Tensor
    response_B_T: torch.Tensor      # response token ids
    mask_B_T: torch.Tensor          # 1 on response tokens the policy sampled (0: padding, tool observations)
    old_logprobs_B_T: torch.Tensor  # rollout policy's raw log-probs (0 off the mask)
    start: int                      # column where every response begins

    def rows(self, idx: slice | torch.Tensor) -> "PaddedRollouts":
        return PaddedRollouts(self.input_ids_B_L[idx], self.attention_B_L[idx], self.position_B_L[idx],
                     self.response_B_T[idx], self.mask_B_T[idx], self.old_logprobs_B_T[idx], self.start)


def collate(rollouts, pad_id: int) -> PaddedRollouts:
    """Left-pad prompts so every response starts at the same column W, right-pad responses;
    the mask is each rollout's sampled tokens (every response token of a single turn)."""
    W = max(len(r.prompt_ids) for r in rollouts)
    T = max(max(len(r.response_ids) for r in rollouts), 1)
    B = len(rollouts)
    ids = torch.full((B, W + T), pad_id, dtype=torch.long)
    attn = torch.zeros((B, W + T), dtype=torch.long)
    resp = torch.full((B, T), pad_id, dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.float32)
    old = torch.zeros((B, T), dtype=torch.float32)
    for i, r in enumerate(rollouts):
        p, n = len(r.prompt_ids), len(r.response_ids)
        ids[i, W - p:W] = torch.tensor(r.prompt_ids)
        ids[i, W:W + n] = torch.tensor(r.response_ids, dtype=torch.long)
        attn[i, W - p:W + n] = 1
        resp[i, :n] = torch.tensor(r.response_ids, dtype=torch.long)
        mask[i, :n] = 1.0 if r.mask is None else torch.tensor(r.sampled(n), dtype=torch.float32)
        # 0 where the policy did not sample: a value there (any, NaN too) never reaches the ratio
        old[i, :n] = torch.where(mask[i, :n] > 0, torch.tensor(r.logprobs, dtype=torch.float32), 0.0)
    pos = (attn.cumsum(-1) - 1).clamp_min(0)  # the positions `generate` used with left padding
    return PaddedRollouts(ids, attn, pos, resp, mask, old, W)
