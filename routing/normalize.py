"""Per-domain loss scaling, loss shares and the lopsided-student warning.

Without care, the domain with the most samples or the sharpest teacher (largest KL) takes
over the gradient. `DomainLossNormalizer("running_mean")` divides each domain's loss by an
exponential running mean of that domain's own loss, so every domain contributes about 1
per step, and their weights lambda_d decide the balance. The running mean starts at the
first value seen (no warm-up bias) and is updated before the multiplier is returned, so
the first step's normalized loss is exactly 1. The multiplier is a number, not a tensor:
it scales the loss (and its gradient) without becoming part of the graph.
"""

from __future__ import annotations

import math
import statistics
from typing import Literal

EPS = 1e-8


class DomainLossNormalizer:
    def __init__(self, mode: Literal["none", "running_mean"] = "none", momentum: float = 0.9):
        if mode not in ("none", "running_mean"):
            raise ValueError(f"normalize mode must be 'none' or 'running_mean', got {mode!r}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        self.mode = mode
        self.momentum = momentum
        self.means: dict[str, float] = {}

    def scale(self, domain: str, loss_value: float) -> float:
        """The multiplier for this step's loss of `domain`: 1 ("none") or 1/running mean."""
        if not math.isfinite(loss_value):
            raise ValueError(f"loss of domain {domain!r} is {loss_value}; refusing to fold it into the running mean")
        if self.mode == "none":
            return 1.0
        loss_value = abs(loss_value)
        if domain not in self.means:
            self.means[domain] = loss_value
        else:
            m = self.momentum
            self.means[domain] = m * self.means[domain] + (1 - m) * loss_value
        return 1.0 / max(self.means[domain], EPS)

    def state(self) -> dict:
        return {"mode": self.mode, "momentum": self.momentum, "means": dict(self.means)}

    def load_state(self, state: dict) -> None:
        self.means = {d: float(v) for d, v in state.get("means", {}).items()}

    @staticmethod
    def shares(losses: dict[str, float]) -> dict[str, float]:
        """Each domain's share of the total loss (|loss| / sum |loss|); equal shares if all are 0."""
        total = sum(abs(v) for v in losses.values())
        if total <= 0:
            return {d: 1.0 / len(losses) for d in losses} if losses else {}
        return {d: abs(v) / total for d, v in losses.items()}


def lopsided(metric_by_domain: dict[str, float], factor: float = 3.0) -> list[str]:
    """Domains whose metric is more than `factor` times above, or below 1/`factor` of, the
    median over all domains (loss share or accuracy). Needs at least two domains; a median
    of 0 names nobody (early in training every accuracy may be 0)."""
    if factor <= 1:
        raise ValueError(f"factor must be > 1, got {factor}")
    values = {d: v for d, v in metric_by_domain.items() if v is not None and math.isfinite(v)}
    if len(values) < 2:
        return []
    ref = statistics.median(values.values())
    if ref <= 0:
        return []
    return [d for d, v in values.items() if v > factor * ref or v < ref / factor]
