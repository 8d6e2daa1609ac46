"""The per-token objective both loops share: a verifier's advantage and a teacher's signal in one
policy-gradient term, and the correction of rollouts sampled by older weights.

For response token t of sequence b, sampled by the weights of version v_b (v_b < v, the version
being trained, when rollouts ran ahead of training):

    A_bt = alpha * A_b                                              (reward: opd.rl.grpo's group advantage)
         + sum_j lambda_j * sum_{s >= t} gamma_j^(s-t) * (log pi_j(x_s) - log pi(x_s))   (teacher j)

The teacher term is the sampled-token reverse-KL advantage, -lambda * (log pi - log pi_j), per
token (gamma = 0) or with the future tokens' terms discounted into it (gamma > 0, the return
of the per-token reward, as tinker-cookbook folds its KL penalty into the RL advantage).

Deviation from the peers' form (teacher `baseline: batch`, the default): before it becomes an
advantage, each token's estimate log pi(x_t) - log pi_j(x_t) has a baseline b_i subtracted: the
mean estimate over the rows of the batch's OTHER sequences (`leave_one_out`). b_i does not
depend on sequence i's tokens, so E[(est - b_i) grad log pi(x_t)] is still the reverse KL's
gradient at t; what goes is the part of the noise that the estimate's mean (about the KL, one
nat per token on the demo) carries. `baseline: none` is the plain form.

Both policy-gradient terms (the teacher's sampled term, the reward's) weigh every token of a
domain alike (the batch's token mean), whatever `loss.length_norm` says: a per-sequence mean
would weigh a token by 1 / its own sequence's length, which correlates the weight with the
sample, and with a positive mean advantage c the update then follows c * grad E[1/L]: it
rewards length (Dr. GRPO's finding; docs/benchmarks.md measures it on the sampled term).
`opd rl` adds it to GRPO's advantage before its clipped surrogate; `opd train` adds the reward
term to its teachers' losses (opd.distill.loss). Both take these functions, so the two CLIs
compute one objective.

Off-policy correction (`OffPolicyConfig`): each token's importance ratio
rho_t = pi_now(x_t) / pi_sampler(x_t), from the sampler's own log-probabilities (the hf and
vLLM engines' raw, temperature-1 log-probs, so the ratio is of the untempered policies), is

    tis   truncated at `cap` (truncated importance sampling; bias only where rho > cap)
    mask  kept inside [low, high], 0 outside (the token is dropped, as ICE-POP / MIS do)
    none  1

A top-k or full divergence is exact over the vocabulary at its position and does not depend
on x_t; what was sampled off-policy is the prefix that reached it, so it is weighted by the
prefix's ratio prod_{u<t} rho_u, truncated (or masked) the same way. The sampled-token teacher
term estimates that same per-position divergence from x_t ~ pi_sampler too, so it is weighted by
the prefix's ratio times its token's rho_t: its expectation is then the exact term's. The
reward term, a sequence's return spread over its tokens, is weighted by its token's rho_t
alone (PPO's and GRPO's per-token correction). Rows of a batch sampled by the weights being trained (staleness 0)
get weight exactly 1, so an on-policy run is unchanged by any of this.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Importance:
    """Weights of one batch's rows [N] (packed response rows), without grad."""
    token_N: torch.Tensor     # weights for policy-gradient terms (rho_t, corrected)
    prefix_N: torch.Tensor    # weights for exact divergences (prod_{u<t} rho_u, corrected)
    ratio_N: torch.Tensor     # rho_t itself (1 on rows sampled by the trained weights)
    cut_N: torch.Tensor       # bool: the correction changed this row's token weight


def discounted(x_N: torch.Tensor, offsets: list[int], gamma: float) -> torch.Tensor:
    """sum_{s >= t} gamma^(s-t) x_s within each sequence (rows offsets[i]..offsets[i+1]) [N];
    gamma = 0 returns x_N itself. The rows are the tokens the policy sampled (a trajectory's
    observations are none), so an observation neither adds a term nor takes a discount step."""
    if gamma == 0.0 or len(x_N) == 0:
        return x_N
    lengths = torch.tensor(offsets, device=x_N.device).diff()
    mask_B_T = torch.arange(int(lengths.max()), device=x_N.device)[None, :] < lengths[:, None]   # row-major = packed order
    x_B_T = x_N.new_zeros(mask_B_T.shape)
    x_B_T[mask_B_T] = x_N
    out_B_T = torch.zeros_like(x_B_T)
    acc_B = x_B_T.new_zeros(x_B_T.shape[0])
    for t in range(x_B_T.shape[1] - 1, -1, -1):   # right padding is 0: it adds nothing to acc
        acc_B = x_B_T[:, t] + gamma * acc_B
        out_B_T[:, t] = acc_B
    return out_B_T[mask_B_T]


def teacher_advantage(student_lp_N: torch.Tensor, teacher_lp_N: torch.Tensor, offsets: list[int], gamma: float,
                      lam: float = 1.0, baseline_N: torch.Tensor | float = 0.0) -> torch.Tensor:
    """[N], detached: a teacher's sampled-token term of each row's advantage, the one both loops
    take (opd train's sampled mode, opd rl's teachers): -lambda * (log pi(x_t) - log pi_teacher(x_t)
    - b), the reverse-KL estimate (kernels.sampled_token_reverse_kl) negated, less a baseline b
    that does not depend on the token (`leave_one_out`), with the later tokens' terms of its
    sequence (rows offsets[i]..offsets[i+1]) discounted into it (`discounted`, gamma)."""
    adv_N = -lam * (student_lp_N.detach().float() - teacher_lp_N.detach().float() - baseline_N)
    return discounted(adv_N, offsets, gamma)


def ranks_total(sums_B: torch.Tensor, counts_B: torch.Tensor, world=None) -> tuple[float, float] | None:
    """(sum, count) of sums_B and counts_B over every rank when `world` is sharded (these are
    one rank's share of the batch), for `leave_one_out` and `batch_advantages`; else None (the
    batch is all here). A collective on a sharded world: every rank calls it."""
    if world is None or not world.sharded:
        return None
    both = world.sum({"sum": float(sums_B.sum()), "count": float(counts_B.sum())})
    return both["sum"], both["count"]


def leave_one_out(sums_B: torch.Tensor, counts_B: torch.Tensor, total: tuple[float, float] | None = None) -> torch.Tensor:
    """[B]: for each sequence b, the mean over the other sequences' rows of a per-row value, from
    each sequence's sum sums_B and row count counts_B (0 where no other sequence has rows).
    total: (sum, count) over every rank's sequences when these are one rank's share of the batch."""
    s, n = (float(sums_B.sum()), float(counts_B.sum())) if total is None else total
    others_B = n - counts_B.double()
    return torch.where(others_B > 0, (s - sums_B.double()) / others_B.clamp(min=1), 0.0).float()


def policy_gradient(lp: torch.Tensor, advantage: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token loss whose gradient is -weight * advantage * grad log pi(x_t) (REINFORCE with
    importance weights; advantage and weight carry no gradient)."""
    coef = advantage.detach() if weight is None else advantage.detach() * weight.detach()
    return -coef * lp


def importance(now_lp_N: torch.Tensor, sampler_lp_N: torch.Tensor, offsets: list[int], stale: list[bool],
               correction: str, cap: float, band: tuple[float, float]) -> Importance:
    """Importance weights of packed rows (sequence i: rows offsets[i]..offsets[i+1]); `stale[i]`:
    sequence i was sampled by weights older than those trained. now_lp_N / sampler_lp_N: log-probs
    of the sampled tokens under the trained and the sampling weights (no grad needed)."""
    n = len(now_lp_N)
    stale_N = torch.zeros(n, dtype=torch.bool)
    for i, (a, b) in enumerate(zip(offsets[:-1], offsets[1:])):
        if stale[i]:
            stale_N[a:b] = True
    log_ratio = torch.where(stale_N, now_lp_N.detach().float().cpu() - sampler_lp_N.float().cpu(),
                            torch.zeros(n))
    # prefix: sum of the log-ratios of the tokens before t in its own sequence
    prefix_log = torch.zeros(n)
    for a, b in zip(offsets[:-1], offsets[1:]):
        if b > a:
            prefix_log[a + 1:b] = torch.cumsum(log_ratio[a:b - 1], 0)
    ratio, prefix = log_ratio.exp(), prefix_log.exp()
    ones = torch.ones(n)
    if correction == "none":
        return Importance(ones, ones, ratio, torch.zeros(n, dtype=torch.bool))
    if correction == "tis":
        return Importance(ratio.clamp(max=cap), prefix.clamp(max=cap), ratio, ratio > cap)
    if correction == "mask":
        low, high = band
        inside, inside_prefix = (ratio >= low) & (ratio <= high), (prefix >= low) & (prefix <= high)
        return Importance(torch.where(inside, ratio, 0.0), torch.where(inside_prefix, prefix, 0.0), ratio, ~inside)
    raise ValueError(f"unknown off-policy correction {correction!r}")


def drowned(reward_per_token: float, teacher_per_token: float, factor: float) -> str | None:
    """A sentence when one signal's mean magnitude per token is `factor` times the other's."""
    r, t = reward_per_token, teacher_per_token
    if (r > factor * t and t > 0) or (t > factor * r and r > 0):
        big, small = ("reward", "teachers'") if r > t else ("teachers'", "reward")
        return (f"the {big} signal ({max(r, t):.3g} per token) is over {factor:g} times the {small} ({min(r, t):.3g}): "
                f"the smaller barely moves the model (the reward weight, the teachers' weight)")
    return None


# ---- the reward's group advantage (opd rl's GRPO family; opd train with `rewards`) ----

def group_advantages(rewards_P_G: torch.Tensor, estimator: str = "grpo",
                     eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantages, one per response.

    grpo:      (r - mean_group) / (std_group + eps)   (DeepSeekMath; std is the unbiased
               one, as in TRL)
    dr_grpo:   r - mean_group                          (Dr. GRPO: no std scaling, which
               otherwise up-weights groups that are nearly all-correct or all-wrong)
    batch_std: (r - mean_group) / (std_batch + eps)    (one scale for the whole batch)
    rloo:      r - mean of the other G-1 responses     (leave-one-out baseline)
               = G/(G-1) * (r - mean_group)

    A group whose rewards are all equal carries no signal: its advantages are exactly 0
    (never NaN), also for G = 1. (`batch_advantages` needs no groups.)
    """
    r = rewards_P_G.to(torch.float64)
    P, G = r.shape
    if G < 2:
        return torch.zeros_like(rewards_P_G, dtype=torch.float32)
    centered_P_G = r - r.mean(dim=1, keepdim=True)
    if estimator == "grpo":
        adv_P_G = centered_P_G / (r.std(dim=1, keepdim=True) + eps)
    elif estimator == "dr_grpo":
        adv_P_G = centered_P_G
    elif estimator == "batch_std":
        adv_P_G = centered_P_G / (r.std() + eps) if r.numel() > 1 else centered_P_G
    elif estimator == "rloo":
        adv_P_G = centered_P_G * (G / (G - 1))
    else:
        raise ValueError(f"unknown advantage estimator {estimator!r}")
    # mean() of equal floats need not round back to the same float: force exact zeros.
    flat_P = equal_groups(rewards_P_G)
    adv_P_G = torch.where(flat_P[:, None], torch.zeros_like(adv_P_G), adv_P_G)
    return adv_P_G.to(torch.float32)


def batch_advantages(rewards_B: torch.Tensor, total: tuple[float, float] | None = None) -> torch.Tensor:
    """[B]: each response's reward less the mean reward of the batch's other responses (a
    leave-one-out baseline over the whole step, so unbiased, and no groups needed: a batch of
    32 prompts x 1 sample keeps its 32 prompts for the teachers' term). total: (sum, count)
    over every rank's responses when these are one rank's share."""
    r = rewards_B.to(torch.float64).flatten()
    return (r - leave_one_out(r, torch.ones_like(r), total).double()).float()


def equal_groups(rewards_P_G: torch.Tensor) -> torch.Tensor:
    """[P] bool: groups where every response got the same reward (no gradient from them)."""
    return rewards_P_G.max(dim=1).values == rewards_P_G.min(dim=1).values
