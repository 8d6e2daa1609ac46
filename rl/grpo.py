"""GRPO maths as pure tensor functions: advantages, clipped surrogate, KL, aggregation.

Shapes are in the names: P prompts, G responses per prompt (a group), B = P*G sequences,
T response positions (right-padded; `mask_B_T` is 1 on real response tokens), V vocab.

Where this deviates from the papers (and why) is said at each function; the choices and
their references are collected in docs/grpo.md.
"""

from __future__ import annotations

from typing import Literal

import torch

from opd.spine.objective import equal_groups, group_advantages  # noqa: F401  (shared with opd train)
from opd.spine.rows import sequence_weights

AdvantageEstimator = Literal["grpo", "dr_grpo", "batch_std", "rloo"]
KLEstimator = Literal["k1", "k3"]
LossAggregation = Literal["token_mean", "seq_mean", "dr_grpo"]
# opd rl's names for opd.spine.rows.sequence_weights' norms (opd train's length_norm: token, sequence)
AGGREGATION_NORM = {"token_mean": "token", "seq_mean": "sequence", "dr_grpo": "constant"}


# ---- advantages ---------------------------------------------------------------------------

# ---- policy loss --------------------------------------------------------------------------

def clipped_surrogate(logprobs_B_T: torch.Tensor, old_logprobs_B_T: torch.Tensor,
                      advantages_B: torch.Tensor, eps_low: float = 0.2,
                      eps_high: float = 0.2) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped objective per token, as a loss: -min(ratio*A, clip(ratio, 1-eps_low, 1+eps_high)*A).

    `old_logprobs_B_T` are the rollout policy's log-probs of the sampled tokens. A separate
    eps_high > eps_low is DAPO's clip-higher (lets low-probability tokens rise). advantages: one
    per sequence [B], or one per token [B, T] (a teacher's term joined, opd.spine.objective).
    Returns (loss_B_T, clipped_B_T) where clipped marks tokens whose gradient the clip
    removed (the clipped branch was the smaller one).
    """
    ratio_B_T = torch.exp(logprobs_B_T - old_logprobs_B_T)
    adv_B_1 = (advantages_B[:, None] if advantages_B.dim() == 1 else advantages_B).to(logprobs_B_T.dtype)
    unclipped_B_T = ratio_B_T * adv_B_1
    clipped_obj_B_T = torch.clamp(ratio_B_T, 1.0 - eps_low, 1.0 + eps_high) * adv_B_1
    loss_B_T = -torch.minimum(unclipped_B_T, clipped_obj_B_T)
    clipped_B_T = (clipped_obj_B_T < unclipped_B_T).detach()
    return loss_B_T, clipped_B_T


def kl_to_reference(logprobs_B_T: torch.Tensor, ref_logprobs_B_T: torch.Tensor,
                    estimator: KLEstimator = "k3") -> torch.Tensor:
    """Per-token estimate of reverse KL(policy || reference) from tokens sampled by the policy.

    k1 = log pi - log ref                       (unbiased, high variance, can be negative)
    k3 = ref/pi - 1 - log(ref/pi)               (unbiased, always >= 0; Schulman 2020,
                                                 the one DeepSeekMath's GRPO uses)
    """
    log_ratio_B_T = ref_logprobs_B_T - logprobs_B_T  # log(ref / pi)
    if estimator == "k1":
        return -log_ratio_B_T
    if estimator == "k3":
        return torch.exp(log_ratio_B_T) - 1.0 - log_ratio_B_T
    raise ValueError(f"unknown KL estimator {estimator!r}")


def aggregate(loss_B_T: torch.Tensor, mask_B_T: torch.Tensor, mode: LossAggregation, *,
              num_sequences: int | None = None, num_tokens: float | None = None,
              max_tokens: int | None = None) -> torch.Tensor:
    """Reduce per-token losses to a scalar, with opd train's weights (opd.spine.rows.sequence_weights):

    token_mean: sum over all tokens / number of tokens (DAPO; long answers weigh more)
    seq_mean:   mean over sequences of each sequence's token mean (original GRPO)
    dr_grpo:    sum over all tokens / (sequences * max_tokens), a constant normalizer
                (Dr. GRPO: no length bias in either direction)

    The normalizers can be given for the whole batch (num_sequences, num_tokens), so that
    micro-batches summed together give exactly the full-batch value.
    """
    if mode not in AGGREGATION_NORM:
        raise ValueError(f"unknown loss aggregation {mode!r}")
    m = mask_B_T.to(loss_B_T.dtype)
    lengths = [int(n) for n in m.sum(dim=1).tolist()]
    counts = {"tokens/": float(num_tokens if num_tokens is not None else sum(lengths)),
              "seqs/": float(num_sequences if num_sequences is not None else loss_B_T.shape[0])}
    w_B = sequence_weights(lengths, [""] * len(lengths), {}, AGGREGATION_NORM[mode], counts,
                           max_tokens if max_tokens is not None else loss_B_T.shape[1])
    return (loss_B_T * m * torch.tensor(w_B, dtype=loss_B_T.dtype, device=loss_B_T.device)[:, None]).sum()


# ---- helpers on logits --------------------------------------------------------------------

def entropy(logits_B_T_V: torch.Tensor) -> torch.Tensor:
    """Entropy of the policy's next-token distribution per position (nats)."""
    lp_B_T_V = torch.log_softmax(logits_B_T_V.float(), dim=-1)
    return -(lp_B_T_V.exp() * lp_B_T_V).sum(dim=-1)


def masked_mean(x_B_T: torch.Tensor, mask_B_T: torch.Tensor) -> float:
    m = mask_B_T.to(x_B_T.dtype)
    return float((x_B_T * m).sum() / m.sum().clamp_min(1.0))
