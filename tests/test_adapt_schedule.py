"""adapt/optimizer.py: the learning-rate schedules (transformers' cosine with a floor; linear and
constant with the same warmup and floor), and a resumed schedule continuing exactly."""

from __future__ import annotations

import math

import pytest
import torch

from ladder.adapt.optimizer import build_schedule
from ladder.adapt.recipe import ScheduleSpec


def _lrs(schedule: ScheduleSpec, total: int, steps: range, state: dict | None = None) -> tuple[list[float], dict]:
    """The learning rate of each of `steps` (from the scheduler's `state`, when given), and the
    scheduler's state after them."""
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    scheduler = build_schedule(optimizer, schedule, total)
    if state is not None:
        scheduler.load_state_dict(state)
    lrs = []
    for _ in steps:
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return lrs, scheduler.state_dict()


@pytest.mark.parametrize("decay", ["cosine", "linear", "constant"])
def test_warmup_then_decay_to_the_floor_at_the_last_step(decay):
    total, warmup, floor = 20, 4, 0.1
    lrs, _ = _lrs(ScheduleSpec(warmup_steps=warmup, decay=decay, min_lr_ratio=floor), total, range(total))
    # Warmup: step k at (k + 1) / warmup of the peak, never a step at lr 0.
    assert lrs[:warmup] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    after = lrs[warmup:]
    if decay == "constant":
        assert after == pytest.approx([1.0] * (total - warmup))
        return
    progress = [(k + 1) / (total - warmup) for k in range(total - warmup)]
    shape = [0.5 * (1 + math.cos(math.pi * p)) if decay == "cosine" else 1 - p for p in progress]
    assert after == pytest.approx([floor + (1 - floor) * s for s in shape])
    assert lrs[-1] == pytest.approx(floor)  # the floor at the last step, as the recipe says


def test_warmup_fraction_and_a_resumed_schedule_continue_exactly():
    schedule = ScheduleSpec(warmup_fraction=0.1, decay="cosine", min_lr_ratio=0.05)
    whole, _ = _lrs(schedule, 50, range(50))
    assert whole[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])  # round(0.1 * 50) = 5 warmup steps
    first, state = _lrs(schedule, 50, range(17))
    resumed, _ = _lrs(schedule, 50, range(17, 50), state=state)
    assert first + resumed == whole
