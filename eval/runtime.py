"""Where and how the weights run (`Runtime`)."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

from ladder.errors import UsageError
from ladder.io.loading import process_device
from ladder.serving.engine import use_spawn_where_cuda_may_be

# lm-eval's batch size unless told otherwise, and what `auto` means on the CPU: lm-eval's search for the
# largest batch that fits is for GPU memory, and on the CPU it chose 64-row batches of padding (393 s
# against 92 s for the same items).
DEFAULT_BATCH_SIZE = 8
# Its records and cache keys name no backend, as before there was a choice.
DEFAULT_BACKEND = "hf"


@dataclass(frozen=True)
class Runtime:
    """Where and how the weights run: one device and dtype per process, lm-eval's batch size, and
    the accelerate state when `accelerate launch` started several processes."""

    device: str  # a torch device: "cpu", "cuda:0"
    dtype: str  # a key of ladder.io.loading.DTYPES
    batch_size: int | str = DEFAULT_BATCH_SIZE  # or "auto": lm-eval finds the largest that fits (a GPU)
    parallelize: bool = False  # split one model over every visible GPU (device_map="auto")
    accelerator: object | None = None  # an accelerate.Accelerator when processes > 1
    backend: str = DEFAULT_BACKEND  # a name in eval/backends' table: "hf" (this process) or "vllm"
    tensor_parallel: int = 1  # the vllm backend's tensor-parallel ranks
    data_parallel: int = 1  # the vllm backend's engines, each with tensor_parallel ranks

    @property
    def processes(self) -> int:
        return self.accelerator.num_processes if self.accelerator is not None else 1

    @property
    def rank(self) -> int:
        return self.accelerator.process_index if self.accelerator is not None else 0

    def describe(self) -> dict:
        return {
            "device": "auto (device_map)" if self.parallelize else self.device,
            "dtype": self.dtype,
            "batch_size": self.batch_size,
            "processes": self.processes,
            **(
                {"backend": self.backend, "tensor_parallel": self.tensor_parallel, "data_parallel": self.data_parallel}
                if self.backend != DEFAULT_BACKEND
                else {}
            ),
        }


def resolve_runtime(
    device: str = "auto",
    dtype: str = "auto",
    batch_size: int | str = DEFAULT_BATCH_SIZE,
    parallelize: bool = False,
    backend: str = DEFAULT_BACKEND,
    tensor_parallel: int = 1,
    data_parallel: int = 1,
) -> Runtime:
    """`auto`: a GPU in bfloat16 (float16 without bf16), else the CPU in float32; under `accelerate
    launch` each process takes the device accelerate gives it. The backend's `check` says the rest."""
    resolved = process_device(device)
    if backend == "vllm":
        use_spawn_where_cuda_may_be()  # before anything imports vLLM (its backend's check does)
    accelerator = None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        check_processes(device, parallelize)
        from accelerate import Accelerator, InitProcessGroupKwargs

        # Process 0 hashes the models and reads the cache while the others wait (a large model
        # takes a while): a generous timeout for the first collective.
        accelerator = Accelerator(
            cpu=resolved == "cpu",
            kwargs_handlers=[InitProcessGroupKwargs(timeout=datetime.timedelta(hours=6))],
        )
        device = "cpu" if accelerator.device.type == "cpu" else str(accelerator.device)
    else:
        device = resolved
    if parallelize and not device.startswith("cuda"):
        raise UsageError("--parallelize splits a model over GPUs: it needs --device cuda")
    if dtype == "auto":
        dtype = _default_dtype(device, backend)
    if batch_size == "auto" and device == "cpu":
        batch_size = DEFAULT_BATCH_SIZE
    return Runtime(device, dtype, batch_size, parallelize, accelerator, backend, tensor_parallel, data_parallel)


def check_processes(device: str, parallelize: bool) -> None:
    if parallelize:
        raise UsageError("--parallelize splits one model over all GPUs: it runs in one process (drop --processes)")
    if device.startswith("cuda:"):
        raise UsageError(f"--device {device} names one GPU; with several processes each takes its own")


def _default_dtype(device: str, backend: str) -> str:
    import torch

    if not device.startswith("cuda"):
        return "float32"
    if backend == "vllm":
        # torch's check makes a CUDA context on GPU 0 in this process, which runs no engine; vLLM's
        # platform reads the compute capability through NVML. Without vLLM its check refuses next.
        try:
            from vllm.platforms import current_platform
        except ImportError:
            return "bfloat16"
        return "bfloat16" if current_platform.has_device_capability(80) else "float16"
    return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"


def share(runtime: Runtime, value):
    """Process 0's `value` on every process (only process 0 reads the cache)."""
    if runtime.processes == 1:
        return value
    from accelerate.utils import broadcast_object_list

    return broadcast_object_list([value], from_process=0)[0]
