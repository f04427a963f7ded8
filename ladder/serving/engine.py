"""What `ladder serve`, `ladder eval --backend vllm` and the vLLM benchmark share about running vLLM
here: the CPU cores each tensor-parallel rank binds, and one line from a vLLM configuration error."""

from __future__ import annotations

from ladder.errors import UsageError, first_line


def cpu_binding(tp: int, cores: list[int]) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `tp` ranks over `cores`: equal contiguous groups, one per rank.
    vLLM's own "auto" binds by NUMA node and refuses more ranks than nodes (one node here)."""
    per_rank = len(cores) // tp
    if per_rank == 0:
        raise UsageError(f"--tp {tp} needs at least {tp} CPU cores; this process may use {len(cores)}")
    groups = [cores[rank * per_rank : (rank + 1) * per_rank] for rank in range(tp)]
    return "|".join(",".join(str(core) for core in group) for group in groups)


def vllm_error_message(error: BaseException) -> str:
    """One line from a vLLM configuration error; pydantic's ValidationError puts it in its entries."""
    entries = getattr(error, "errors", None)
    if callable(entries):
        try:
            return "; ".join(entry["msg"].removeprefix("Value error, ") for entry in entries())
        except (TypeError, KeyError):
            pass
    return first_line(error)


__all__ = ["cpu_binding", "vllm_error_message"]
