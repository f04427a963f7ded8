"""Training data: sources -> documents -> tokens -> packed `seq_len` blocks, cached on disk.

Every source yields documents (plain text files, blank-line blocks, JSONL text records, JSONL
chat records rendered with the tokenizer's chat template, or Hugging Face datasets streamed from
the Hub). Documents are tokenized without special tokens, joined with EOS after each one, and cut
into blocks of exactly `seq_len` tokens (the incomplete tail is dropped). Beside each token two
flags are kept: whether it is a training target (chat records trained on the assistant turns only
have their system and user turns masked) and whether it starts a document (for attention that
stays inside each document: position ids restart there). The blocks of a group of sources are
written once to `cache_dir/<group>-<key>/` (blocks.bin: uint32 token ids, targets.bin and
starts.bin: uint8 flags, row-major) with a `meta.json`; the key hashes the source settings, the
bytes of every local file, the tokenizer and `seq_len`, so a rerun with the same inputs maps the
files instead of tokenizing again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import hashlib
import itertools
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from transformers import PreTrainedTokenizerBase

from ladder.errors import UsageError, first_line
from ladder.io.files import atomic_directory, sha256_file

from .recipe import DataSpec, SourceSpec, expand_path

HF_PREFIX = "hf:"
CACHE_FORMAT = 2  # bump when the files' layout changes (2: targets.bin and starts.bin beside blocks.bin)
TOKENIZE_BATCH = 256  # documents per tokenizer call (the Rust tokenizer runs a batch in parallel)
# ShareGPT-style chat records ({"from": "human", "value": ...}, as in BAAI/Infinity-Instruct).
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


@dataclass
class Blocks:
    """Packed blocks, each row one example of `seq_len` tokens: the token ids, whether each token is a
    training target (its prediction is trained on), and whether it starts a document. Indexing takes
    rows of all three."""

    ids: np.ndarray
    targets: np.ndarray
    starts: np.ndarray

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, rows) -> Blocks:
        return Blocks(self.ids[rows], self.targets[rows], self.starts[rows])

    def masked_share(self) -> float:
        """The share of tokens that are not training targets."""
        return 1.0 - np.count_nonzero(self.targets) / self.targets.size if len(self) else 0.0


@dataclass
class Splits:
    """Training and held-out blocks."""

    train: Blocks
    eval: Blocks


@dataclass
class Document:
    """One document's text; `targets` are the character spans trained on (None: all of it)."""

    text: str
    targets: list[tuple[int, int]] | None = None


def document_positions(starts: np.ndarray) -> np.ndarray:
    """Position ids that restart at 0 at every document start (and at each block's first token,
    where a document cut by the packing continues)."""
    starts = np.array(starts, dtype=bool)
    starts[:, 0] = True
    columns = np.arange(starts.shape[1])
    last_start = np.maximum.accumulate(np.where(starts, columns, 0), axis=1)
    return columns - last_start


def prepare_data(data: DataSpec, tokenizer: PreTrainedTokenizerBase) -> Splits:
    """Build (or reuse from the cache) the training and evaluation blocks of a recipe.

    With no `data.eval` sources, the last `heldout_fraction` of the training blocks is held out
    (and never trained on); evaluation uses at most `eval_blocks` blocks, spread evenly.
    """
    train = load_blocks(data.train, tokenizer, data.seq_len, Path(data.cache_dir), "train")
    if data.eval:
        heldout = load_blocks(data.eval, tokenizer, data.seq_len, Path(data.cache_dir), "eval")
    else:
        count = int(np.ceil(len(train) * data.heldout_fraction)) if data.heldout_fraction > 0 else 0
        train, heldout = train[: len(train) - count], train[len(train) - count :]
    if len(heldout) > data.eval_blocks:
        heldout = heldout[np.unique(np.linspace(0, len(heldout) - 1, data.eval_blocks).round().astype(int))]
    return Splits(train=train, eval=heldout)


BLOCK_FILES = {
    "ids": ("blocks.bin", np.uint32),
    "targets": ("targets.bin", np.uint8),
    "starts": ("starts.bin", np.uint8),
}


def load_blocks(
    sources: list[SourceSpec], tokenizer: PreTrainedTokenizerBase, seq_len: int, cache_dir: Path, group: str
) -> Blocks:
    """The packed blocks of `sources`, as read-only memory maps of shape (blocks, seq_len)."""
    key = cache_key(sources, tokenizer, seq_len, group)
    directory = cache_dir / f"{group}-{key[:16]}"
    if not (directory / "meta.json").is_file():
        with atomic_directory(directory, force=True) as temporary:
            meta = write_blocks(sources, tokenizer, seq_len, temporary, group)
            (temporary / "meta.json").write_text(json.dumps({**meta, "key": key}, indent=1))
    meta = json.loads((directory / "meta.json").read_text())
    return Blocks(
        **{
            field: np.memmap(directory / name, dtype=dtype, mode="r", shape=(meta["blocks"], seq_len))
            for field, (name, dtype) in BLOCK_FILES.items()
        }
    )


def write_blocks(
    sources: list[SourceSpec], tokenizer: PreTrainedTokenizerBase, seq_len: int, directory: Path, group: str
) -> dict:
    """Tokenize and pack every source into the block files in `directory`; returns the counts for meta.json."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise UsageError("the tokenizer has no EOS token, which separates documents in packed blocks")
    pending = {field: [] for field in BLOCK_FILES}
    blocks = documents = target_tokens = 0
    with contextlib.ExitStack() as stack:
        handles = {field: stack.enter_context(open(directory / name, "wb")) for field, (name, _) in BLOCK_FILES.items()}
        for i, source in enumerate(sources):
            produced = 0
            for batch in batched(read_documents(source, tokenizer, f"data.{group}[{i}]"), TOKENIZE_BATCH):
                for ids, targets in tokenize_documents(batch, tokenizer, f"data.{group}[{i}]"):
                    # The EOS that ends a document is a target where the document's last token is.
                    ids, targets = ids + [eos], targets + [targets[-1] if targets else 1]
                    if source.max_tokens:
                        ids, targets = ids[: source.max_tokens - produced], targets[: source.max_tokens - produced]
                    pending["ids"].extend(ids)
                    pending["targets"].extend(targets)
                    pending["starts"].extend([1] + [0] * (len(ids) - 1))
                    produced += len(ids)
                    target_tokens += sum(targets)
                    documents += 1
                    if source.max_tokens and produced >= source.max_tokens:
                        break
                whole = len(pending["ids"]) // seq_len * seq_len
                for field, (_, dtype) in BLOCK_FILES.items():
                    np.asarray(pending[field][:whole], dtype=dtype).tofile(handles[field])
                    del pending[field][:whole]
                blocks += whole // seq_len
                if source.max_tokens and produced >= source.max_tokens:
                    break
            if produced == 0:
                raise UsageError(f"data.{group}[{i}] ({source.path}) holds no text")
    if blocks == 0:
        raise UsageError(f"data.{group} gives fewer than seq_len={seq_len} tokens: no block can be made")
    total = blocks * seq_len + len(pending["ids"])
    return {
        "blocks": blocks,
        "seq_len": seq_len,
        "documents": documents,
        "dropped_tail_tokens": len(pending["ids"]),
        "masked_share": round(1 - target_tokens / total, 6),
    }


def tokenize_documents(
    documents: list[Document], tokenizer: PreTrainedTokenizerBase, key: str
) -> Iterator[tuple[list[int], list[int]]]:
    """Token ids of each document, and per token 1 where it is a target: a token is one when its
    characters lie inside a target span (every token of a document without spans)."""
    spans_wanted = any(d.targets is not None for d in documents)
    if spans_wanted and not tokenizer.is_fast:
        raise UsageError(
            f"{key}: training on assistant turns only needs a fast tokenizer (character offsets); set train_on: all"
        )
    encoded = tokenizer([d.text for d in documents], add_special_tokens=False, return_offsets_mapping=spans_wanted)
    for n, (document, ids) in enumerate(zip(documents, encoded["input_ids"])):
        if document.targets is None:
            yield ids, [1] * len(ids)
            continue
        yield (
            ids,
            [
                int(any(begin <= start and end <= finish for begin, finish in document.targets))
                for start, end in encoded["offset_mapping"][n]
            ],
        )


def cache_key(sources: list[SourceSpec], tokenizer: PreTrainedTokenizerBase, seq_len: int, group: str) -> str:
    """A hash of everything the blocks depend on: source settings and bytes, tokenizer, seq_len."""
    digest = hashlib.sha256()
    described = {
        "format": CACHE_FORMAT,
        "seq_len": seq_len,
        "eos": tokenizer.eos_token_id,
        "chat_template": tokenizer.chat_template,
        "sources": [],
    }
    for i, source in enumerate(sources):
        entry = dataclasses.asdict(source)
        if not source.path.startswith(HF_PREFIX):
            entry["files"] = [(str(f), sha256_file(f)) for f in local_files(source, f"data.{group}[{i}].path")]
        described["sources"].append(entry)
    digest.update(json.dumps(described, sort_keys=True).encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocabulary = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    digest.update(vocabulary.encode())
    return digest.hexdigest()


def local_files(source: SourceSpec, key: str) -> list[Path]:
    """The files a local source names: a file, a folder (its files, recursively) or a glob."""
    text = expand_path(source.path, key)
    if any(mark in text for mark in "*?["):
        files = sorted(Path(p) for p in glob.glob(text, recursive=True) if Path(p).is_file())
        if not files:
            raise UsageError(f"{key}: the pattern {text} matches no file")
        return files
    path = Path(text)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
        if not files:
            raise UsageError(f"{key}: the folder {path} holds no file")
        return files
    raise UsageError(f"{key}: {path} does not exist")


def read_documents(source: SourceSpec, tokenizer: PreTrainedTokenizerBase, key: str) -> Iterator[Document]:
    """The documents of one source (chat records rendered with the chat template, their assistant
    turns as the targets when the source trains on those only)."""
    if source.path.startswith(HF_PREFIX):
        yield from (record_text(r, source, tokenizer, f"{key} record {n}") for n, r in enumerate(hub_records(source)))
        return
    for path in local_files(source, f"{key}.path"):
        kind = source.format
        if kind == "auto":
            kind = "jsonl" if path.suffix == ".jsonl" else "text"
        if kind == "text":
            text = path.read_text(encoding="utf-8", errors="replace")
            if source.train_on == "assistant":
                raise UsageError(f"{key}: train_on: assistant needs chat records, and {path} is plain text")
            if source.documents == "file":
                if text.strip():
                    yield Document(text)
            else:
                yield from (Document(block) for block in text.replace("\r\n", "\n").split("\n\n") if block.strip())
            continue
        with open(path, encoding="utf-8") as handle:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise UsageError(f"{key}: {path}:{number} is not JSON ({error.msg})") from None
                yield record_text(record, source, tokenizer, f"{key}: {path}:{number}")


def record_text(record: object, source: SourceSpec, tokenizer: PreTrainedTokenizerBase, where: str) -> Document:
    """One JSON record as a document: its `text_field`, or its `chat_field` rendered as a chat
    (with the assistant turns as targets unless `train_on: all`)."""
    if not isinstance(record, dict):
        raise UsageError(f"{where}: expected a JSON object, got {type(record).__name__}")
    chat = source.format == "chat" or (source.format == "auto" and source.chat_field in record)
    if not chat:
        if source.train_on == "assistant":
            raise UsageError(
                f"{where}: train_on: assistant needs chat records, and this record has no "
                f"chat field {source.chat_field!r}"
            )
        if not isinstance(record.get(source.text_field), str):
            raise UsageError(f"{where}: no text field {source.text_field!r} (set text_field or chat_field)")
        return Document(record[source.text_field])
    messages = record.get(source.chat_field)
    if not isinstance(messages, list) or not messages:
        raise UsageError(f"{where}: no chat field {source.chat_field!r} holding a list of messages")
    if tokenizer.chat_template is None:
        raise UsageError(f"{where}: chat records need a tokenizer with a chat template, and this one has none")
    messages = [chat_message(m, where) for m in messages]
    text = render_chat(tokenizer, messages, where)
    if source.train_on == "all":
        return Document(text)
    return Document(text, assistant_spans(messages, text, tokenizer, where))


def render_chat(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], where: str, add_generation_prompt: bool = False
) -> str:
    """A chat as the tokenizer's chat template renders it. The template comes with the model, and
    may raise (`raise_exception`, an undefined name, a type error): one line naming it and the record."""
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except (TemplateError, TypeError, ValueError) as error:
        raise UsageError(
            f"{where}: the chat template of {tokenizer.name_or_path} failed on this chat: {first_line(error)}"
        ) from None


def assistant_spans(
    messages: list[dict], text: str, tokenizer: PreTrainedTokenizerBase, where: str
) -> list[tuple[int, int]]:
    """Character spans of the assistant turns in `text` (the whole chat rendered), each from the end
    of its role header to the end of the turn (its end-of-turn marker included): the text the model
    generates. Found by rendering each prefix of the chat, with the generation prompt for the
    header, which needs a template whose renderings of a chat's prefixes are prefixes of it."""
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        header = render_chat(tokenizer, messages[:k], where, add_generation_prompt=True) if k else ""
        turn = render_chat(tokenizer, messages[: k + 1], where)
        if not (text.startswith(turn) and turn.startswith(header)):
            raise UsageError(
                f"{where}: the chat template renders this chat's turns differently from the whole chat, "
                "so its assistant turns cannot be located; set train_on: all for this source"
            )
        spans.append((len(header), len(turn)))
    return spans


def chat_message(message: object, where: str) -> dict:
    """One message as {"role", "content"}; ShareGPT's {"from", "value"} is mapped."""
    if isinstance(message, dict) and "role" in message and "content" in message:
        return {"role": message["role"], "content": message["content"]}
    if isinstance(message, dict) and message.get("from") in SHAREGPT_ROLES and "value" in message:
        return {"role": SHAREGPT_ROLES[message["from"]], "content": message["value"]}
    raise UsageError(f"{where}: a message must be {{role, content}} or {{from, value}}, got {message!r:.80}")


def hub_records(source: SourceSpec) -> Iterator[dict]:
    """Records of a Hugging Face dataset, streamed (`max_tokens` bounds how much is read)."""
    import datasets

    name = source.path[len(HF_PREFIX) :]
    try:
        stream = datasets.load_dataset(name, source.hf_subset, split=source.hf_split, streaming=True)
        yield from stream
    except (FileNotFoundError, ConnectionError, ValueError) as error:
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        offline = " (this machine is offline: HF_HUB_OFFLINE is set)" if os.environ.get("HF_HUB_OFFLINE") else ""
        raise UsageError(f"cannot read the dataset {name}{offline}: {first_line}") from None


def batched(items: Iterator[str], size: int) -> Iterator[list[str]]:
    iterator = iter(items)
    while batch := list(itertools.islice(iterator, size)):
        yield batch


class BlockOrder:
    """Which blocks each optimizer step reads: a pure function of (seed, step), so a resumed run
    reads exactly what an uninterrupted one would, whatever the number of processes.

    The training blocks are read in a fresh seeded permutation per epoch; step `s` takes positions
    `[s * G, (s + 1) * G)` of that endless stream, G = micro_batch * grad_accum * processes. Within a
    step, micro-step `a` of process `p` takes the slice `(a * processes + p) * micro_batch`.
    """

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


__all__ = [
    "BlockOrder",
    "Blocks",
    "Document",
    "Splits",
    "document_positions",
    "load_blocks",
    "prepare_data",
    "read_documents",
]
