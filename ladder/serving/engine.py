"""What the plugin, `ladder serve`, `ladder eval --backend vllm` and the vLLM benchmark share about
running vLLM here: the vLLM versions the ladder model supports, the CPU cores each tensor-parallel
rank binds, how vLLM starts its processes where CUDA may be, and one line from a vLLM configuration
error."""

from __future__ import annotations

import os

from ladder.errors import UsageError, first_line

SUPPORTED_VLLM = ("0.32",)  # minor versions; `make serve-env` installs 0.32.0 (CPU or CUDA build)


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
    entries = getattr(error, "errors", None)
    if callable(entries):
        try:
            return "; ".join(entry["msg"].removeprefix("Value error, ") for entry in entries())
        except (TypeError, KeyError):
            pass
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


__all__ = ["SUPPORTED_VLLM", "cpu_binding", "use_spawn_where_cuda_may_be", "vllm_error_message", "vllm_version_problem"]
