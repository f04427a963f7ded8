"""What the plugin, `ladder serve`, `ladder eval --backend vllm` and the vLLM benchmark share about
running vLLM here: the vLLM versions the ladder model supports, the memory it may take, the CPU cores
each tensor-parallel rank binds, how vLLM starts its processes where CUDA may be, and one line from a
vLLM configuration error."""

from __future__ import annotations

import math
import os

from ladder.errors import UsageError, first_line

SUPPORTED_VLLM = ("0.32",)  # minor versions; `make serve-env` installs 0.32.0 (CPU or CUDA build)
GiB = 1 << 30
# What vLLM's processes take on a CPU besides the weights and the KV cache (torch, vLLM, compiled
# code), rounded up: the API server and the engine core together (0.83 + 0.71 GiB resident, measured
# serving the embedded SmolLM2), and each tensor-parallel worker (1.22 GiB with the weights, compiling).
CPU_SERVER_MEMORY = 2 * GiB
CPU_WORKER_MEMORY = 2 * GiB
# Left free on each GPU beside vLLM's share (other processes, the CUDA context of the API server).
GPU_MARGIN = GiB
VLLM_GPU_MEMORY_UTILIZATION = 0.92  # vLLM's default share of a device


def cpu_kv_cache_space(available: int, weights: int, tp: int) -> int:
    """VLLM_CPU_KVCACHE_SPACE (whole GiB per rank, as vLLM reads it) that fits `available` bytes of
    memory: half of what is left once the weights and vLLM's processes have theirs. vLLM's own
    default reserves 92% of the machine's memory and refuses to start when less is free."""
    spare = available - weights - CPU_SERVER_MEMORY - tp * CPU_WORKER_MEMORY
    space = spare // 2 // tp // GiB
    if space < 1:
        raise UsageError(
            f"{available / GiB:.1f} GiB of memory is available; the weights take {weights / GiB:.1f} GiB and "
            f"vLLM's processes about {(CPU_SERVER_MEMORY + tp * CPU_WORKER_MEMORY) / GiB:.0f} GiB: no room for "
            "a KV cache of 1 GiB per rank (free memory, or set VLLM_CPU_KVCACHE_SPACE in GiB)"
        )
    return space


def gpu_memory_utilization(free: int, total: int, weights: int, tp: int) -> float:
    """--gpu-memory-utilization for a device with `free` of `total` bytes free: vLLM refuses to start
    when its share of the total (0.92 by default) is more than is free, and takes the share for the
    weights (1/tp of them per device), activations and KV cache."""
    share = min(VLLM_GPU_MEMORY_UTILIZATION, math.floor((free - GPU_MARGIN) / total * 100) / 100)
    if share * total < weights / tp + GiB:
        raise UsageError(
            f"{free / GiB:.1f} of the GPU's {total / GiB:.1f} GiB are free: not enough for {weights / tp / GiB:.1f} GiB "
            "of weights per device and a KV cache (free the GPU, or pass -- --gpu-memory-utilization)"
        )
    return share


def cpu_binding(tp: int, cores: list[int]) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `tp` ranks over `cores`: equal contiguous groups, one per rank.
    vLLM's own "auto" binds by NUMA node and refuses more ranks than nodes (one node here)."""
    per_rank = len(cores) // tp
    if per_rank == 0:
        raise UsageError(f"--tp {tp} needs at least {tp} CPU cores; this process may use {len(cores)}")
    groups = [cores[rank * per_rank : (rank + 1) * per_rank] for rank in range(tp)]
    return "|".join(",".join(str(core) for core in group) for group in groups)


def use_spawn_where_cuda_may_be() -> None:
    """Make vLLM spawn its engine and worker processes wherever torch is built with CUDA; call it
    before vLLM is imported. vLLM forks unless torch.cuda.is_initialized(), and a call such as
    torch.cuda.is_available() initialises the CUDA driver without setting that flag: the forked
    child then fails ("CUDA driver initialization failed"). Without CUDA vLLM's fork stays (faster)."""
    import torch

    if torch.version.cuda is not None:
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"


def vllm_error_message(error: BaseException) -> str:
    """One line from a vLLM configuration error; pydantic's ValidationError puts it in its entries."""
    from pydantic import ValidationError

    if isinstance(error, ValidationError):
        return "; ".join(entry["msg"].removeprefix("Value error, ") for entry in error.errors())
    return first_line(error)


def vllm_version_problem(version: str | None = None) -> str | None:
    """One line saying why the installed vLLM (or `version`) cannot run the ladder model, or None."""
    if version is None:
        import vllm

        version = vllm.__version__
    release = version.split("+")[0]  # "0.32.0+cpu" is 0.32.0
    if any(release == minor or release.startswith(minor + ".") for minor in SUPPORTED_VLLM):
        return None
    supported = ", ".join(f"{minor}.x" for minor in SUPPORTED_VLLM)
    return (
        f"the ladder plugin supports vLLM {supported}, not {version}: "
        f"pip install 'vllm=={SUPPORTED_VLLM[-1]}.0' (or `make serve-env`)"
    )
