"""The models a run trains and learns from: the student as loaded (with its tokenizer and the facts
its model card names), the student's training settings, and the teacher for `kd` and `hidden`.

Under FSDP with `fsdp_cpu_ram_efficient_loading` (recipes/accelerate/fsdp-8gpu.yaml) only the main
process reads the checkpoints; the others build the same models with their parameters on the meta
device (`empty_model`: no weight read, no host memory) and receive them. The rewiring and the
teacher's copy work on the meta device as on real tensors; the student's shards come with FSDP's
preparation (accelerate's `fsdp2_load_full_state_dict` broadcasts each tensor from the main
process), and the teacher, which every process holds whole, by broadcast in `prepare_teacher`.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import re
import resource
import sys
from pathlib import Path

import torch
from accelerate import Accelerator, init_empty_weights
from accelerate.utils import DistributedType
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

import ladder
from ladder.errors import UsageError, first_line
from ladder.io.loading import gguf_parsed_once, load_config, load_model, load_tokenizer
from ladder.io.model_card import SourceFacts, source_facts
from ladder.layers import parse_ladder_layers

from .recipe import ModelSpec, Recipe, TrainableSpec

PEAK_RSS_UNIT = 1 if sys.platform == "darwin" else 1024  # getrusage's ru_maxrss: bytes on macOS, KiB elsewhere


def weights_from_main(accelerator: Accelerator) -> bool:
    """Whether only the main process reads the checkpoints: FSDP on several processes with
    `fsdp_cpu_ram_efficient_loading` (the launcher's config)."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    return (
        accelerator.distributed_type == DistributedType.FSDP
        and accelerator.num_processes > 1
        and bool(plugin is not None and plugin.cpu_ram_efficient_loading)
    )


def load_student(source: Path, empty: bool = False) -> tuple[torch.nn.Module, PreTrainedTokenizerBase, SourceFacts]:
    """The model at `source` (`empty`: its parameters on the meta device, see `empty_model`), its
    tokenizer, and the facts its model card will name."""
    # The model card's facts now, from the load's own parse of a GGUF file: at the end of training
    # a second parse (1-2 s, 170 MiB for SmolLM2's vocabulary) would set the run's peak RSS.
    with gguf_parsed_once():
        model, tokenizer = (empty_model(source), load_tokenizer(source)) if empty else load_model(source)
        facts = source_facts(source)
    return model, tokenizer, facts


def empty_model(source: Path) -> PreTrainedModel:
    """The model at `source` as `load_model` builds it (float32), its parameters on the meta device:
    no weight is read. Its buffers (the rotary frequencies) are real, computed from the config as the
    load computes them, so that FSDP's preparation, which receives only the state dict, keeps them."""
    import ladder.model.auto  # noqa: F401  (registers the ladder model with the Auto classes)

    config = load_config(source)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def load_teacher(
    recipe: Recipe, teacher_source: Path | None, student: torch.nn.Module, empty: bool = False
) -> torch.nn.Module | None:
    """For `kd` and `hidden`, the teacher: model.teacher (`empty`: on the meta device), else the
    original model, a copy of the student taken before its rewiring."""
    if not recipe.objective.needs_teacher():
        return None
    if teacher_source is not None:
        return empty_model(teacher_source) if empty else load_model(teacher_source)[0]
    return copy.deepcopy(student)  # the student, once rewired, shares the original's tensors


def configure_student(model: torch.nn.Module, spec: ModelSpec, checkpointing: str = "none") -> None:
    """Attention implementation, activation checkpointing (`checkpointing`: model.activation_checkpointing
    resolved, adapt/training_cost.py) and compilation, as model.* asks."""
    model.set_attn_implementation(spec.attn_implementation)
    if checkpointing != "none":
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False},
            every_n_layers=2 if checkpointing == "selective" else 1,
        )
    if spec.compiles(accelerator=torch.accelerator.is_available()):
        for layer in model.model.layers:
            layer.compile()  # in place: parameter names and checkpoints stay as they are


def prepare_teacher(
    teacher: torch.nn.Module, recipe: Recipe, device: torch.device, from_main: bool = False
) -> torch.nn.Module:
    """The teacher frozen on `device` in the recipe's precision, as a ladder model with its own wiring
    (none, for an original), so that its layers take the student's (attn_stream, mlp_stream)
    (adapt/distill.py). `from_main` (`weights_from_main`): every process receives it from the main one."""
    dtype = torch.bfloat16 if recipe.precision == "bf16" else torch.float32
    teacher = ladder.to_ladder(teacher, list(getattr(teacher.config, "ladder_layers", None) or []))
    teacher.set_attn_implementation(recipe.model.attn_implementation)  # the student's masks fit it
    if from_main:
        receive_from_main(teacher.to(dtype=dtype), device)
    else:
        teacher.to(device=device, dtype=dtype)
    return teacher.eval().requires_grad_(False)


def receive_from_main(module: torch.nn.Module, device: torch.device) -> None:
    """`module` on `device` in every process as the main process holds it: a process whose parameters
    are on the meta device allocates them there, then every parameter and buffer is broadcast from the
    main process (one tensor at a time: no second copy of the model anywhere)."""
    if any(parameter.is_meta for parameter in module.parameters()):
        module.to_empty(device=device)  # its buffers too: they are received below
        module.tie_weights()  # to_empty gave tied parameters a tensor each
    else:
        module.to(device)
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        torch.distributed.broadcast(tensor.data, src=0)


def reset_peak_host_memory() -> None:
    """Start this process's peak resident memory (Linux' VmHWM) afresh, so that `peak_host_memory`
    measures from here (where the kernel refuses, it measures from the process's start)."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def peak_host_memory(accelerator: Accelerator) -> str:
    """Each process's peak resident memory since `reset_peak_host_memory`, gathered, in words."""
    status = Path("/proc/self/status")
    found = re.search(r"^VmHWM:\s+(\d+) kB", status.read_text(), re.MULTILINE) if status.is_file() else None
    peak = int(found[1]) * 1024 if found else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * PEAK_RSS_UNIT
    peaks = accelerator.gather(torch.tensor([peak], device=accelerator.device)).tolist()
    return "host memory from the models' loading to the first step (peak RSS): " + ", ".join(
        f"{peak / 2**20:.0f} MiB on process {rank}" for rank, peak in enumerate(peaks)
    )


def make_trainable(
    model: torch.nn.Module, trainable: TrainableSpec, ladder_layers: list[int]
) -> tuple[torch.nn.Module, list[int]]:
    """Freeze all but the ladder layers (`ladder`), the named layers (`layers`), or wrap the model in
    LoRA adapters (`lora`); `all` trains everything. Returns the model and the layers left trainable
    (empty for `all` and `lora`)."""
    mode = trainable.mode
    layers: list[int] = []

    if mode in ("ladder", "layers"):
        if mode == "ladder":
            layers = ladder_layers
            if not layers:
                raise UsageError("trainable.mode=ladder: the model has no ladder layer")
        else:
            layers = parse_ladder_layers(trainable.layers, model.config.num_hidden_layers, "trainable.layers")
        model.requires_grad_(False)
        for index in layers:
            model.model.layers[index].requires_grad_(True)
    elif mode == "lora":
        from peft import LoraConfig, get_peft_model

        lora = trainable.lora
        config = LoraConfig(
            r=lora.r,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=lora.target_modules,
            task_type="CAUSAL_LM",
        )
        try:
            model = get_peft_model(model, config)
        except ValueError as error:
            raise UsageError(f"trainable.lora.target_modules: {first_line(error)}") from None
    return model, layers


__all__ = [
    "configure_student",
    "empty_model",
    "load_student",
    "load_teacher",
    "make_trainable",
    "peak_host_memory",
    "prepare_teacher",
    "receive_from_main",
    "reset_peak_host_memory",
    "weights_from_main",
]
