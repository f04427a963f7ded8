"""Sources -> chunks of items in a fixed order, the unit of work of the tokenizing workers. A Hub
source is streamed; its chunks carry the stream's position, so that a resumed prepare, or a retry
after a network error, reopens the stream there.
"""

from __future__ import annotations

import contextlib
import glob
import importlib
import itertools
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from ladder.errors import UsageError, first_line
from ladder.io.files import OUTPUT_MARKER
from ladder.log import log

from .recipe import SourceSpec, expand_path
from .tokenize import Chunk

HF_PREFIX = "hf:"
# Characters of text per chunk (about 0.25 s of one core's tokenizing); LADDER_DATA_CHUNK_CHARS
# overrides it (tests make many small chunks). The blocks do not depend on it.
CHUNK_CHARS = int(os.environ.get("LADDER_DATA_CHUNK_CHARS", 1 << 20))
CHUNK_ITEMS = 4096  # and at most this many items
RECORD_CHARS = 2048  # a Hub chunk holds CHUNK_CHARS / RECORD_CHARS records (chat records run to a few kB)
HUB_RETRIES = 8  # a failing stream is reopened this many times in a row, waiting 1, 2, 4 ... 60 s


def local_files(source: SourceSpec, key: str, warn: bool = False) -> list[Path]:
    """The files a local source names: a file, a folder (recursively) or a glob; hidden ones are left out
    (`warn`: a line says so); a file in a folder the tool wrote (its output marker, at or above it) is refused."""
    root, pattern = source_root(source, key), expand_path(source.path, key)
    if root != Path(pattern):
        found = [Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file()]
        if not found:
            raise UsageError(f"{key}: the pattern {pattern} matches no file")
    elif root.is_file():
        found = [root]
    elif root.is_dir():
        found = [p for p in root.rglob("*") if p.is_file()]
    else:
        raise UsageError(f"{key}: {root} does not exist")
    hidden = [p for p in found if any(part.startswith(".") for part in p.relative_to(root).parts)]
    files = sorted(set(found) - set(hidden))
    if warn and hidden:
        log.warning(f"{key}: {len(hidden)} hidden file(s) not read, e.g. {min(hidden)}")
    if not files:
        raise UsageError(f"{key}: {root} holds no file that is not hidden")
    checked: set[Path] = set()
    for path in files:
        for folder in path.absolute().parents:
            if folder in checked:
                break
            checked.add(folder)
            if (folder / OUTPUT_MARKER).exists():
                raise UsageError(
                    f"{key}: {folder} was written by ladder (it holds {OUTPUT_MARKER}): training data never "
                    "includes the tool's outputs or caches; move it out, or name the data's files alone"
                )
    return files


def source_root(source: SourceSpec, key: str) -> Path:
    """The folder or file a local source reads as a whole: its path, or a glob's folder before the first wildcard."""
    path = Path(expand_path(source.path, key))
    fixed = itertools.takewhile(lambda part: not any(mark in part for mark in "*?["), path.parts)
    return Path(*fixed) if any(mark in str(path) for mark in "*?[") else path


def local_items(source: SourceSpec, key: str) -> Iterator[tuple[str, str, str]]:
    """(kind, item, where) for each document or JSON line of a local source, in file order."""
    for path in local_files(source, f"{key}.path", warn=True):
        kind = source.format
        if kind == "auto":
            kind = "jsonl" if path.suffix == ".jsonl" else "text"
        if kind == "text":
            if source.train_on == "assistant":
                raise UsageError(f"{key}: train_on: assistant needs chat records, and {path} is plain text")
            text = path.read_text(encoding="utf-8", errors="replace")
            if source.documents == "file":
                blocks = [text] if text.strip() else []
            else:
                blocks = [block for block in text.replace("\r\n", "\n").split("\n\n") if block.strip()]
            yield from (("text", block, str(path)) for block in blocks)
            continue
        with open(path, encoding="utf-8") as handle:
            yield from (("json", line, f"{path}:{n}") for n, line in enumerate(handle, 1) if line.strip())


def source_chunks(
    source: SourceSpec, key: str, seed: int | None, index: int, hub_state: str | None = None
) -> Iterator[Chunk]:
    """The chunks of one source in order; `seed` shuffles its items; `hub_state` continues a Hub stream."""
    if source.path.startswith(HF_PREFIX):
        yield from hub_chunks(source, key, seed, index, hub_state)
        return
    items = local_items(source, key)
    if seed is not None:
        listed = list(items)  # the source's text in memory: a shuffle needs all of its documents
        items = (listed[i] for i in np.random.default_rng([seed, index]).permutation(len(listed)))
    yield from chunked(items, source, key)


def chunked(items: Iterator[tuple[str, str, str]], source: SourceSpec, key: str) -> Iterator[Chunk]:
    """Consecutive items of one kind, CHUNK_CHARS of text or CHUNK_ITEMS items at most per chunk."""
    chunk, size = None, 0
    for kind, item, where in items:
        if chunk is not None and (kind != chunk.kind or size >= CHUNK_CHARS or len(chunk.items) >= CHUNK_ITEMS):
            yield chunk
            chunk = None
        if chunk is None:
            chunk, size = Chunk(source, key, kind, [], []), 0
        chunk.items.append(item)
        chunk.where.append(where)
        size += len(item)
    if chunk is not None:
        yield chunk


def hub_chunks(source: SourceSpec, key: str, seed: int | None, index: int, state: str | None) -> Iterator[Chunk]:
    """A Hugging Face dataset, streamed in chunks of records (`max_tokens` bounds how much is read)."""
    name = source.path[len(HF_PREFIX) :]

    def open_stream():
        import datasets

        stream = datasets.load_dataset(name, source.hf_subset, split=source.hf_split, streaming=True)
        if seed is None:
            return stream
        # A record from each file in turn, the files in a seeded order: a sample whose position a shard can
        # keep (a shuffle buffer's content would be lost on resuming).
        files = stream.num_shards
        order = np.random.default_rng([seed, index]).permutation(files)
        return datasets.interleave_datasets(
            [stream.shard(files, int(i)) for i in order], stopping_strategy="all_exhausted_without_replacement"
        )

    offline = os.environ.get("HF_HUB_OFFLINE") not in (None, "", "0")  # then no retry can help
    what = f"the dataset {name}" + (" (this machine is offline: HF_HUB_OFFLINE is set)" if offline else "")
    size = max(1, CHUNK_CHARS // RECORD_CHARS)
    batches = resumable_batches(open_stream, state, what, size, retries=0 if offline else HUB_RETRIES)
    for number, (records, position) in enumerate(batches):
        where = [f"record {number * size + n}" for n in range(len(records))]  # counted from the resumed position
        yield Chunk(source, key, "record", records, where, state=json.dumps(position))


def resumable_batches(
    open_stream: Callable[[], object],
    state: str | None,
    what: str,
    size: int,
    retries: int = HUB_RETRIES,
    wait: float = 1.0,
) -> Iterator[tuple[list[dict], dict]]:
    """Batches of `size` records of the stream `open_stream` opens, from the position `state` on, each with
    the position after it. A network error reopens the stream after the last whole batch, waiting `wait`
    seconds, doubling up to 60; `retries` failures in a row end it with one line."""
    position = json.loads(state) if state else None
    failures = 0
    while True:
        try:
            stream = open_stream()
            if position is not None:
                stream.load_state_dict(position)
            records_left = iter(stream)
            while records := list(itertools.islice(records_left, size)):
                position = stream.state_dict()
                failures = 0
                yield records, position
            return
        except UsageError:
            raise
        except Exception as error:
            if not isinstance(error, (OSError, ValueError)) and not transient(error):
                raise  # not the stream's: a bug
            failures += 1
            if not transient(error) or failures > retries:
                raise UsageError(f"cannot read {what}: {first_line(error)}") from None
            pause = min(wait * 2 ** (failures - 1), 60)
            log.warning(f"reading {what} failed ({first_line(error)}); retrying in {pause:g} s")
            time.sleep(pause)


def transient(error: Exception) -> bool:
    """Whether an error reading a stream may pass on a retry: the network's, not a missing dataset's."""
    if isinstance(error, (FileNotFoundError, PermissionError, IsADirectoryError)):
        return False
    network = [OSError, TimeoutError]
    # huggingface_hub's HTTP client (httpx before 2.x, httpx2 since): its connection errors are not OSErrors.
    for client in ("httpx", "httpx2"):
        with contextlib.suppress(ImportError):
            network.append(importlib.import_module(client).TransportError)
    return isinstance(error, tuple(network))
