"""Checkpoint IO, the one module that reads and writes weight files (mergekit's tensor IO is the
model): `ShardedTensorIndex` (which shard holds which tensor, headers checked),
`LazyTensorLoader` (whole tensors or row/column slices, for the tensor-parallel runtime), streamed
chunked reads and planned shard writes. Copying, linking and flushing whole files is
`ladder.io.fs`'s.

Memory stays bounded by one chunk (64 MiB), whatever the size of a tensor, a shard or the model.
The `safetensors` library reads through mmap (every byte read stays in the RSS until the file is
closed, up to the whole shard) and writes a file from tensors that are all in memory at once;
a checkpoint far larger than RAM needs neither. The format is small (an 8-byte little-endian
header length, a JSON header, then the tensors' bytes back to back), so it is read and written
here directly; the tests check that the `safetensors` library reads what this writes.

Headers and indexes need no torch (a copy-mode conversion starts without it, in a
fraction of a second): a `TensorSpec` names its dtype as torch does ("bfloat16"), and torch is
imported by the functions that move tensors.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ladder.errors import UsageError, first_line

if TYPE_CHECKING:
    import torch

CHUNK_BYTES = 64 << 20
# The largest header the safetensors library accepts.
MAX_HEADER_BYTES = 100_000_000
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# safetensors dtype code -> (torch's name for the dtype, bytes per element).
SAFETENSORS_DTYPES = {
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
    "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1),
    "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1),
    "U64": ("uint64", 8), "U32": ("uint32", 4), "U16": ("uint16", 2), "U8": ("uint8", 1), "BOOL": ("bool", 1),
}  # fmt: skip
DTYPE_CODES = {name: code for code, (name, _) in SAFETENSORS_DTYPES.items()}
ITEMSIZES = dict(SAFETENSORS_DTYPES.values())


@dataclass(frozen=True)
class TensorSpec:
    """What a header records about a tensor, and what the shape checks compare. `dtype` is torch's
    name for it ("bfloat16"); a `torch.dtype` given is stored by its name."""

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

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)


@dataclass(frozen=True)
class Shard:
    """One safetensors file as its (checked) header describes it; `tensors` in file order."""

    path: Path
    data_start: int
    tensors: tuple[TensorSpec, ...]


@dataclass(frozen=True)
class OutputShard:
    """A safetensors file to write: its name and its tensors, in order."""

    filename: str
    tensors: tuple[TensorSpec, ...]


def read_shard(path: Path) -> Shard:
    """Parse and check a safetensors header without reading the tensors: a truncated or corrupt
    file is a `UsageError` that names it."""

    def invalid(reason: str) -> UsageError:
        return UsageError(f"{path} is not a valid safetensors file: {reason}")

    size = path.stat().st_size
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise invalid(f"truncated to {size} bytes, shorter than the header length field")
        (header_size,) = struct.unpack("<Q", prefix)
        if header_size > min(MAX_HEADER_BYTES, size - 8):
            raise invalid(f"header length {header_size} does not fit the file ({size} bytes): truncated or corrupt")
        try:
            header = json.loads(handle.read(header_size))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise invalid(f"the header is not JSON ({error})") from None
        except RecursionError:
            raise invalid("the header nests too deeply") from None
    if not isinstance(header, dict):
        raise invalid("the header is not a JSON object")
    header.pop("__metadata__", None)
    placed = []
    for name, entry in header.items():
        try:
            # Whole numbers only: int() of 1e999 overflows, of 2.5 truncates silently.
            if not all(type(n) is int for n in [*entry["shape"], *entry["data_offsets"]]):
                raise ValueError
            spec = TensorSpec(name, SAFETENSORS_DTYPES[entry["dtype"]][0], tuple(entry["shape"]))
            begin, end = entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise invalid(f"tensor {name!r} has a malformed entry {entry!r}") from None
        if min(spec.shape, default=0) < 0 or end - begin != spec.nbytes:
            raise invalid(
                f"tensor {name!r}: offsets {begin}-{end} do not hold shape {list(spec.shape)} {entry['dtype']}"
            )
        placed.append((begin, spec))
    placed.sort(key=lambda item: item[0])
    position = 0
    for begin, spec in placed:
        if begin != position:
            raise invalid(f"tensor {spec.name!r} starts at data byte {begin}, expected {position}")
        position += spec.nbytes
    available = size - 8 - header_size
    if position > available:
        raise invalid(f"truncated: the header describes {position} bytes of tensor data, the file holds {available}")
    if position < available:
        raise invalid(f"{available - position} stray bytes after the last tensor")
    return Shard(path, 8 + header_size, tuple(spec for _, spec in placed))


def read_weight_map(index: Path) -> dict[str, str]:
    """The tensor -> file map of a `*.index.json`; every file it names must exist beside it."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise UsageError(f"cannot read the weight map of {index}: {first_line(error)}") from None
    for filename in sorted(set(weight_map.values())):
        if not (index.parent / filename).is_file():
            raise UsageError(f"shard {filename} named in {index.name} is missing from {index.parent}")
    return weight_map


def weight_files(directory: Path, index_name: str, single_name: str) -> tuple[list[Path], dict[str, str]] | None:
    """The weight files of one format in a checkpoint directory, with its index's weight map (empty
    for a single file); None when the directory has neither."""
    if (directory / index_name).is_file():
        weight_map = read_weight_map(directory / index_name)
        return [directory / name for name in sorted(set(weight_map.values()))], weight_map
    if (directory / single_name).is_file():
        return [directory / single_name], {}
    return None


def check_weight_map(weight_map: dict[str, str], holder: dict[str, str], index_name: str) -> None:
    """The index (`weight_map`) and the files (`holder`: tensor -> file that holds it) must agree."""
    for name, filename in holder.items():
        if weight_map and weight_map.get(name) != filename:
            raise UsageError(f"{index_name} puts {name} in {weight_map.get(name)}, but {filename} holds it")
    if missing := sorted(set(weight_map) - set(holder)):
        raise UsageError(f"{index_name} names tensors that no shard holds: {', '.join(missing[:3])}")


@dataclass(frozen=True)
class ShardedTensorIndex:
    """A safetensors checkpoint directory (one `model.safetensors`, or shards listed in
    `model.safetensors.index.json`): every shard's checked header, the index checked against them."""

    directory: Path
    shards: tuple[Shard, ...]

    @classmethod
    def from_directory(cls, directory: Path) -> ShardedTensorIndex | None:
        """The index of `directory`, or None when it holds no safetensors weights."""
        found = weight_files(directory, INDEX_NAME, SINGLE_NAME)
        if found is None:
            return None
        files, weight_map = found
        shards = tuple(read_shard(path) for path in files)
        holder = {spec.name: shard.path.name for shard in shards for spec in shard.tensors}
        if len(holder) != sum(len(shard.tensors) for shard in shards):
            raise UsageError(f"{directory}: a tensor name appears in more than one shard")
        check_weight_map(weight_map, holder, INDEX_NAME)
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


class LazyTensorLoader:
    """Reads the tensors of a `ShardedTensorIndex`, or only some rows or columns of them (the slice
    is all that is read: the safetensors library's `get_slice`), each shard opened once."""

    def __init__(self, index: ShardedTensorIndex):
        from safetensors import safe_open  # only readers of slices need it

        self.index, self._safe_open = index, safe_open
        self._handles: dict[Path, object] = {}
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> LazyTensorLoader:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def read(self, name: str, rows: range | None = None, columns: range | None = None) -> torch.Tensor:
        """Tensor `name`, or only the given rows or columns of it."""
        path = self.index.shard_of(name).path
        if path not in self._handles:
            self._handles[path] = self._stack.enter_context(self._safe_open(path, framework="pt"))
        part = self._handles[path].get_slice(name)
        if rows is not None:
            return part[rows.start : rows.stop]
        if columns is not None:
            return part[:, columns.start : columns.stop]
        return part[:]


def row_blocks(shape: Sequence[int], itemsize: int, chunk_bytes: int = CHUNK_BYTES) -> Iterator[tuple[int, int]]:
    """(start, stop) ranges over the first dimension, each at most `chunk_bytes` (at least one row):
    row blocks of a contiguous tensor are contiguous byte ranges, so a tensor streams in pieces."""
    if not shape:
        yield 0, 1
        return
    row_bytes = math.prod(shape[1:]) * itemsize
    step = max(1, chunk_bytes // max(row_bytes, 1))
    for start in range(0, max(shape[0], 1), step):
        yield start, min(start + step, shape[0])


def read_chunks(
    shard: Shard, on_read: Callable[[memoryview], None], chunk_bytes: int = CHUNK_BYTES
) -> Iterator[tuple[TensorSpec, torch.Tensor]]:
    """Yield the tensors of a shard in file order as row blocks of at most `chunk_bytes`, reading
    the file once from front to back; `on_read` sees every byte, header included (progress).

    The blocks are views of one reused buffer (fresh memory for each would cost more than the
    read): a block is valid until the next one is yielded; clone it to keep it."""
    import torch

    buffer = torch.empty(0, dtype=torch.uint8)
    with open(shard.path, "rb") as handle:
        on_read(memoryview(handle.read(shard.data_start)))
        for spec in shard.tensors:
            row_shape = spec.shape[1:]
            for start, stop in row_blocks(spec.shape, ITEMSIZES[spec.dtype], chunk_bytes):
                nbytes = (stop - start) * math.prod(row_shape) * ITEMSIZES[spec.dtype] if spec.shape else spec.nbytes
                if nbytes > len(buffer):
                    buffer = torch.empty(nbytes, dtype=torch.uint8)
                view = memoryview(buffer[:nbytes].numpy())
                if handle.readinto(view) != nbytes:
                    raise UsageError(f"{shard.path} became shorter while it was being read")
                on_read(view)
                shape = (stop - start, *row_shape) if spec.shape else ()
                yield spec, buffer[:nbytes].view(spec.torch_dtype).reshape(shape)


def split_rows(spec: TensorSpec, tensor: torch.Tensor) -> Iterator[tuple[TensorSpec, torch.Tensor]]:
    """An in-memory tensor as the same row blocks `read_chunks` yields (views, no copies)."""
    if not spec.shape:
        yield spec, tensor
        return
    for start, stop in row_blocks(spec.shape, tensor.dtype.itemsize):
        yield spec, tensor[start:stop]


class SafetensorsWriter:
    """Writes one safetensors file whose tensors are known up front: the header first, then each
    tensor's bytes as they arrive, in order, in any number of row blocks, cast to the planned
    dtype on the way (into one reused buffer)."""

    def __init__(self, path: Path, tensors: Sequence[TensorSpec]):
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for spec in tensors:
            header[spec.name] = {
                "dtype": DTYPE_CODES[spec.dtype],
                "shape": list(spec.shape),
                "data_offsets": [offset, offset + spec.nbytes],
            }
            offset += spec.nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the safetensors library aligns tensor data to 8 bytes
        self.path = path
        self._pending = list(reversed(tensors))
        self._remaining = tensors[0].nbytes if tensors else 0
        self._cast_buffer = None
        self._handle = open(path, "wb")
        self._handle.write(struct.pack("<Q", len(encoded)) + encoded)

    def write(self, name: str, block: torch.Tensor) -> None:
        """Append a row block of tensor `name`, which must be the next tensor due."""
        import torch

        spec = self._pending[-1]
        if name != spec.name:
            raise RuntimeError(f"{self.path}: got {name}, expected {spec.name}")
        if block.dtype != spec.torch_dtype:
            nbytes = block.numel() * ITEMSIZES[spec.dtype]
            if self._cast_buffer is None or nbytes > len(self._cast_buffer):
                self._cast_buffer = torch.empty(nbytes, dtype=torch.uint8)
            block = self._cast_buffer[:nbytes].view(spec.torch_dtype).view(block.shape).copy_(block)
        data = block.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        if data.nbytes > self._remaining:
            raise RuntimeError(f"{self.path}: more bytes than the shape of {name} holds")
        self._handle.write(data)
        self._remaining -= data.nbytes
        if self._remaining == 0:
            self._pending.pop()
            self._remaining = self._pending[-1].nbytes if self._pending else 0

    def close(self) -> None:
        """A file with tensors still due is an error (and is left incomplete)."""
        self._handle.close()
        if self._pending:
            raise RuntimeError(f"{self.path}: closed before {self._pending[-1].name} was written")


def shard_filenames(count: int) -> list[str]:
    """The names transformers gives `count` shards."""
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{index:05d}-of-{count:05d}.safetensors" for index in range(1, count + 1)]


def plan_shards(tensors: Sequence[TensorSpec], max_shard_size: int) -> list[OutputShard]:
    """Cut `tensors`, kept in order, into shards of at most `max_shard_size` bytes (a tensor larger
    than that gets a shard of its own)."""
    groups: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in tensors:
        if groups[-1] and size + spec.nbytes > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append(spec)
        size += spec.nbytes
    return [OutputShard(name, tuple(group)) for name, group in zip(shard_filenames(len(groups)), groups)]


class ShardedWriter:
    """Writes planned shards one after another, one file open at a time, then the index (only
    when there is more than one shard, as transformers does)."""

    def __init__(self, directory: Path, shards: Sequence[OutputShard]):
        self.directory = directory
        self.shards = list(shards)
        self._shard_of = {spec.name: index for index, shard in enumerate(self.shards) for spec in shard.tensors}
        self._writer: SafetensorsWriter | None = None
        self._opened = -1

    def write(self, name: str, block: torch.Tensor) -> None:
        index = self._shard_of[name]
        if index != self._opened:
            if index != self._opened + 1:
                raise RuntimeError(f"tensor {name} arrived out of the planned shard order")
            if self._writer is not None:
                self._writer.close()
            shard = self.shards[index]
            self._writer = SafetensorsWriter(self.directory / shard.filename, shard.tensors)
            self._opened = index
        self._writer.write(name, block)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._opened != len(self.shards) - 1:
            raise RuntimeError(f"only {self._opened + 1} of {len(self.shards)} shards were written")
        if len(self.shards) > 1:
            write_index(self.directory, self.shards)


def write_index(directory: Path, shards: Sequence[OutputShard]) -> None:
    """`model.safetensors.index.json`: which shard holds each tensor."""
    weight_map = {spec.name: shard.filename for shard in shards for spec in shard.tensors}
    total_size = sum(spec.nbytes for shard in shards for spec in shard.tensors)
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
