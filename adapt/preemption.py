"""Preemption: the signals a cluster scheduler sends before it stops a job (SIGTERM; SIGUSR1 where the
job asks for an early warning, e.g. Slurm's `--signal=USR1@120`) end the run after the step in progress,
with a checkpoint of it. A signal only sets a flag (nothing is written from a handler); the processes
agree at each step's end (a max all-reduce), so that all of them stop after the same step.
"""

from __future__ import annotations

import signal
from pathlib import Path

import torch
from accelerate import Accelerator

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(Exception):
    """The run stopped on a signal after `step`, with a checkpoint there to resume from."""

    def __init__(self, signal_number: int, step: int, checkpoint: Path, accelerator: Accelerator):
        self.signal_name = signal.Signals(signal_number).name
        super().__init__(f"{self.signal_name}: stopped after step {step} with a checkpoint there, {checkpoint}")
        self.main_process, self.processes = accelerator.is_main_process, accelerator.num_processes


class StopSignals:
    """While entered, SIGTERM and SIGUSR1 are recorded instead of ending the process."""

    def __init__(self) -> None:
        self.received = 0
        self.previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        self.previous = {number: signal.signal(number, self.record) for number in STOP_SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for number, handler in self.previous.items():
            signal.signal(number, handler)

    def record(self, number: int, frame: object) -> None:
        self.received = self.received or number

    def agreed(self, accelerator: Accelerator) -> int:
        """The signal any process has received (0: none), the same answer on every process."""
        if accelerator.num_processes == 1:
            return self.received
        flag = torch.tensor([self.received], device=accelerator.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return int(flag)
