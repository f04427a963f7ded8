"""The commands that start N local processes, the one home for them: under `accelerate launch`
(`ladder eval --processes`, the multi-process tests) and under torchrun (the TP ranks of the link
probe and the TP benchmark). `--multi_gpu` is what makes accelerate start several processes
(through torchrun); with no GPU they run on the CPU over gloo (`--cpu --num_processes N` starts only
one: accelerate issue #2741)."""

from __future__ import annotations

import os
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


def torchrun(processes: int, prefix: list[str] | None = None) -> list[str]:
    """torchrun for `processes` ranks on this machine, behind `prefix` (e.g. `ip netns exec NAME`):
    append `-m module` and its arguments."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    return [*(prefix or []), *command]


def rank_environment(threads: int) -> dict[str, str]:
    """This environment for ranks of `threads` CPU threads each; OMP_NUM_THREADS set here also
    silences torchrun's warning about it, and c10d's warnings are noise here."""
    return os.environ | {"OMP_NUM_THREADS": str(threads), "TORCH_CPP_LOG_LEVEL": "ERROR"}


__all__ = ["free_port", "multi_process_launcher", "rank_environment", "torchrun"]
