"""The commands that start N local processes, the one home for them. `--multi_gpu` is what makes
accelerate start several (with no GPU they run on the CPU over gloo; `--cpu --num_processes N` starts
only one: accelerate issue #2741)."""

from __future__ import annotations

import os
import socket
import sys


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def multi_process_launcher(processes: int) -> list[str]:
    return [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(free_port()),
    ]  # fmt: skip


def torchrun(processes: int, prefix: list[str] | None = None) -> list[str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    return [*(prefix or []), *command]


def rank_environment(threads: int) -> dict[str, str]:
    """OMP_NUM_THREADS set here also silences torchrun's warning about it."""
    return os.environ | {"OMP_NUM_THREADS": str(threads), "TORCH_CPP_LOG_LEVEL": "ERROR"}
