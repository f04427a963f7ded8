"""Ladder layer sets as users write them (`--layers`, recipe keys) and as the tools print them, and
the one check that a config is of a family the toolkit reads. Imports neither torch nor transformers,
so command-line checks run before any heavy import."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from ladder.errors import UsageError
from ladder.model.config_rules import LADDER_MODEL_TYPES, family_of, resolve_ladder_layers

# Keys of a family's config.json that describe the file, not the model: not carried into a ladder config.
CONFIG_BOOKKEEPING = ("model_type", "architectures", "auto_map", "transformers_version", "ladder_layers")


def check_model_type(model_type: object, where: str) -> str:
    """The family of a config's model_type (plain or ladder); any other refused naming `where`."""
    family = family_of(model_type)
    if family is None:
        raise UsageError(
            f"{where} has model_type {repr(model_type)[:80]}; supported families: {', '.join(LADDER_MODEL_TYPES)} "
            f"(and their ladder forms {', '.join(LADDER_MODEL_TYPES.values())})"
        )
    return family


def is_ladder_model_type(model_type: object) -> bool:
    return model_type in LADDER_MODEL_TYPES.values()


@dataclass(frozen=True)
class AutoLayers:
    """`auto:N` (contiguous) or `auto:N:any`; `ladder.layer_search.choose_ladder_layers` runs it."""

    count: int
    contiguous: bool = True

    def __str__(self) -> str:
        return f"auto:{self.count}" + ("" if self.contiguous else ":any")


def parse_auto_layers(spec: object, num_hidden_layers: int, key: str = "ladder layers") -> AutoLayers | None:
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
    """A layer choice as a sorted list: `N` (the upper N), `16-31`, `3,5,7` or `3-5,9` (text, an int or
    a list); bad input raises `UsageError` naming `key`. `parse_layer_choice` also takes `auto:N`."""
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


def parse_layer_choice(spec: LayerSpec, num_hidden_layers: int, key: str = "ladder layers") -> LayerChoice:
    """A layer spec (as `parse_ladder_layers`, or `auto:N[:any]`; None: the upper half) parsed once."""
    if isinstance(spec, AutoLayers):
        spec = str(spec)  # checked against this model's layer count like any other spec
    if spec is None:  # the upper half, as in the paper's 16 of 32
        spec = num_hidden_layers // 2
    auto = parse_auto_layers(spec, num_hidden_layers, key)
    return auto if auto is not None else parse_ladder_layers(spec, num_hidden_layers, key)


def resolve_layer_choice(choice: LayerChoice, search: Callable[[AutoLayers], list[int]]) -> list[int]:
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
    """How many of a ladder layer set's 2 * len(layers) all-reduces overlap compute: a contiguous block
    of k overlaps 2k - 1 (its last is needed in full by the next standard layer)."""
    runs = format_layers(sorted(layers)).split(",") if layers else []
    return 2 * len(layers) - len(runs)
