"""Convert a Llama checkpoint into a ladder checkpoint: `convert_checkpoint`, the one library
function the CLI calls.

Conversion changes no weight, only the wiring (`ladder_layers` in config.json). It runs in two
halves: `ladder.convert.layout` opens and checks the source, chooses the layers and lays out the
output without writing anything (every source tensor checked against the shapes the config
implies, and used or dropped on purpose); `ladder.convert.execute` writes, verifies and records
it, the output directory appearing only once it is complete. Bad input raises `UsageError` in the
first half, before anything is written.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ladder.io.loading import gguf_parsed_once, resolve_model_path
from ladder.layers import AutoLayers, LayerSpec, parse_layer_choice

from .execute import write_conversion
from .layout import (
    ConversionSummary,
    check_calibration,
    check_weight_mode,
    choose_layers,
    lay_out,
    open_source,
    output_dir,
    read_source,
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
    """Write a ladder copy of `source` (a checkpoint directory, a .gguf file, or None for the
    embedded SmolLM2) into `out` (default `runs/convert/<name>-ladder<N>`).

    `ladder_layers`: N (upper N), "16-31", "3,5,7" or a list; default the upper half; "auto:N" or
    "auto:N:any" measure which layers to rewire (`ladder.layer_search`) on `calibration` text files or
    folders (default: training books from the data folder, never evaluation text). `dtype`:
    cast floating tensors (a torch dtype or its name; default: keep the source's; float32 for
    GGUF). `max_shard_size` in bytes: reshard (default: keep the source's shards). `verify`: None
    = when both models fit in memory. `weights`: how unchanged weight files reach the output
    (`WEIGHT_MODES`). Bad input raises `UsageError` before anything is written.
    """
    started = time.perf_counter()
    check_weight_mode(weights)
    dtype = None if dtype is None else str(dtype).removeprefix("torch.")
    source_path = resolve_model_path(source)
    # A GGUF file is read for its checks, its tokenizer, config and weights, and its licence: parsed once.
    with gguf_parsed_once() if source_path.suffix == ".gguf" else contextlib.nullcontext():
        headers = read_source(source_path)
        choice = parse_layer_choice(ladder_layers, headers.num_hidden_layers, "--layers")
        check_calibration(calibration, choice)
        out = output_dir(source_path, out, choice, force)
        opened = open_source(source_path, headers, dtype, progress)
        layers, search = choose_layers(opened, choice, calibration, progress)
        conversion = lay_out(opened, out, layers, search, dtype, max_shard_size, weights, verify)
        return write_conversion(conversion, force, weights, progress, started)


def conversion_differences(out: str | Path, source: str | Path | None, ladder_layers: LayerSpec = None) -> list[str]:
    """The settings that `out`'s conversion.json records differently from these (`source` and
    `ladder_layers` as `convert_checkpoint` takes them): what makes an existing conversion stale.
    Lists `conversion.json` itself when `out` has none (nothing says how it was made)."""
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
