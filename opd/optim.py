"""The optimizer every trainer here uses (opd train, opd sft, opd rl, data-parallel SFT)."""

from __future__ import annotations


def adamw(params, **kwargs):
    """torch's AdamW, fused (one kernel over all parameters) where torch has that kernel for
    the parameters' device, as transformers' Trainer (and so TRL) defaults to. On the step
    bench's 2-layer student on CPU a step takes 0.17 ms fused against 0.81 ms in the per-tensor
    loop. Checkpoints hold the same state either way."""
    import torch

    params = list(params)
    fused = bool(params) and all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    return torch.optim.AdamW(params, fused=fused or None, **kwargs)
