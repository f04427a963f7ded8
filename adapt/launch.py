"""The accelerator a run trains under (one process, DDP or FSDP, as `accelerate launch` says) and its
experiment trackers."""

from __future__ import annotations

import datetime
import os
import traceback
from pathlib import Path

import torch
from accelerate import Accelerator, PartialState
from accelerate.tracking import get_available_trackers
from accelerate.utils import (
    DistributedType,
    FullyShardedDataParallelPlugin,
    InitProcessGroupKwargs,
    parse_flag_from_env,
)

from ladder.errors import UsageError
from ladder.io.files import atomic_write
from ladder.log import log

from .recipe import Recipe

WANDB_ID_FILE = "wandb-run-id"


def make_accelerator(recipe: Recipe, run_dir: Path) -> Accelerator:
    """The accelerator with the recipe's experiment trackers (a missing package refused before any weight loads)."""
    for name in recipe.logging.log_with:
        if name not in {str(t) for t in get_available_trackers()}:
            raise UsageError(f"logging.log_with: {name} needs its package (pip install {name.replace('_', '-')})")
    # `accelerate launch --cpu --num_processes N` starts one process (accelerate issue #2741): say so.
    if (
        os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true")
        and "MASTER_ADDR" in os.environ
        and "WORLD_SIZE" not in os.environ
        and "PMI_SIZE" not in os.environ
    ):
        log.warning(
            "ladder adapt: warning: `accelerate launch --cpu` started a single process; for several CPU "
            "processes use `accelerate launch --multi_gpu --num_processes N` (adapt trains on CPU over "
            "gloo when no GPU is present)"
        )
    # The processes start with the long setup timeout: the main process may tokenize, search layers
    # or load for a long while as the others wait at a barrier. Training shortens it (`set_timeout`).
    process_group = InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=recipe.timeout.setup))
    # With no GPU, processes started by `accelerate launch --multi_gpu` (or an FSDP config) train on CPU over gloo.
    cpu = not torch.accelerator.is_available()
    fsdp = parse_flag_from_env("ACCELERATE_USE_FSDP")
    if cpu and fsdp:
        enable_fsdp_on_cpu(process_group)
    return Accelerator(
        cpu=cpu,
        mixed_precision="bf16" if recipe.precision == "bf16" else "no",
        fsdp_plugin=fsdp_plugin(recipe) if fsdp else None,
        step_scheduler_with_optimizer=False,
        log_with=list(recipe.logging.log_with) or None,
        project_dir=str(run_dir),
        kwargs_handlers=[process_group],
    )


def fsdp_plugin(recipe: Recipe) -> FullyShardedDataParallelPlugin:
    """The FSDP settings `accelerate launch` passed, with parameters gathered in the recipe's precision and
    gradients reduce-scattered in fp32 (accelerate's bf16 policy would round every summed gradient to 8
    bits of mantissa; fp32, as torchtitan does, costs twice the reduce-scatter bytes)."""
    plugin = FullyShardedDataParallelPlugin()  # the rest from the FSDP_* variables the launcher set
    compute = torch.bfloat16 if recipe.precision == "bf16" else torch.float32
    policy = {"param_dtype": compute, "reduce_dtype": torch.float32}
    if plugin.fsdp_version == 1:
        policy["buffer_dtype"] = compute
    plugin.mixed_precision_policy = policy
    plugin.set_mixed_precision(policy)  # accelerate turns the dict into FSDP's policy object
    return plugin


def fsdp_precision(model: torch.nn.Module) -> str:
    """The mixed-precision policy every FSDP2 unit of a prepared model holds, read back from the units, in words."""
    from torch.distributed.fsdp import FSDPModule

    policies = {
        (unit._get_fsdp_state()._mp_policy.param_dtype, unit._get_fsdp_state()._mp_policy.reduce_dtype)
        for unit in model.modules()
        if isinstance(unit, FSDPModule)
    }
    return "; ".join(
        f"parameters in {str(params).removeprefix('torch.')}, gradients reduced in {str(reduce).removeprefix('torch.')}"
        for params, reduce in sorted(policies, key=str)
    )


def set_timeout(seconds: float) -> None:
    """Every process group's timeout for the collectives that follow (per group, as torchtitan does:
    FSDP's device mesh may add groups beside the default one)."""
    if not torch.distributed.is_initialized():
        return
    from torch.distributed import distributed_c10d

    for group in list(distributed_c10d._world.pg_map):
        distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=seconds), group)


def start_trackers(accelerator: Accelerator, recipe: Recipe, run_dir: Path, resumed_at: int) -> None:
    """Open the trackers so that a resumed run continues its history: TensorBoard purges what the
    interrupted run logged after the checkpoint, wandb reopens the same run (its id kept in the run folder)."""
    if not recipe.logging.log_with:
        return
    init_kwargs = {"tensorboard": {"purge_step": resumed_at + 1} if resumed_at else {}}
    if "wandb" in recipe.logging.log_with and accelerator.is_main_process:
        id_file = run_dir / WANDB_ID_FILE
        if not id_file.is_file():
            atomic_write(id_file, f"{recipe.name}-{os.urandom(4).hex()}")
        init_kwargs["wandb"] = {
            "id": id_file.read_text().strip(),
            "resume": "allow",
            "name": recipe.name,
            "dir": str(run_dir),
            "config": recipe.model_dump(),
        }
    accelerator.init_trackers(recipe.name, init_kwargs=init_kwargs)


def enable_fsdp_on_cpu(process_group: InitProcessGroupKwargs) -> None:
    """Let an FSDP launch run FSDP2 on CPU processes over gloo instead of silently falling back to DDP:
    accelerate 1.16 applies FSDP only to GPU-type process groups (`AcceleratorState.__init__`), while
    FSDP2 itself runs over gloo. The CPU group is started here and marked MULTI_GPU, so the Accelerator
    built next takes the FSDP branch on the CPU: how the tests run FSDP without GPUs."""
    state = PartialState(cpu=True, **process_group.to_kwargs())
    if state.distributed_type == DistributedType.MULTI_CPU:
        PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU


def raised_by_a_collective(error: BaseException) -> bool:
    """Whether `error` comes out of torch.distributed (gloo raises a plain RuntimeError, NCCL a DistBackendError)."""
    frames = traceback.extract_tb(error.__traceback__)
    return isinstance(error, torch.distributed.DistError) or (
        bool(frames) and f"torch{os.sep}distributed{os.sep}" in frames[-1].filename
    )
