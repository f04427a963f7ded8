"""What the benchmarks share. Every benchmark has one shape: `python -m benchmarks.NAME` runs
`run_benchmark(NAME, measure)`, whose `measure(argv)` parses its options with ladder.errors.ArgumentParser
(a bad one is one line, status 2, before any work)."""

from __future__ import annotations

import os
import platform
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ladder.errors import run_command
from ladder.io.tensors import TensorSpec, cut_into_shards, write_shards
from ladder.plan.models import published_config

# Published shapes to build with random weights (on GPU machines; each benchmark adds its own CPU
# sizes), by short names: rows of the one table of published shapes, ladder/plan/models.tsv.
SHAPE_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "num_hidden_layers",
    "vocab_size",
)
PUBLISHED_REPOS = {
    "smollm2-135m": "HuggingFaceTB/SmolLM2-135M",
    "llama-3.2-1b": "meta-llama/Llama-3.2-1B",
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B",
    "llama-3.1-70b": "meta-llama/Llama-3.1-70B",
    "llama-3.1-405b": "meta-llama/Llama-3.1-405B",
}
PUBLISHED_SHAPES = {
    name: {key: published_config(repo)[key] for key in SHAPE_KEYS} for name, repo in PUBLISHED_REPOS.items()
}


def machine() -> dict:
    """What a figure was measured on: the CPU, its count, the platform, torch, the load average now."""
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), None)
    return dict(
        cpu=cpu or platform.processor() or platform.machine(),
        cpus=os.cpu_count(),
        platform=platform.platform(),
        torch=torch.__version__,
        load_average=os.getloadavg()[0],
    )


def run_benchmark(name: str, measure: Callable[[list[str]], int | None], argv: list[str] | None = None) -> int:
    """A benchmark run as every command ends (ladder.errors.run_command), under its own name."""
    return run_command(name, measure, sys.argv[1:] if argv is None else argv, label=name)


def write_synthetic_checkpoint(directory: Path, config: LlamaConfig, max_shard_size: int, seed: int = 0) -> None:
    """A checkpoint directory of `config`'s shapes with random float32 weights, written the way
    `save_pretrained` lays it out, one shard in memory at a time."""
    with torch.device("meta"):
        names_and_shapes = [
            (name, tuple(tensor.shape))
            for name, tensor in LlamaForCausalLM(config).state_dict().items()
            if not (config.tie_word_embeddings and name == "lm_head.weight")
        ]
    specs = [TensorSpec(name, torch.float32, shape) for name, shape in names_and_shapes]
    staging = directory.with_name(directory.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    generator = torch.Generator().manual_seed(seed)
    shapes = {spec.name: spec.shape for spec in specs}
    write_shards(
        staging,
        cut_into_shards(specs, max_shard_size),
        lambda name: torch.randn(shapes[name], generator=generator).mul_(0.02),
    )
    config.save_pretrained(staging)
    staging.rename(directory)
