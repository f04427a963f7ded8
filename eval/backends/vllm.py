"""The `vllm` backend: lm-eval's `vllm` model type, one engine per model (N with `--data-parallel N`,
each at `--tp` ranks), in the serving environment (`make eval BACKEND=vllm`)."""

from __future__ import annotations

import os

from ladder.errors import UsageError
from ladder.io.loading import visible_gpus
from ladder.serving.engine import cpu_binding

from ..models import ModelRef
from ..runtime import Runtime


def check(runtime: Runtime, models: list[ModelRef]) -> None:
    if runtime.accelerator is not None or runtime.parallelize:
        raise UsageError(
            "--backend vllm runs one engine per model (its own --tp ranks): drop --processes and --parallelize"
        )
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise UsageError(
            "--backend vllm: vLLM is not installed in this environment; run `make eval BACKEND=vllm ...`, "
            "which builds and uses .venv-serve"
        ) from None
    if runtime.data_parallel > 1:  # too few cores or GPUs for the engines: refused before anything loads
        # torch's count through NVML, not vLLM's platform probe (which prints a Triton notice).
        engine_environments(runtime.data_parallel, runtime.tensor_parallel, visible_gpus() == 0)
    for ref in models:
        if not ref.path.is_dir():
            raise UsageError(
                f"--backend vllm: {ref.spec} is a GGUF file; vLLM scores checkpoint directories "
                "(`ladder convert` writes one, with --layers 0 for a plain copy)"
            )


def code_classes() -> list[type]:
    from ladder.serving import model

    return [getattr(model, name) for name in model.__all__]  # every family's vLLM ladder model


def load_lm(ref: ModelRef, runtime: Runtime):
    from lm_eval.models.vllm_causallms import VLLM
    from vllm.platforms import current_platform

    tensor_parallel = runtime.tensor_parallel
    arguments = dict(pretrained=str(ref.path), dtype=runtime.dtype, tensor_parallel_size=tensor_parallel)
    if runtime.data_parallel > 1:
        from .vllm_replicas import DataParallelVLLM

        environments = engine_environments(runtime.data_parallel, tensor_parallel, current_platform.is_cpu())
        return DataParallelVLLM(environments, **arguments, batch_size="auto")
    if current_platform.is_cpu() and tensor_parallel > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_binding(tensor_parallel, sorted(os.sched_getaffinity(0)))
    return VLLM(**arguments, batch_size="auto")


def engine_environments(engines: int, tensor_parallel: int, on_cpu: bool) -> list[dict[str, str]]:
    """Each engine's environment: its own contiguous CPU cores, or its own visible GPUs."""
    if on_cpu:
        cores = sorted(os.sched_getaffinity(0))
        per_engine = len(cores) // engines
        if per_engine < tensor_parallel:
            raise UsageError(
                f"--data-parallel {engines} x --tp {tensor_parallel} needs {engines * tensor_parallel} CPU cores; "
                f"this process may use {len(cores)}"
            )
        groups = [cores[index * per_engine : (index + 1) * per_engine] for index in range(engines)]
        return [{"VLLM_CPU_OMP_THREADS_BIND": cpu_binding(tensor_parallel, group)} for group in groups]
    # The devices this process was given: engine 0 sets its own only while it starts (vllm_replicas.py).
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(index) for index in range(visible_gpus())]
    if len(devices) < engines * tensor_parallel:
        raise UsageError(
            f"--data-parallel {engines} x --tp {tensor_parallel} needs {engines * tensor_parallel} GPUs; "
            f"{len(devices)} are visible"
        )
    return [
        {"CUDA_VISIBLE_DEVICES": ",".join(devices[index * tensor_parallel : (index + 1) * tensor_parallel])}
        for index in range(engines)
    ]
