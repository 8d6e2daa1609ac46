"""AdamW, its learning-rate schedule, and an optimizer step that never writes NaN into weights.

    build_optimizer(model, cfg, steps)   AdamW over the trainable parameters + LambdaLR (with
                                         cfg.fused, the fused kernel where it applies: fusable)
    lr_lambda(cfg, steps)                linear warm-up, then constant / cosine / linear decay
                                         to min_lr_ratio (a multiplier of cfg.lr)
    optimizer_step(opt, params, clip)    clip the global norm, step unless it is not finite
    NonfiniteSteps                       says each skipped step; MAX_NONFINITE_IN_A_ROW in a
                                         row stop the run (something persists)
    align_schedule(scheduler)            after a resume: the rate of the resumed step under
                                         this run's schedule (another run.steps is another one)
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from opd.spine.config import OptimConfig
from opd.errors import TrainError  # noqa: F401  (raised here; the spine's callers catch it from here)

MAX_NONFINITE_IN_A_ROW = 3   # steps skipped for a NaN/inf gradient before the run stops


def lr_lambda(cfg: OptimConfig, steps: int) -> Callable[[int], float]:
    """The multiplier of cfg.lr at optimizer step `step` (0-based) of a run of `steps` steps."""
    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, steps - cfg.warmup_steps))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.schedule == "cosine" else 1 - progress
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape
    return f


def fusable(params: list[torch.Tensor]) -> bool:
    """Whether AdamW's fused kernel (optim.fused) takes these parameters: plain (not sharded:
    FSDP2's DTensor parameters keep the foreach path) floating-point tensors on the CPU or a
    CUDA device. One pass per tensor instead of foreach's dozen over weights, gradients and
    both moments (measured in docs/train.md and docs/benchmarks.md)."""
    from torch.distributed.tensor import DTensor

    return bool(params) and all(not isinstance(p, DTensor) and p.device.type in ("cpu", "cuda")
                                and p.is_floating_point() for p in params)


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, steps: int):
    """(AdamW over the parameters that require grad, its LambdaLR): step the scheduler once per
    training step, after the optimizer."""
    params = [p for p in model.parameters() if p.requires_grad]
    kernel = {"fused": True if cfg.fused and fusable(params) else None, "foreach": None}
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                                  weight_decay=cfg.weight_decay, **kernel)

    def keep_kernel(opt: torch.optim.Optimizer) -> None:
        # A checkpoint's param groups carry the kernel it was saved with; the config decides.
        for group in opt.param_groups:
            group.update(kernel)

    optimizer.register_load_state_dict_post_hook(keep_kernel)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, steps))


def optimizer_step(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], max_norm: float) -> tuple[float, bool]:
    """Clip the gradient of `params` to `max_norm` (0: no clipping) and step, unless its norm is
    not finite: AdamW would write NaN into every weight, so the step is skipped and the weights
    stay as they were. The gradients are cleared either way. Returns (norm, applied)."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    applied = bool(torch.isfinite(norm))
    if applied:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm), applied


class NonfiniteSteps:
    """Counts the steps `optimizer_step` skipped in a row. `hint`: what to check, said when the
    run stops (a loop knows its usual causes: a teacher, the rewards, the learning rate)."""

    def __init__(self, hint: str):
        self.hint = hint
        self.in_a_row = 0

    def check(self, step: int, applied: bool, detail: str = "") -> str | None:
        """None after an applied step; after a skipped one the warning to print and keep in the
        card (`detail`, e.g. " (loss 3.1)", follows "not finite"). Raises TrainError at the
        MAX_NONFINITE_IN_A_ROW-th skipped step in a row."""
        if applied:
            self.in_a_row = 0
            return None
        self.in_a_row += 1
        msg = f"step {step}: the gradient is not finite{detail}; the step was skipped, the weights are unchanged"
        if self.in_a_row >= MAX_NONFINITE_IN_A_ROW:
            raise TrainError(f"{self.in_a_row} steps in a row had a gradient that is not finite (the last: {msg}); "
                             f"stopping. {self.hint}; --resume continues from the last checkpoint")
        return msg


def align_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR) -> None:
    """Set each group's rate to what this run's schedule gives at the scheduler's step. A resumed
    optimizer comes back with the rate the checkpointed run's schedule set for its next step;
    with another run.steps (`--resume --steps N`) the schedule is another one: its rate at this
    step, or a finished cosine run's extension would start at lr 0."""
    for group, base, f in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * f(scheduler.last_epoch)
