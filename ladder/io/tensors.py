"""Checkpoint weights through the safetensors library: `ShardedTensorIndex` (every header checked),
`LazyTensorLoader` (whole tensors or row/column slices) and `write_shards` (one shard in memory at a
time). Headers need no torch (a copy-mode conversion starts without it): torch is imported by the
functions that move tensors.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import SafetensorError, safe_open

from ladder.errors import UsageError, first_line

if TYPE_CHECKING:
    import torch

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# safetensors dtype code -> (torch's name for the dtype, bytes per element).
SAFETENSORS_DTYPES = {
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
    "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1),
    "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1),
    "U64": ("uint64", 8), "U32": ("uint32", 4), "U16": ("uint16", 2), "U8": ("uint8", 1), "BOOL": ("bool", 1),
}  # fmt: skip
ITEMSIZES = dict(SAFETENSORS_DTYPES.values())


@dataclass(frozen=True)
class TensorSpec:
    """What a header records about a tensor; `dtype` by torch's name ("bfloat16")."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self):
        if not isinstance(self.dtype, str):
            object.__setattr__(self, "dtype", str(self.dtype).removeprefix("torch."))
        if self.dtype not in ITEMSIZES:
            raise ValueError(f"tensor {self.name}: dtype {self.dtype} has no safetensors code")

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZES[self.dtype]

    @property
    def is_floating_point(self) -> bool:
        return self.dtype.startswith(("float", "bfloat"))


@dataclass(frozen=True)
class Shard:
    path: Path
    tensors: tuple[TensorSpec, ...]


@dataclass(frozen=True)
class OutputShard:
    filename: str
    tensors: tuple[TensorSpec, ...]


def read_shard(path: Path) -> Shard:
    """A safetensors header, checked without reading the tensors."""
    try:
        with safe_open(path, framework="numpy") as handle:
            tensors = []
            for name in handle.keys():
                part = handle.get_slice(name)
                tensors.append(TensorSpec(name, SAFETENSORS_DTYPES[part.get_dtype()][0], tuple(part.get_shape())))
    except (SafetensorError, KeyError, OSError) as error:
        raise UsageError(f"{path} is not a valid safetensors file: {first_line(error)}") from None
    return Shard(path, tuple(tensors))


@dataclass(frozen=True)
class ShardedTensorIndex:
    """A safetensors checkpoint directory: every shard's checked header, the index checked against them."""

    directory: Path
    shards: tuple[Shard, ...]

    @classmethod
    def from_directory(cls, directory: Path) -> ShardedTensorIndex | None:
        weight_map, index = {}, directory / INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                names = sorted(set(weight_map.values()))
                files = [directory / name for name in names]
            except (OSError, ValueError, KeyError, TypeError) as error:
                raise UsageError(f"cannot read the weight map of {index}: {first_line(error)}") from None
            if missing := [name for name, path in zip(names, files, strict=True) if not path.is_file()]:
                raise UsageError(f"shard {missing[0]} named in {INDEX_NAME} is missing from {directory}")
        elif (directory / SINGLE_NAME).is_file():
            files = [directory / SINGLE_NAME]
        else:
            return None
        shards = tuple(read_shard(path) for path in files)
        holder = {spec.name: shard.path.name for shard in shards for spec in shard.tensors}
        if len(holder) != sum(len(shard.tensors) for shard in shards):
            raise UsageError(f"{directory}: a tensor name appears in more than one shard")
        for name, filename in holder.items():
            if weight_map and weight_map.get(name) != filename:
                raise UsageError(f"{INDEX_NAME} puts {name} in {weight_map.get(name)}, but {filename} holds it")
        if missing := sorted(set(weight_map) - set(holder)):
            raise UsageError(f"{INDEX_NAME} names tensors that no shard holds: {', '.join(missing[:3])}")
        return cls(directory, shards)

    @property
    def files(self) -> list[Path]:
        return [shard.path for shard in self.shards]

    @functools.cached_property
    def tensors(self) -> dict[str, TensorSpec]:
        return {spec.name: spec for shard in self.shards for spec in shard.tensors}

    @functools.cached_property
    def _shard_by_name(self) -> dict[str, Shard]:
        return {spec.name: shard for shard in self.shards for spec in shard.tensors}

    def shard_of(self, name: str) -> Shard:
        if name not in self._shard_by_name:
            raise UsageError(f"checkpoint {self.directory} has no tensor {name}")
        return self._shard_by_name[name]


class LazyTensorLoader(contextlib.ExitStack):
    """Reads tensors of a `ShardedTensorIndex`, or only some rows or columns (all that is read); its
    shards stay open until the block ends."""

    def __init__(self, index: ShardedTensorIndex):
        super().__init__()
        self.index = index
        self._handles: dict[Path, object] = {}

    def read(self, name: str, rows: range | None = None, columns: range | None = None) -> torch.Tensor:
        path = self.index.shard_of(name).path
        if path not in self._handles:
            self._handles[path] = self.enter_context(safe_open(path, framework="pt"))
        part = self._handles[path].get_slice(name)
        if rows is not None:
            return part[rows.start : rows.stop]
        if columns is not None:
            return part[:, columns.start : columns.stop]
        return part[:]


def shard_filenames(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_NAME]
    return [f"model-{index:05d}-of-{count:05d}.safetensors" for index in range(1, count + 1)]


def cut_into_shards(tensors: Sequence[TensorSpec], max_shard_size: int) -> list[OutputShard]:
    """`tensors` in order, in shards of at most `max_shard_size` bytes (or one larger tensor)."""
    groups: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in tensors:
        if groups[-1] and size + spec.nbytes > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append(spec)
        size += spec.nbytes
    return [OutputShard(name, tuple(group)) for name, group in zip(shard_filenames(len(groups)), groups)]


def write_shards(directory: Path, shards: Sequence[OutputShard], read: Callable[[str], torch.Tensor]) -> None:
    """Each shard through `save_file`, each tensor `read(name)` cast to its spec's dtype; the index
    only for several shards, as transformers does."""
    import torch
    from safetensors.torch import save_file

    for shard in shards:
        tensors = {spec.name: read(spec.name).to(getattr(torch, spec.dtype)).contiguous() for spec in shard.tensors}
        save_file(tensors, directory / shard.filename, metadata={"format": "pt"})
        del tensors
    if len(shards) > 1:
        write_index(directory, shards)


def write_index(directory: Path, shards: Sequence[OutputShard]) -> None:
    weight_map = {spec.name: shard.filename for shard in shards for spec in shard.tensors}
    total_size = sum(spec.nbytes for shard in shards for spec in shard.tensors)
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
