"""What a step's groups carry. A group whose rewards are all equal carries no gradient: the
verifiers say whether it was all correct or all wrong, and DAPO's dynamic sampling draws more
prompts to replace it.

    verifier_verdict(parts, shape)               -> (correct, wrong) per response, or None
    keep_informative(first, draw, limit, world)  -> the step's samples, rollouts, rewards,
                                                    reward parts, and its metrics
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from opd.spine.dist import World
from opd.spine.objective import equal_groups


# The rewards that verify an answer (1 = correct, 0 = wrong; code: the share of tests passed).
VERIFIERS = ("math", "code")


def verifier_verdict(parts: dict[str, list[float]], shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(correct, wrong) per response from the verifier rewards' own values, or None when no
    verifier is configured (then rewards alone cannot say right from wrong). A response is
    correct when a verifier scores it 1 and wrong when every verifier scores it 0: with math
    and code both configured, a row of one domain scores 0 on the other's verifier."""
    values = [torch.tensor(v, dtype=torch.float32) for k, v in parts.items() if k.split("#")[0] in VERIFIERS]
    if not values:
        return None
    best_P_G = torch.stack(values).max(dim=0).values.view(shape)
    return best_P_G >= 1.0, best_P_G <= 0.0


def keep_informative(first: tuple, draw: Callable[[int], tuple], limit: int, world: World = World()):
    """`first` = (samples [P], rollouts [P x G], rewards [P x G], {part: [P x G]}) of a step's
    first draw; `draw(k)` the k-th further draw, the same tuple. Draws more (at most `limit`)
    while fewer than P of the groups drawn so far have rewards that differ; the step trains
    on the first P such groups, in draw order, padded with all-equal ones when the draws ran
    out, so it is always P x G responses (each rollout's prompt_index renumbered to its
    group). Sharded, P is this rank's share and the ranks draw together (a sharded policy
    samples collectively). Metrics: groups/draws, groups/flat_drawn (the share of the groups
    drawn whose rewards were all equal, over every rank)."""
    samples_P, rollouts_B, rewards_B, parts = first
    P = len(samples_P)
    informative, flat, draws = [], [], 0
    while True:
        for p, sample in enumerate(samples_P):
            at = [b for b, r in enumerate(rollouts_B) if r.prompt_index == p]
            group = (sample, [rollouts_B[b] for b in at], [rewards_B[b] for b in at],
                     {k: [v[b] for b in at] for k, v in parts.items()})
            equal = bool(equal_groups(torch.tensor([group[2]]))[0])
            (flat if equal else informative).append(group)
        draws += 1
        short = float(len(informative) < P)
        if world.sharded:
            short = world.sum({"short": short})["short"]
        if not short or draws > limit:
            break
        samples_P, rollouts_B, rewards_B, parts = draw(draws)
    groups = (informative + flat)[:P]
    rollouts = [replace(r, prompt_index=p) for p, (_, ros, _, _) in enumerate(groups) for r in ros]
    merged = {k: [x for *_, pt in groups for x in pt[k]] for k in parts}
    counts = {"flat": float(len(flat)), "drawn": float(len(flat) + len(informative))}
    counts = world.sum(counts) if world.sharded else counts
    metrics = {"groups/draws": float(draws), "groups/flat_drawn": counts["flat"] / counts["drawn"]}
    return [g[0] for g in groups], rollouts, [x for _, _, rs, _ in groups for x in rs], merged, metrics
