"""`convert_checkpoint`: a Llama, Mistral, Qwen2 or Qwen3 checkpoint rewired into a ladder one (no
weight changes, only `ladder_layers` in config.json). `ladder.convert.layout` checks and lays it out,
writing nothing (bad input fails there); `ladder.convert.execute` writes, verifies and records it.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ladder.errors import UsageError
from ladder.io.loading import gguf_parsed_once, resolve_model_path
from ladder.io.outputs import check_output
from ladder.layers import AutoLayers, LayerSpec, parse_layer_choice

from .execute import write_conversion
from .layout import (
    WEIGHT_MODES,
    ConversionSummary,
    default_output_dir,
    lay_out,
    open_source,
    read_source,
    search_layers,
)

if TYPE_CHECKING:
    import torch


def convert_checkpoint(
    source: str | Path | None,
    out: str | Path | None = None,
    ladder_layers: LayerSpec = None,
    dtype: torch.dtype | str | None = None,
    max_shard_size: int | None = None,
    force: bool = False,
    verify: bool | None = None,
    progress: bool = False,
    weights: str = "copy",
    calibration: list[str | Path] | None = None,
) -> ConversionSummary:
    """Write a ladder copy of `source` (a model `resolve_model_path` names) into `out`; the arguments
    are `ladder convert`'s options (`dtype` also a torch dtype, `max_shard_size` in bytes, `verify`
    None: when both models fit in memory). Bad input raises `UsageError` before anything is written.
    """
    started = time.perf_counter()
    if weights not in WEIGHT_MODES:
        raise UsageError(f"--weights {weights!r}: choose from {', '.join(WEIGHT_MODES)}")
    dtype = None if dtype is None else str(dtype).removeprefix("torch.")
    source_path = resolve_model_path(source)
    # A GGUF file is read for its checks, its tokenizer, config and weights, and its licence: parsed once.
    with gguf_parsed_once() if source_path.suffix == ".gguf" else contextlib.nullcontext():
        headers, num_layers = read_source(source_path)
        choice = parse_layer_choice(ladder_layers, num_layers, "--layers")
        if calibration is not None and not isinstance(choice, AutoLayers):
            raise UsageError("--calibration goes with --layers auto:N (it is the text the layer search measures on)")
        count = choice.count if isinstance(choice, AutoLayers) else len(choice)
        out = Path(out) if out is not None else default_output_dir(source_path, count)
        check_output(out, "convert", [source_path], force=force)
        opened = headers or open_source(source_path, dtype, progress)
        search = search_layers(opened, choice, calibration, progress) if isinstance(choice, AutoLayers) else None
        layers = search.chosen if search is not None else choice
        conversion = lay_out(opened, out, layers, search, dtype, max_shard_size, weights, verify)
        return write_conversion(conversion, force, progress, started)


def conversion_differences(out: str | Path, source: str | Path | None, ladder_layers: LayerSpec = None) -> list[str]:
    """The settings that `out`'s conversion.json records differently from these (as
    `convert_checkpoint` takes them); `conversion.json` itself when `out` has none."""
    manifest = Path(out) / "conversion.json"
    if not manifest.is_file():
        return ["conversion.json (missing)"]
    recorded = json.loads(manifest.read_text())
    differences = [] if recorded.get("source") == str(resolve_model_path(source).resolve()) else ["source"]
    choice = parse_layer_choice(ladder_layers, recorded["num_hidden_layers"], "ladder_layers")
    if isinstance(choice, AutoLayers):
        # Searched on convert's default calibration text; the search recorded its spec and choice.
        same_layers = (recorded.get("layer_search") or {}).get("spec") == str(choice)
    else:
        same_layers = recorded.get("ladder_layers") == choice
    return differences + ([] if same_layers else ["ladder_layers"])
