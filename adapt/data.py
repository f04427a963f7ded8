"""Training data: sources -> documents -> tokens -> packed `seq_len` blocks, cached on disk
(docs/data.md).

Documents are tokenized without special tokens, joined with EOS after each one and cut into blocks
of exactly `seq_len` tokens (the incomplete tail dropped); beside each token two flags are kept:
whether it is a training target, and whether it starts a document. The blocks of a group of sources
are written once to `data.cache_folder()/<group>-<key>/` (blocks.bin; targets.bits and starts.bits,
one bit per token, rows padded to whole bytes; meta.json), whose key hashes everything the blocks
depend on, so that a rerun with the same inputs maps the files instead of tokenizing again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from transformers import PreTrainedTokenizerBase

from ladder.io.files import atomic_directory, sha256_file
from ladder.log import log

from . import sources as sources_module
from .pack import CACHE_FORMAT, Sampling, id_dtype, write_blocks
from .recipe import DataSpec, SourceSpec
from .sources import HF_PREFIX, local_files


@dataclass
class Blocks:
    """Packed blocks, a row per `seq_len` tokens: the ids, and per token two flags kept as bits (a
    training target; a document's start). Indexing takes rows of all three."""

    ids: np.ndarray
    target_bits: np.ndarray
    start_bits: np.ndarray

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, rows) -> Blocks:
        return Blocks(self.ids[rows], self.target_bits[rows], self.start_bits[rows])

    @property
    def targets(self) -> np.ndarray:
        return np.unpackbits(self.target_bits, axis=-1, count=self.ids.shape[-1])

    @property
    def starts(self) -> np.ndarray:
        return np.unpackbits(self.start_bits, axis=-1, count=self.ids.shape[-1])

    def masked_share(self) -> float:
        """The share of tokens that are not training targets."""
        if not len(self):
            return 0.0
        rows = range(0, len(self), 1 << 16)  # bounded memory on a memory map of many GB
        targets = sum(int(np.bitwise_count(self.target_bits[r : r + (1 << 16)]).sum()) for r in rows)
        return 1.0 - targets / self.ids.size


@dataclass
class Splits:
    train: Blocks
    eval: Blocks


def document_positions(starts: np.ndarray) -> np.ndarray:
    """Position ids that restart at 0 at every document start (and at each block's first token,
    where a document cut by the packing continues)."""
    starts = np.array(starts, dtype=bool)
    starts[:, 0] = True
    columns = np.arange(starts.shape[1])
    last_start = np.maximum.accumulate(np.where(starts, columns, 0), axis=1)
    return columns - last_start


def prepare_data(data: DataSpec, tokenizer: PreTrainedTokenizerBase) -> Splits:
    """The training and held-out blocks of a recipe, built or read from the cache. With no `data.eval`,
    the last `heldout_fraction` of the training blocks is held out; at most `eval_blocks`, spread evenly."""
    cache = data.cache_folder()
    train = load_blocks(data.train, tokenizer, data.seq_len, cache, "train", sampling(data, "train"))
    if data.eval:
        heldout = load_blocks(data.eval, tokenizer, data.seq_len, cache, "eval", sampling(data, "eval"))
    else:
        count = int(np.ceil(len(train) * data.heldout_fraction)) if data.heldout_fraction > 0 else 0
        train, heldout = train[: len(train) - count], train[len(train) - count :]
    if len(heldout) > data.eval_blocks:
        heldout = heldout[np.unique(np.linspace(0, len(heldout) - 1, data.eval_blocks).round().astype(int))]
    return Splits(train=train, eval=heldout)


def sampling(data: DataSpec, group: str) -> Sampling:
    return Sampling(seed=data.sample_seed, mix_tokens=int(data.mix_tokens) if group == "train" else 0)


def data_prepared(data: DataSpec, tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether every group of the recipe's data is in the cache already (nothing to tokenize)."""
    groups = [("train", data.train)] + ([("eval", data.eval)] if data.eval else [])
    return all(
        cached_meta(
            data.cache_folder(), group, cache_key(sources, tokenizer, data.seq_len, group, sampling(data, group))
        )
        is not None
        for group, sources in groups
    )


BLOCK_FILES = {"ids": "blocks.bin", "target_bits": "targets.bits", "start_bits": "starts.bits"}


def cached_meta(cache_dir: Path, group: str, key: str) -> dict | None:
    """The meta.json of the cache entry of `key`, or None when it is missing or not whole (a file cut
    short or replaced, another key's meta.json): such an entry is built again."""
    directory = cache_dir / f"{group}-{key[:16]}"
    try:
        meta = json.loads((directory / "meta.json").read_text())
        row_bytes = {"ids": meta["seq_len"] * np.dtype(meta["ids_dtype"]).itemsize, "bits": (meta["seq_len"] + 7) // 8}
        sizes = {name: meta["blocks"] * row_bytes["ids" if name == "ids" else "bits"] for name in BLOCK_FILES}
        whole = meta["key"] == key and all(
            (directory / file).stat().st_size == sizes[name] for name, file in BLOCK_FILES.items()
        )
    except (OSError, ValueError, KeyError, TypeError):
        whole = False
    if not whole and (directory / "meta.json").exists():
        log.warning(f"the data cache entry {directory} is not whole (a file cut short or changed): building it again")
    return meta if whole else None


def load_blocks(
    sources: list[SourceSpec],
    tokenizer: PreTrainedTokenizerBase,
    seq_len: int,
    cache_dir: Path,
    group: str,
    sampled: Sampling | None = None,
) -> Blocks:
    """The packed blocks of `sources`, as read-only memory maps."""
    sampled = sampled or Sampling()
    key = cache_key(sources, tokenizer, seq_len, group, sampled)
    directory = cache_dir / f"{group}-{key[:16]}"
    if (meta := cached_meta(cache_dir, group, key)) is None:
        # Shards of the work in progress, kept until the blocks are whole: a killed prepare resumes from them.
        shards = cache_dir / f".{group}-{key[:16]}.shards-{sources_module.CHUNK_CHARS}"  # shards of this chunking
        try:
            with atomic_directory(directory, force=True) as temporary:
                meta = {**write_blocks(sources, tokenizer, seq_len, temporary, shards, group, sampled), "key": key}
                (temporary / "meta.json").write_text(json.dumps(meta, indent=1))
            shutil.rmtree(shards)
        finally:
            with contextlib.suppress(OSError):
                shards.rmdir()  # when nothing was kept
    shapes = {"ids": (meta["ids_dtype"], seq_len), "target_bits": (np.uint8, (seq_len + 7) // 8)}
    shapes["start_bits"] = shapes["target_bits"]
    return Blocks(
        **{
            name: np.memmap(directory / BLOCK_FILES[name], dtype=dtype, mode="r", shape=(meta["blocks"], width))
            for name, (dtype, width) in shapes.items()
        }
    )


def cache_key(
    sources: list[SourceSpec], tokenizer: PreTrainedTokenizerBase, seq_len: int, group: str, sampled: Sampling
) -> str:
    """A hash of everything the blocks depend on."""
    digest = hashlib.sha256()
    described = {
        "format": CACHE_FORMAT,
        "seq_len": seq_len,
        "eos": tokenizer.eos_token_id,
        "ids": np.dtype(id_dtype(tokenizer)).name,
        "chat_template": tokenizer.chat_template,
        "sampling": dataclasses.asdict(sampled),
        "sources": [],
    }
    for i, source in enumerate(sources):
        entry = source.model_dump()
        if not source.path.startswith(HF_PREFIX):
            entry["files"] = [(str(f), sha256_file(f)) for f in local_files(source, f"data.{group}[{i}].path")]
        described["sources"].append(entry)
    digest.update(json.dumps(described, sort_keys=True).encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocabulary = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    digest.update(vocabulary.encode())
    return digest.hexdigest()


class BlockOrder:
    """Which blocks each optimizer step reads: a pure function of (seed, step), so a resumed run reads
    exactly what an uninterrupted one would. The blocks come in a fresh seeded permutation per epoch;
    step `s` takes positions `[s * G, (s + 1) * G)` of that endless stream (G blocks per step), and
    micro-step `a` of process `p` the slice at `(a * processes + p) * micro_batch`."""

    def __init__(self, blocks: int, seed: int, micro_batch: int, grad_accum: int, processes: int):
        self.blocks, self.seed = blocks, seed
        self.micro_batch, self.grad_accum, self.processes = micro_batch, grad_accum, processes
        self.per_step = micro_batch * grad_accum * processes
        self._permutation = functools.lru_cache(maxsize=2)(self._make_permutation)

    def _make_permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.blocks)

    def indices(self, step: int, micro_step: int, process: int) -> np.ndarray:
        start = step * self.per_step + (micro_step * self.processes + process) * self.micro_batch
        positions = np.arange(start, start + self.micro_batch)
        return np.array([self._permutation(p // self.blocks)[p % self.blocks] for p in positions])
