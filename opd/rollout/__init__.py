"""Student rollout engines: transformers `generate` (reference) and vLLM."""

from opd.rollout.base import Rollout, RolloutEngine, SamplingParams

__all__ = ["Rollout", "RolloutEngine", "SamplingParams"]
