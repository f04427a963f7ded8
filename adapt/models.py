"""The models a run trains and learns from: the student as loaded (with its tokenizer and the facts
its model card names), the student's training settings, and the teacher for `kd` and `hidden`."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

import ladder
from ladder.io.loading import gguf_parsed_once, load_model
from ladder.io.model_card import SourceFacts, source_facts

from .recipe import ModelSpec, Recipe


def load_student(source: Path) -> tuple[torch.nn.Module, PreTrainedTokenizerBase, SourceFacts]:
    """The model at `source`, its tokenizer, and the facts its model card will name."""
    # The model card's facts now, from the load's own parse of a GGUF file: at the end of training
    # a second parse (1-2 s, 170 MiB for SmolLM2's vocabulary) would set the run's peak RSS.
    with gguf_parsed_once():
        model, tokenizer = load_model(source)
        facts = source_facts(source)
    return model, tokenizer, facts


def load_teacher(recipe: Recipe, teacher_source: Path | None, student: torch.nn.Module) -> torch.nn.Module | None:
    """For `kd` and `hidden`, the teacher: model.teacher, else the original model, a copy of the
    student taken before its rewiring."""
    if not recipe.objective.needs_teacher():
        return None
    if teacher_source is not None:
        return load_model(teacher_source)[0]
    return copy.deepcopy(student)  # the student, once rewired, shares the original's tensors


def configure_student(model: torch.nn.Module, spec: ModelSpec) -> None:
    """Attention implementation, activation checkpointing and compilation, as model.* asks."""
    model.set_attn_implementation(spec.attn_implementation)
    if spec.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if spec.compile:
        for layer in model.model.layers:
            layer.compile()  # in place: parameter names and checkpoints stay as they are


def prepare_teacher(teacher: torch.nn.Module, recipe: Recipe, device: torch.device) -> torch.nn.Module:
    """The teacher frozen on `device` in the recipe's precision, as a ladder model with its own wiring
    (none, for an original), so that its layers take the student's (attn_stream, mlp_stream)
    (adapt/distill.py)."""
    dtype = torch.bfloat16 if recipe.precision == "bf16" else torch.float32
    teacher = ladder.to_ladder(teacher, list(getattr(teacher.config, "ladder_layers", None) or []))
    teacher.set_attn_implementation(recipe.model.attn_implementation)  # the student's masks fit it
    return teacher.to(device=device, dtype=dtype).eval().requires_grad_(False)


__all__ = ["configure_student", "load_student", "load_teacher", "prepare_teacher"]
