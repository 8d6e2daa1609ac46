"""Objective terms beside the teachers' divergences and the reward: each term's maths and its
config key in this one file, taken by `opd train` and `opd rl` alike (their `terms:` section).

    entropy_bonus   c >= 0: every response token adds -c * H(pi(. | its prefix)) to the loss, H
                    the entropy in nats of the student's own distribution at temperature 1 over
                    the whole vocabulary, so the loss falls as the entropy rises: the seeds'
                    remedy for a policy whose entropy collapses (one answer, no exploration).

A term is a per-token loss of the student's per-token statistics (`token_loss`, any shape: opd
train's packed rows [N], opd rl's [B, T]), which each loop weighs as it weighs its other
per-token terms: opd train by each domain's token mean times its lambda (the policy-gradient
terms' weights, importance-weighted by the prefix on stale rows), opd rl by
`algorithm.loss_aggregation`. Each loop computes only the statistics a term on asks for
(`needs_entropy`): with every term at 0 nothing is computed and the loss is what it was.

Another term: a field of `TermsConfig`, its statistic in `needs_*`, and its line in `token_loss`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from opd.config import field

if TYPE_CHECKING:   # torch loads in the functions: the configs import this file, and `--help` stays torch-free
    import torch


@dataclass(frozen=True)
class TermsConfig:
    entropy_bonus: float = field(0.0, help="c: each response token's loss gains -c x the entropy (nats) of the "
                                           "student's distribution at it (temperature 1), against entropy "
                                           "collapse; the [rows, V] logits of a micro-batch are held for it "
                                           "(opd train: refused with loss.fused_linear); 0: off", min=0.0)

    @property
    def needs_entropy(self) -> bool:
        return self.entropy_bonus > 0


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """H(softmax(logits)) in nats over the last axis, fp32, with the gradient to the logits."""
    import torch

    lp = torch.log_softmax(logits.float(), dim=-1)
    return -(lp.exp() * lp).sum(-1)


def token_loss(cfg: TermsConfig, entropy: torch.Tensor | None = None) -> torch.Tensor | None:
    """The terms' loss per token (the shape of the statistics given); None when every term is off."""
    if not cfg.needs_entropy:
        return None
    return -cfg.entropy_bonus * entropy
