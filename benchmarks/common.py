"""What the benchmarks and their tests share: published Llama shapes the speed benchmarks can build
with random weights (on GPU machines; each benchmark adds its own CPU-sized shapes), and a
synthetic checkpoint of any shape written to disk."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ladder.io.tensors import TensorSpec, cut_into_shards, write_shards

PUBLISHED_SHAPES = {
    "smollm2-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_attention_heads=9,
        num_key_value_heads=3,
        num_hidden_layers=30,
        vocab_size=49152,
    ),
    "llama-3.2-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_hidden_layers=16,
        vocab_size=128256,
    ),
    "llama-3.1-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_hidden_layers=32,
        vocab_size=128256,
    ),
    "llama-3.1-70b": dict(
        hidden_size=8192,
        intermediate_size=28672,
        num_attention_heads=64,
        num_key_value_heads=8,
        num_hidden_layers=80,
        vocab_size=128256,
    ),
    "llama-3.1-405b": dict(
        hidden_size=16384,
        intermediate_size=53248,
        num_attention_heads=128,
        num_key_value_heads=8,
        num_hidden_layers=126,
        vocab_size=128256,
    ),
}


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


__all__ = ["PUBLISHED_SHAPES", "write_synthetic_checkpoint"]
