"""Ladder layer sets as users write them (`--layers`, recipe keys) and as the tools print them, and
the one check that a config is a Llama the toolkit reads. Imports neither torch nor transformers,
so command-line checks run before any heavy import."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from ladder.errors import UsageError
from ladder.model.config_rules import resolve_ladder_layers

# `LadderLlamaConfig.model_type`, the published checkpoints' name. The configuration file travels
# inside checkpoints and cannot import this package, so the name is spelled in both places (a test
# checks that they agree).
LADDER_MODEL_TYPE = "llamaLadder"
LLAMA_MODEL_TYPES = ("llama", LADDER_MODEL_TYPE)
# Keys of a Llama config.json that describe the file, not the model: not carried into a ladder config.
CONFIG_BOOKKEEPING = ("model_type", "architectures", "auto_map", "transformers_version", "ladder_layers")


def check_llama_model_type(model_type: object, where: str) -> None:
    """Refuse a config that is neither a Llama nor a ladder Llama; `where` names the file or model."""
    if model_type not in LLAMA_MODEL_TYPES:
        raise UsageError(
            f"{where} has model_type {model_type!r}; supported: "
            f"{' or '.join(map(repr, LLAMA_MODEL_TYPES))} (Llama-architecture checkpoints)"
        )


@dataclass(frozen=True)
class AutoLayers:
    """`auto:N` (the contiguous window of N layers that the rewiring damages least, measured) or
    `auto:N:any` (any N layers, ranked one by one). `ladder.layer_search.choose_ladder_layers` runs it."""

    count: int
    contiguous: bool = True

    def __str__(self) -> str:
        return f"auto:{self.count}" + ("" if self.contiguous else ":any")


def parse_auto_layers(spec: object, num_hidden_layers: int, key: str = "ladder layers") -> AutoLayers | None:
    """The `auto:N` / `auto:N:any` form of a layer choice, or None for any other spec."""
    if not (isinstance(spec, str) and spec.strip().startswith("auto")):
        return None
    match = re.fullmatch(r"auto:(\d+)(:any)?", spec.strip())
    if match is None:
        raise UsageError(
            f"{key}: {spec!r} is not auto:N (a contiguous window of N layers) or auto:N:any (any N layers)"
        )
    count = int(match.group(1))
    if not 1 <= count <= num_hidden_layers:
        raise UsageError(
            f"{key}: {spec!r} needs 1 <= N <= {num_hidden_layers} (the model has {num_hidden_layers} layers)"
        )
    return AutoLayers(count, contiguous=match.group(2) is None)


def parse_ladder_layers(spec: str | int | list[int], num_hidden_layers: int, key: str = "ladder layers") -> list[int]:
    """A layer choice as a sorted list: `N` (the upper N layers), a range `16-31`, or a list of
    indices and ranges `3,5,7` / `3-5,9` (as text, an int or a list). Bad input raises `UsageError` naming `key`.
    `auto:N` needs a model to measure: callers that accept it use `parse_layer_choice`."""
    if parse_auto_layers(spec, num_hidden_layers, key) is not None:
        raise UsageError(
            f"{key}: {spec!r} chooses layers by measuring a model, which is not possible here; "
            "name the layers (N, 16-31 or 3,5,7)"
        )
    if isinstance(spec, str):
        text = spec.strip()
        try:
            if "," in text or "-" in text.lstrip("-"):
                spec = [layer for part in text.split(",") if part.strip() for layer in _layer_range(part.strip(), key)]
            else:
                spec = int(text)
        except ValueError:
            raise UsageError(
                f"{key}: {spec!r} is not a number, a range like 16-31 or a list like 3,5,7 or 3-5,9"
            ) from None
    try:
        return resolve_ladder_layers(spec, num_hidden_layers)
    except ValueError as error:
        raise UsageError(f"{key}: {error} (the model has {num_hidden_layers} layers)") from None


def _layer_range(part: str, key: str) -> list[int]:
    """One item of a layer list: an index `7` or an inclusive range `3-5`."""
    if "-" not in part.lstrip("-"):
        return [int(part)]
    first, last = (int(bound) for bound in part.split("-"))
    if first > last:
        raise UsageError(f"{key}: layer range {part!r} runs backwards")
    return list(range(first, last + 1))


# A layer choice parsed once (`parse_layer_choice`): the layers themselves, or an `auto:N` search still to run.
LayerChoice = list[int] | AutoLayers
# What a layer choice may be given as: the spec as users write it, or an already parsed choice.
LayerSpec = str | int | list[int] | AutoLayers | None


def upper_half(num_hidden_layers: int) -> int:
    """The default layer count: the upper half, as in the paper's 16 of 32."""
    return num_hidden_layers // 2


def parse_layer_choice(spec: LayerSpec, num_hidden_layers: int, key: str = "ladder layers") -> LayerChoice:
    """A layer spec (N, "16-31", "3,5,7", a list, "auto:N", "auto:N:any"; None = the upper half)
    parsed once into explicit layers or an `AutoLayers` search. Bad input raises `UsageError` naming `key`."""
    if isinstance(spec, AutoLayers):
        spec = str(spec)  # checked against this model's layer count like any other spec
    if spec is None:
        spec = upper_half(num_hidden_layers)
    auto = parse_auto_layers(spec, num_hidden_layers, key)
    return auto if auto is not None else parse_ladder_layers(spec, num_hidden_layers, key)


def resolve_layer_choice(choice: LayerChoice, search: Callable[[AutoLayers], list[int]]) -> list[int]:
    """The layers of a choice: explicit layers as they are, `auto:N` by running `search` (the caller's
    `ladder.layer_search` run, on its model and calibration text)."""
    return search(choice) if isinstance(choice, AutoLayers) else choice


def format_layers(layers: list[int]) -> str:
    """[3, 4, 5, 9] -> '3-5,9' (also a valid `--layers` value); [] -> 'none'."""
    runs: list[list[int]] = []
    for layer in layers:
        if runs and layer == runs[-1][-1] + 1:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    return ",".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs) or "none"


def overlapped_all_reduces(layers: list[int]) -> int:
    """How many of the 2 * len(layers) all-reduces of a ladder layer set run behind compute under
    tensor parallelism: a contiguous block of k ladder layers overlaps 2k - 1 of its 2k (the block's
    last MLP all-reduce is needed in full by the next standard layer)."""
    runs = format_layers(sorted(layers)).split(",") if layers else []
    return 2 * len(layers) - len(runs)


__all__ = [
    "CONFIG_BOOKKEEPING",
    "LADDER_MODEL_TYPE",
    "LLAMA_MODEL_TYPES",
    "AutoLayers",
    "LayerChoice",
    "LayerSpec",
    "check_llama_model_type",
    "format_layers",
    "overlapped_all_reduces",
    "parse_auto_layers",
    "parse_ladder_layers",
    "parse_layer_choice",
    "resolve_layer_choice",
    "upper_half",
]
