"""The models a run trains and learns from: the student as loaded, its training settings, and the
teacher for `kd` and `hidden`.

Under FSDP with `fsdp_cpu_ram_efficient_loading` only the main process reads the checkpoints; the
others build the same models on the meta device (`empty_model`) and receive them: the student's shards
with FSDP's preparation, the teacher, which every process holds whole, by broadcast.
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
    """Whether only the main process reads the checkpoints (FSDP with `fsdp_cpu_ram_efficient_loading`)."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    return (
        accelerator.distributed_type == DistributedType.FSDP
        and accelerator.num_processes > 1
        and bool(plugin is not None and plugin.cpu_ram_efficient_loading)
    )


def load_student(source: Path, empty: bool = False) -> tuple[torch.nn.Module, PreTrainedTokenizerBase, SourceFacts]:
    """The model at `source` (`empty`: on the meta device), its tokenizer, and its model card's facts,
    read now from the load's own parse of a GGUF file (a second parse at the end would set the peak RSS)."""
    with gguf_parsed_once():
        model, tokenizer = (empty_model(source), load_tokenizer(source)) if empty else load_model(source)
        facts = source_facts(source)
    return model, tokenizer, facts


def empty_model(source: Path) -> PreTrainedModel:
    """The model at `source` as `load_model` builds it, its parameters on the meta device (no weight
    read); its buffers (the rotary frequencies) real, since FSDP's preparation receives only the state dict."""
    import ladder.model.auto  # noqa: F401  (registers the ladder model with the Auto classes)

    config = load_config(source)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def load_teacher(
    recipe: Recipe, teacher_source: Path | None, student: torch.nn.Module, empty: bool = False
) -> torch.nn.Module | None:
    """For `kd` and `hidden`, the teacher: model.teacher, else a copy of the student before its rewiring."""
    if not recipe.objective.needs_teacher():
        return None
    if teacher_source is not None:
        return empty_model(teacher_source) if empty else load_model(teacher_source)[0]
    return copy.deepcopy(student)  # the student, once rewired, shares the original's tensors


def configure_student(model: torch.nn.Module, spec: ModelSpec, checkpointing: str = "none") -> None:
    """Attention implementation, activation checkpointing (resolved) and compilation, as model.* asks."""
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
    (none, for an original), so that its layers take the student's two streams (adapt/distill.py)."""
    dtype = torch.bfloat16 if recipe.precision == "bf16" else torch.float32
    teacher = ladder.to_ladder(teacher, list(getattr(teacher.config, "ladder_layers", None) or []))
    teacher.set_attn_implementation(recipe.model.attn_implementation)  # the student's masks fit it
    if from_main and any(parameter.is_meta for parameter in teacher.parameters()):
        teacher.to(dtype=dtype).to_empty(device=device)  # its buffers too: they are received below
        teacher.tie_weights()  # to_empty gave tied parameters a tensor each
    else:
        teacher.to(device=device, dtype=dtype)
    if from_main:  # every process holds the teacher as the main process does, broadcast a tensor at a time
        for tensor in itertools.chain(teacher.parameters(), teacher.buffers()):
            torch.distributed.broadcast(tensor.data, src=0)
    return teacher.eval().requires_grad_(False)


def reset_peak_host_memory() -> None:
    """Start this process's peak resident memory (Linux' VmHWM) afresh: `peak_host_memory` measures from here."""
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
    """The model with all but the layers trainable.mode names frozen (or in LoRA adapters), and those layers."""
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
