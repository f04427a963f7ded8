"""The command that starts N local processes under `accelerate launch`, for `ladder eval
--processes` and the multi-process tests. `--multi_gpu` is what makes accelerate start several
processes (through torchrun); with no GPU they run on the CPU over gloo (`--cpu --num_processes N`
starts only one: accelerate issue #2741)."""

from __future__ import annotations

import socket
import sys


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for the processes' rendezvous)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def multi_process_launcher(processes: int) -> list[str]:
    """`accelerate launch` for `processes` processes on this machine, fp32, no dynamo: append the
    script or `-m module` and its arguments."""
    return [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(free_port()),
    ]  # fmt: skip


__all__ = ["free_port", "multi_process_launcher"]
