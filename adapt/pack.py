"""Tokenize a group of sources on every core, keep each chunk's tokens as a shard, pack the blocks.

Chunks (adapt/sources.py) go to a pool of worker processes, one per core (adapt/tokenize.py); their
results come back in chunk order and are written as shards beside the cache entry, so that a prepare
killed at any point tokenizes only the rest and packs the same blocks. Packing reads the shards in
order, cuts each source at its quota and interleaves mixed sources document by document.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import itertools
import math
import multiprocessing
import os
import signal
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from transformers import PreTrainedTokenizerBase

from ladder.errors import UsageError
from ladder.io.files import atomic_write
from ladder.log import log

from .recipe import SourceSpec
from .sources import HF_PREFIX, local_files, source_chunks
from .tokenize import Chunk, Tokenized, Worker, start_worker, tokenize_in_worker

# 3: ids in uint16 where the vocabulary fits, flags as bits (targets.bits, starts.bits), sampling in the key.
CACHE_FORMAT = 3
ROWS_PER_WRITE = 256


@dataclass(frozen=True)
class Sampling:
    seed: int | None = None  # shuffles each source's documents (None: file order)
    mix_tokens: int = 0  # the tokens of a mixture of weighted sources (0: no mixture)


def id_dtype(tokenizer: PreTrainedTokenizerBase) -> type:
    return np.uint16 if max(tokenizer.get_vocab().values()) < 1 << 16 else np.uint32


def worker_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def write_blocks(
    sources: list[SourceSpec],
    tokenizer: PreTrainedTokenizerBase,
    seq_len: int,
    directory: Path,
    shards: Path,
    group: str,
    sampled: Sampling,
) -> dict:
    """Tokenize and pack every source into the block files in `directory`; returns the counts for meta.json."""
    if tokenizer.eos_token_id is None:
        raise UsageError("the tokenizer has no EOS token, which separates documents in packed blocks")
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        raise UsageError(f"data.{group}: preparing data needs a fast (Rust) tokenizer, and this one is not")
    dtype = id_dtype(tokenizer)
    quotas = source_quotas(sources, sampled)
    workers = worker_count()
    log.info(estimate(sources, quotas, group, dtype, workers))
    started = time.perf_counter()
    shards.mkdir(parents=True, exist_ok=True)
    worker = Worker(
        tokenizer.backend_tokenizer.to_str(),
        tokenizer.chat_template,
        tokenizer.special_tokens_map,
        tokenizer.eos_token_id,
        tokenizer.name_or_path,
    )
    with ChunkRunner(worker, workers) as runner:
        tokenized = [
            tokenize_source(runner, source, f"data.{group}[{i}]", i, sampled.seed, quota, shards, dtype)
            for i, (source, quota) in enumerate(zip(sources, quotas))
        ]
    tokenizing = time.perf_counter() - started
    # The sources one after the other, or interleaved document by document when mixed.
    writer, quotas = BlockWriter(directory, seq_len, dtype), mixture_quotas(tokenized, quotas, sources, sampled, group)
    streams = [source_documents(t.shards, quota) for t, quota in zip(tokenized, quotas)]
    for ids, targets, lengths in interleaved(streams, quotas) if sampled.mix_tokens else itertools.chain(*streams):
        writer.add(ids, targets, lengths)
    meta = writer.finish(group)
    packing = time.perf_counter() - started - tokenizing
    tokens = sum(t.tokens for t in tokenized)
    log.info(
        f"data.{group}: {meta['blocks']:,} blocks of {seq_len} tokens ({meta['blocks'] * seq_len:,} tokens, "
        f"{meta['documents']:,} documents), {meta['bytes'] / 1e6:,.1f} MB; {tokens:,} tokens tokenized in "
        f"{tokenizing:.1f} s ({tokens / tokenizing:,.0f} tokens/s, {workers} worker(s)), packed in {packing:.1f} s"
    )
    return meta


def source_quotas(sources: list[SourceSpec], sampled: Sampling) -> list[int]:
    """Tokens each source may give (0: all of it): its max_tokens, or its weight's share of the mixture."""
    if not sampled.mix_tokens:
        return [int(s.max_tokens) for s in sources]
    total = sum(s.weight for s in sources)
    return [max(1, round(sampled.mix_tokens * s.weight / total)) for s in sources]


def mixture_quotas(
    tokenized: list[SourceTokens], quotas: list[int], sources: list[SourceSpec], sampled: Sampling, group: str
) -> list[int]:
    """The quotas, shrunk in proportion when a mixed source holds fewer tokens than its share."""
    for i, (t, source) in enumerate(zip(tokenized, sources)):
        if t.tokens == 0:
            raise UsageError(f"data.{group}[{i}] ({source.path}) holds no text")
    if not sampled.mix_tokens:
        return quotas
    scale = min(1.0, *(t.tokens / quota for t, quota in zip(tokenized, quotas)))
    if scale < 1.0:
        short = min(range(len(quotas)), key=lambda i: tokenized[i].tokens / quotas[i])
        log.info(
            f"data.{group}[{short}] holds {tokenized[short].tokens:,} tokens, less than its share "
            f"{quotas[short]:,}: the mixture keeps its weights with {math.floor(sampled.mix_tokens * scale):,} tokens"
        )
    return [max(1, math.floor(quota * scale)) for quota in quotas]


def estimate(sources: list[SourceSpec], quotas: list[int], group: str, dtype: type, workers: int) -> str:
    """A line before the work: the tokens expected (local files at about 4 bytes per token) and the cache's size."""
    tokens, unknown = 0, False
    for i, (source, quota) in enumerate(zip(sources, quotas)):
        if source.path.startswith(HF_PREFIX):
            tokens += quota
            unknown |= quota == 0
            continue
        size = sum(f.stat().st_size for f in local_files(source, f"data.{group}[{i}].path")) // 4
        tokens += min(size, quota) if quota else size
    per_token = np.dtype(dtype).itemsize + 2 / 8
    size = "an unknown number of tokens (a whole Hub dataset)" if unknown else f"about {tokens:,} tokens"
    return (
        f"data.{group}: tokenizing {size} with {workers} worker(s); the cache takes "
        f"{per_token} bytes per token ({np.dtype(dtype).name} ids, 2 bits of flags)"
        + ("" if unknown else f", about {tokens * per_token / 1e6:,.1f} MB")
    )


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def start_pool_worker(worker: Worker) -> None:
    """A forked worker's start: the default signal actions back first (adapt's handlers, inherited,
    would keep a SIGTERM from ending a worker)."""
    for number in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(number, signal.SIG_DFL)
    # A worker ends with its parent (Linux's PR_SET_PDEATHSIG): a killed prepare leaves none behind.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    start_worker(worker)


class ChunkRunner:
    """Tokenizes chunks in worker processes (in this one when there is one core), results in order.
    concurrent.futures rather than multiprocessing.Pool: a worker that dies breaks the executor, and
    the run ends in one line; a Pool would wait forever for the chunk the dead worker held."""

    def __init__(self, worker: Worker, workers: int):
        self.worker, self.workers, self.pool = worker, workers, None
        self.parallelism: str | None = None

    def __enter__(self) -> ChunkRunner:
        if self.workers == 1:
            start_worker(self.worker)
            return self
        # Each worker tokenizes on one thread; set while they fork, so that no worker warns about it.
        self.parallelism = os.environ.get("TOKENIZERS_PARALLELISM")
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        self.pool = ProcessPoolExecutor(
            self.workers, multiprocessing.get_context("fork"), start_pool_worker, (self.worker,)
        )
        # A fork executor starts every worker at its first task: now, from this thread (PR_SET_PDEATHSIG
        # ties a worker to the thread that forked it).
        self.pool.submit(int).result()
        return self

    def __exit__(self, *exc) -> None:
        if self.pool is None:
            return
        # On an error the queued chunks are dropped and the ones in flight finish (a few seconds).
        self.pool.shutdown(wait=True, cancel_futures=exc[0] is not None)
        if self.parallelism is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = self.parallelism

    def run(self, jobs: Iterator[tuple[object, Chunk | None]]) -> Iterator[tuple[object, Tokenized | None]]:
        """(tag, result) for each (tag, chunk) in order; a None chunk passes through as a None result.
        At most two chunks per worker are in flight, so a stream is not read ahead without bound."""
        if self.pool is None:
            yield from ((tag, tokenize_in_worker(chunk) if chunk is not None else None) for tag, chunk in jobs)
            return
        # A dead worker breaks the pool: the next `result()` raises, and so does the next `submit()`.
        try:
            pending = deque()
            for tag, chunk in jobs:
                pending.append((tag, self.pool.submit(tokenize_in_worker, chunk) if chunk is not None else None))
                while len(pending) > 2 * self.workers or (pending and (pending[0][1] is None or pending[0][1].done())):
                    tag_done, future = pending.popleft()
                    yield tag_done, future.result() if future is not None else None
            for tag, future in pending:
                yield tag, future.result() if future is not None else None
        except BrokenProcessPool:
            raise UsageError(
                "a tokenizer worker process ended abruptly (killed, or out of memory: see `dmesg`); the shards "
                "written so far are kept, and the same command continues from them"
            ) from None


@dataclass
class SourceTokens:
    shards: list[Path]
    tokens: int


def tokenize_source(
    runner: ChunkRunner,
    source: SourceSpec,
    key: str,
    index: int,
    seed: int | None,
    quota: int,
    shards: Path,
    dtype: type,
) -> SourceTokens:
    """The shards of one source, in order, until they hold `quota` tokens (0: all); shards already
    written are kept, and a Hub stream reopens after the last of them."""
    done, tokens, first, state = [], 0, 0, None
    if source.path.startswith(HF_PREFIX):
        while (shards / shard_name(index, first)).is_file():  # the stream's position is in the last shard
            done.append(shards / shard_name(index, first))
            tokens += int(shard_field(done[-1], "lengths").sum())
            first += 1
        if done:
            state = str(shard_field(done[-1], "state"))
            if quota and tokens >= quota:
                return SourceTokens(done, tokens)
    chunks = enumerate(source_chunks(source, key, seed, index, state), start=first)
    jobs = ((n, None if (shards / shard_name(index, n)).is_file() else chunk) for n, chunk in chunks)
    for n, result in runner.run(jobs):
        path = shards / shard_name(index, n)
        if result is not None:
            write_shard(path, result, dtype)
        done.append(path)
        tokens += int(shard_field(path, "lengths").sum()) if result is None else int(result.lengths.sum())
        if quota and tokens >= quota:
            break
    return SourceTokens(done, tokens)


def shard_name(source: int, chunk: int) -> str:
    return f"{source:03d}-{chunk:07d}.npz"


def write_shard(path: Path, result: Tokenized, dtype: type) -> None:
    buffer = io.BytesIO()
    np.savez(
        buffer,
        ids=result.ids.astype(dtype),
        targets=np.packbits(result.targets),
        count=np.int64(len(result.ids)),
        lengths=result.lengths,
        state=np.str_(result.state or ""),
    )
    atomic_write(path, buffer.getvalue())


def read_shard(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, targets, document lengths) of a shard."""
    with np.load(path) as shard:
        return shard["ids"], np.unpackbits(shard["targets"], count=int(shard["count"])), shard["lengths"]


def shard_field(path: Path, field: str) -> np.ndarray:
    """One field of a shard (reads only that one)."""
    with np.load(path) as shard:
        return shard[field]


def source_documents(shards: list[Path], quota: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(ids, targets, document lengths) shard by shard, cut at `quota` tokens (0: all)."""
    given = 0
    for path in shards:
        ids, targets, lengths = read_shard(path)
        if quota and given + len(ids) >= quota:
            keep = quota - given
            ends = np.cumsum(lengths)
            whole = int(np.searchsorted(ends, keep, side="right"))  # documents that end before the cut
            rest = keep - (int(ends[whole - 1]) if whole else 0)
            lengths = np.append(lengths[:whole], [rest] if rest else [])
            yield ids[:keep], targets[:keep], lengths
            return
        given += len(ids)
        yield ids, targets, lengths


def interleaved(streams: list[Iterator], quotas: list[int]) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The documents of several streams merged, each next one from the stream furthest behind its quota
    (ties: the first), so every stretch holds the sources in proportion."""
    documents = [split_documents(stream) for stream in streams]
    heads = {i: head for i, stream in enumerate(documents) if (head := next(stream, None)) is not None}
    given = [0] * len(streams)
    while heads:  # in index order: a stream's entry keeps its place until it ends
        i = min(heads, key=lambda k: given[k] / quotas[k])
        ids, targets = heads[i]
        given[i] += len(ids)
        yield ids, targets, np.array([len(ids)])
        heads[i] = next(documents[i], None)
        if heads[i] is None:
            del heads[i]


def split_documents(stream: Iterator) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(ids, targets) of one document at a time from a stream of (ids, targets, lengths) pieces."""
    for ids, targets, lengths in stream:
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        for begin, end in itertools.pairwise(offsets):
            yield ids[begin:end], targets[begin:end]


class BlockWriter:
    """Appends documents to the block files, whole rows at a time; the tail short of a row is dropped."""

    def __init__(self, directory: Path, seq_len: int, dtype: type):
        self.seq_len, self.dtype = seq_len, dtype
        self.files = {name: open(directory / name, "wb") for name in ("blocks.bin", "targets.bits", "starts.bits")}
        self.pending: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.pending_tokens = self.blocks = self.documents = self.target_tokens = self.tokens = 0

    def add(self, ids: np.ndarray, targets: np.ndarray, lengths: np.ndarray) -> None:
        starts = np.zeros(len(ids), dtype=np.uint8)
        starts[np.cumsum(lengths)[:-1]] = 1
        starts[:1] = 1
        self.pending.append((ids, targets, starts))
        self.pending_tokens += len(ids)
        self.documents += len(lengths)
        self.target_tokens += int(np.count_nonzero(targets))
        self.tokens += len(ids)
        if self.pending_tokens >= ROWS_PER_WRITE * self.seq_len:
            self.flush()

    def flush(self) -> None:
        ids, targets, starts = (np.concatenate(parts) for parts in zip(*self.pending))
        rows = len(ids) // self.seq_len
        whole = rows * self.seq_len
        self.files["blocks.bin"].write(ids[:whole].astype(self.dtype).tobytes())
        for name, flags in (("targets.bits", targets), ("starts.bits", starts)):
            self.files[name].write(np.packbits(flags[:whole].reshape(rows, self.seq_len), axis=1).tobytes())
        self.pending = [(ids[whole:], targets[whole:], starts[whole:])]
        self.pending_tokens = len(ids) - whole
        self.blocks += rows

    def finish(self, group: str) -> dict:
        if self.pending:
            self.flush()
        for handle in self.files.values():
            handle.close()
        if self.blocks == 0:
            raise UsageError(f"data.{group} gives fewer than seq_len={self.seq_len} tokens: no block can be made")
        return {
            "blocks": self.blocks,
            "seq_len": self.seq_len,
            "ids_dtype": np.dtype(self.dtype).name,
            "documents": self.documents,
            "dropped_tail_tokens": self.pending_tokens,
            "masked_share": round(1 - self.target_tokens / self.tokens, 6),
            "bytes": sum(os.path.getsize(handle.name) for handle in self.files.values()),
        }
