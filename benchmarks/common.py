"""What the benchmarks share. Every benchmark has one shape: `python -m benchmarks.NAME` runs
`run_benchmark(NAME, measure)`, whose `measure(argv)` parses its options with ladder.errors.ArgumentParser
(a bad one is one line, status 2, before any work)."""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import LlamaConfig

from ladder.cli_types import comma_list, int_in, positive_int
from ladder.convert.checks import expected_shapes
from ladder.errors import run_command
from ladder.io.files import atomic_write
from ladder.io.tensors import TensorSpec, cut_into_shards, write_shards
from ladder.plan.models import published_config

# The benchmarks' subprocesses run `python -m benchmarks.NAME` from here, whatever the caller's folder.
REPOSITORY = Path(__file__).resolve().parents[1]

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
PUBLISHED_SHAPES = {
    name: {key: published_config(name)[key] for key in SHAPE_KEYS}
    for name in ("smollm2-135m", "llama-3.2-1b", "llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b")
}
STANDARD = "standard"  # the variant the decode benchmarks compare every other with

# The columns of the decode benchmarks' tables (tp_speed, vllm_speed) from "decode ms/tok" on, as
# `table` takes them: title, format spec, the cell of a row.
DECODE_COLUMNS = [
    ("decode ms/tok", ">13", lambda row: f"{row['decode_ms_per_token']:.2f}"),
    ("spread", ">6", lambda row: f"{row['decode_spread']:.0%}"),
    ("tok/s", ">8", lambda row: f"{row['tokens_per_s']:.1f}"),
    ("vs standard", ">11", lambda row: f"{row['speedup_vs_standard']:.2f}x"),
]


def llama_shape(hidden: int, intermediate: int, heads: int, kv_heads: int, layers: int, vocab: int) -> dict:
    """A shape by SHAPE_KEYS, for a benchmark's own CPU sizes."""
    return dict(zip(SHAPE_KEYS, (hidden, intermediate, heads, kv_heads, layers, vocab)))


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


def run_benchmark(name: str, measure: Callable[[list[str]], int | None]) -> int:
    """A benchmark run as every command ends (ladder.errors.run_command), under its own name."""
    return run_command(name, measure, sys.argv[1:], label=name)


def add_decode_options(parser, name: str, prompt: int, tokens: int, rounds: int) -> None:
    """The options the decode benchmarks share (tp_speed, vllm_speed, plan_check), with their defaults."""
    add = parser.add_argument
    add("--batch", type=comma_list(positive_int), default="1,4", help="batch sizes, comma-separated (default 1,4)")
    add("--prompt-length", type=positive_int, default=prompt, help="prompt tokens per sequence (default %(default)s)")
    add(
        "--new-tokens",
        type=int_in(2, 1 << 20),
        default=tokens,
        help="tokens generated per run; decode is timed over all but the first (default %(default)s)",
    )
    add("--repeats", type=positive_int, default=rounds, help="timed rounds; medians are reported (default %(default)s)")
    add("--out", default=f"runs/bench/{name}.json", help="JSON results (default %(default)s)")


def write_report(out: str | Path, report: dict) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, json.dumps(report, indent=2) + "\n")


def table(rows: list[dict], columns: list[tuple[str, str, Callable[[dict], str]]]) -> list[str]:
    """A header, its rule and a line per row; a column is its title, its format spec (alignment and
    width) and its cell of a row."""
    header = " ".join(f"{title:{spec}}" for title, spec, _ in columns)
    return [header, "-" * len(header)] + [" ".join(f"{cell(row):{spec}}" for _, spec, cell in columns) for row in rows]


def write_synthetic_checkpoint(directory: Path, config: LlamaConfig, max_shard_size: int) -> None:
    """A checkpoint directory of `config`'s shapes with random float32 weights, written the way
    `save_pretrained` lays it out, one shard in memory at a time."""
    shapes = expected_shapes(config.to_dict())  # as LlamaForCausalLM's state_dict() lists them
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight")
    specs = [TensorSpec(name, torch.float32, shape) for name, shape in shapes.items()]
    staging = directory.with_name(directory.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    write_shards(
        staging,
        cut_into_shards(specs, max_shard_size),
        lambda name: torch.randn(shapes[name], generator=generator).mul_(0.02),
    )
    config.save_pretrained(staging)
    staging.rename(directory)
