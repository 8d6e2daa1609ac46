"""GRPO maths as pure tensor functions: advantages, clipped surrogate, KL, aggregation.

Shapes are in the names: P prompts, G responses per prompt (a group), B = P*G sequences,
N response rows (the tokens the policy sampled, sequence by sequence: rl/batch.py), V vocab.

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

def clipped_surrogate(logprobs_N: torch.Tensor, old_logprobs_N: torch.Tensor,
                      advantages_N: torch.Tensor, eps_low: float = 0.2,
                      eps_high: float = 0.2) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped objective per token, as a loss: -min(ratio*A, clip(ratio, 1-eps_low, 1+eps_high)*A).

    `old_logprobs_N` are the rollout policy's log-probs of the sampled tokens, `advantages_N`
    each token's advantage (its sequence's, plus a teacher's term when one joins:
    opd.spine.objective); any shape, the same for the three. A separate eps_high > eps_low is
    DAPO's clip-higher (lets low-probability tokens rise). Returns (loss_N, clipped_N) where
    clipped marks tokens whose gradient the clip removed (the clipped branch was the smaller one).
    """
    ratio_N = torch.exp(logprobs_N - old_logprobs_N)
    adv_N = advantages_N.to(logprobs_N.dtype)
    unclipped_N = ratio_N * adv_N
    clipped_obj_N = torch.clamp(ratio_N, 1.0 - eps_low, 1.0 + eps_high) * adv_N
    loss_N = -torch.minimum(unclipped_N, clipped_obj_N)
    clipped_N = (clipped_obj_N < unclipped_N).detach()
    return loss_N, clipped_N


def kl_to_reference(logprobs_N: torch.Tensor, ref_logprobs_N: torch.Tensor,
                    estimator: KLEstimator = "k3") -> torch.Tensor:
    """Per-token estimate of reverse KL(policy || reference) from tokens sampled by the policy.

    k1 = log pi - log ref                       (unbiased, high variance, can be negative)
    k3 = ref/pi - 1 - log(ref/pi)               (unbiased, always >= 0; Schulman 2020,
                                                 the one DeepSeekMath's GRPO uses)
    """
    log_ratio_N = ref_logprobs_N - logprobs_N  # log(ref / pi)
    if estimator == "k1":
        return -log_ratio_N
    if estimator == "k3":
        return torch.exp(log_ratio_N) - 1.0 - log_ratio_N
    raise ValueError(f"unknown KL estimator {estimator!r}")


def aggregate(loss_N: torch.Tensor, lengths: list[int], mode: LossAggregation, *,
              num_sequences: int | None = None, num_tokens: float | None = None,
              max_tokens: int | None = None) -> torch.Tensor:
    """Reduce per-row losses (the rows of sequences of `lengths` rows each, in order) to a
    scalar, with opd train's weights (opd.spine.rows.sequence_weights):

    token_mean: sum over all tokens / number of tokens (DAPO; long answers weigh more)
    seq_mean:   mean over sequences of each sequence's token mean (original GRPO)
    dr_grpo:    sum over all tokens / (sequences * max_tokens), a constant normalizer
                (Dr. GRPO: no length bias in either direction)

    The normalizers can be given for the whole batch (num_sequences, num_tokens), so that
    micro-batches summed together give exactly the full-batch value.
    """
    if mode not in AGGREGATION_NORM:
        raise ValueError(f"unknown loss aggregation {mode!r}")
    counts = {"tokens/": float(num_tokens if num_tokens is not None else sum(lengths)),
              "seqs/": float(num_sequences if num_sequences is not None else len(lengths))}
    w_B = sequence_weights(lengths, [""] * len(lengths), {}, AGGREGATION_NORM[mode], counts,
                           max_tokens if max_tokens is not None else max(lengths, default=1))
    w_N = torch.tensor(w_B, dtype=loss_N.dtype).repeat_interleave(torch.tensor(lengths, dtype=torch.long))
    return (loss_N * w_N.to(loss_N.device)).sum()
