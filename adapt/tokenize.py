"""Documents -> token ids and training-target flags, a chunk at a time, in worker processes.

A worker holds the Rust tokenizer (from its JSON: a process pool needs no transformers object) and
renders chat records itself, once per record: each assistant turn's content is wrapped in two
private-use marker characters, whose positions give the spans trained on. A template that one
rendering cannot serve (it changes content, or renders turns apart from the whole chat) is caught
on a probe chat, and its chats' turns are located by rendering each prefix instead (`prefix_spans`).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ladder.chat_template import TemplateWorker
from ladder.errors import UsageError, first_line

from .recipe import SourceSpec

# ShareGPT-style chat records ({"from": "human", "value": ...}, as in BAAI/Infinity-Instruct).
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
OPEN, CLOSE = "\ue000", "\ue001"  # private-use characters, removed before tokenizing
# A chat whose assistant turns have whitespace around them, to learn how a template renders turns.
PROBE = [
    {"role": "user", "content": "Which bird?"},
    {"role": "assistant", "content": " An owl.\n"},
    {"role": "user", "content": "Another?"},
    {"role": "assistant", "content": "\nA heron. "},
]


@dataclass
class Chunk:
    """Consecutive items of one source: texts, JSON lines or records (`kind`), and where each came from."""

    source: SourceSpec
    key: str
    kind: str
    items: list
    where: list[str]
    state: str | None = None  # a Hub stream's position after the last item (JSON)


@dataclass
class Tokenized:
    """A chunk's documents, each followed by EOS: ids, 1 per training target, each document's length."""

    ids: np.ndarray
    targets: np.ndarray
    lengths: np.ndarray
    state: str | None = None


@dataclass
class Document:
    """One document's text; `targets` are the character spans trained on (None: all of it)."""

    text: str
    targets: list[tuple[int, int]] | None = None


@dataclass
class Worker:
    """What a worker needs: the tokenizer's JSON, its chat template and special tokens, the EOS id, its name."""

    tokenizer_json: str
    chat_template: str | None
    special_tokens: dict
    eos: int
    tokenizer_name: str = "the tokenizer"

    def __post_init__(self):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_str(self.tokenizer_json)
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()

    @functools.cached_property
    def renderer(self) -> ChatRenderer:
        return ChatRenderer(self.chat_template, self.special_tokens, self.tokenizer_name)

    def tokenize(self, chunk: Chunk) -> Tokenized:
        documents = [document_of(item, chunk, where, self) for item, where in zip(chunk.items, chunk.where)]
        return Tokenized(*self.encode(documents), state=chunk.state)

    def encode(self, documents: list[Document]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, targets, lengths) of documents joined with EOS after each one; the EOS is a target where
        the document's last token is (or the document is empty)."""
        texts = [d.text for d in documents]
        spans_wanted = any(d.targets is not None for d in documents)
        encodings = (self.tokenizer.encode_batch if spans_wanted else self.tokenizer.encode_batch_fast)(
            texts, add_special_tokens=False
        )
        token_lists = [e.ids for e in encodings]
        counts = np.fromiter(map(len, token_lists), dtype=np.int64, count=len(token_lists))
        tokens = np.fromiter(itertools.chain.from_iterable(token_lists), dtype=np.int64, count=int(counts.sum()))
        flags = span_flags(documents, encodings, counts) if spans_wanted else np.ones(len(tokens), dtype=np.uint8)
        lengths = counts + 1
        ends = np.cumsum(lengths) - 1  # where each EOS goes
        ids = np.full(int(lengths.sum()), self.eos, dtype=np.int64)
        targets = np.ones(len(ids), dtype=np.uint8)
        body = np.ones(len(ids), dtype=bool)
        body[ends] = False
        ids[body], targets[body] = tokens, flags
        nonempty = counts > 0
        targets[ends[nonempty]] = targets[ends[nonempty] - 1]
        return ids, targets, lengths


def span_flags(documents: list[Document], encodings: list, counts: np.ndarray) -> np.ndarray:
    """1 for each token whose characters lie inside one of its document's spans (every token of a document
    without spans), found by bisection over the token offsets."""
    flags = np.zeros(int(counts.sum()), dtype=np.uint8)
    for document, encoding, offset, count in zip(documents, encodings, np.cumsum(counts) - counts, counts):
        if document.targets is None:
            flags[offset : offset + count] = 1
            continue
        tokens, start, end = range(count), token_edge(encoding, 0), token_edge(encoding, 1)
        for begin, finish in document.targets:
            first, stop = bisect.bisect_left(tokens, begin, key=start), bisect.bisect_right(tokens, finish, key=end)
            flags[offset + first : offset + stop] = 1
    return flags


def token_edge(encoding, side: int) -> Callable[[int], int]:
    """A token's start (side 0) or end (side 1) character in an encoding."""
    return lambda token: encoding.token_to_chars(token)[side]


def document_of(record: object, chunk: Chunk, where: str, worker: Worker) -> Document:
    """One item as a document: a text as it is; a JSON record's `text_field`, or its `chat_field` rendered as a chat."""
    if chunk.kind == "text":
        return Document(record)
    source, where = chunk.source, f"{chunk.key}: {where}"
    if chunk.kind == "json":
        try:
            record = json.loads(record)
        except json.JSONDecodeError as error:
            raise UsageError(f"{where} is not JSON ({error.msg})") from None
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
    if worker.chat_template is None:
        raise UsageError(f"{where}: chat records need a tokenizer with a chat template, and this one has none")
    messages = [chat_message(m, where) for m in messages]
    renderer = worker.renderer
    if source.train_on == "all":
        return Document(renderer.render(messages))
    return Document(*renderer.text_and_spans(messages, where))


def chat_message(message: object, where: str) -> dict:
    """One message as {"role", "content"}; ShareGPT's {"from", "value"} is mapped."""
    if isinstance(message, dict) and "role" in message and "content" in message:
        return {"role": message["role"], "content": message["content"]}
    if isinstance(message, dict) and message.get("from") in SHAREGPT_ROLES and "value" in message:
        return {"role": SHAREGPT_ROLES[message["from"]], "content": message["value"]}
    raise UsageError(f"{where}: a message must be {{role, content}} or {{from, value}}, got {message!r:.80}")


class ChatRenderer:
    """A chat template rendered as `apply_chat_template(messages, tokenize=False)` renders it, and the
    assistant turns' spans: from the end of the role header to the end of the turn (its end marker included)."""

    def __init__(self, template: str, special_tokens: dict, owner: str = "the tokenizer"):
        self.template, self.special_tokens, self.owner = template, special_tokens, owner
        # Rendered in a process the operating system bounds (`ladder.chat_template`): the template is the model's code.
        self.worker = TemplateWorker(owner)
        # a template that fails on every chat says so here, not inside learn()
        self.keeps_whitespace, self.footer = self.learn(self.render(PROBE))

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The chat as the template renders it; a template that raises is one line naming it."""
        from jinja2 import TemplateError

        try:
            return self.worker.render(
                self.template, messages, add_generation_prompt=add_generation_prompt, **self.special_tokens
            )
        except (TemplateError, TypeError, ValueError, RecursionError, OverflowError) as error:
            raise UsageError(f"the chat template of {self.owner} failed on this chat: {first_line(error)}") from None

    def learn(self, text: str) -> tuple[bool | None, str | None]:
        """Whether the template keeps the whitespace around a turn's content, and what it puts after an
        assistant turn; (None, None) when one rendering cannot locate turns (checked on the probe chat,
        rendered as `text`)."""
        try:
            reference = prefix_spans(self, PROBE, text, "the chat template")
        except UsageError:
            return None, None
        marked = self.render(marked_messages(PROBE))
        positions = marker_positions(marked)
        if positions is None or len(positions) != 2 or marked.replace(OPEN, "").replace(CLOSE, "") != text:
            return None, None
        trail = len(PROBE[1]["content"]) - len(PROBE[1]["content"].rstrip())
        for keeps in (True, False):
            self.keeps_whitespace = keeps
            self.footer = text[positions[0][1] + (trail if keeps else 0) : reference[0][1]]
            if self.spans(marked, PROBE) == reference:
                return keeps, self.footer
        return None, None

    def spans(self, marked: str, messages: list[dict]) -> list[tuple[int, int]] | None:
        """The assistant spans from one marked rendering, or None when it does not hold them plainly."""
        positions = marker_positions(marked)
        contents = [m["content"] for m in messages if m["role"] == "assistant"]
        if positions is None or len(positions) != len(contents):
            return None
        text_length = len(marked) - 2 * len(positions)
        spans = []
        for (start, end), content in zip(positions, contents):
            core = content.strip()
            lead, trail = (content.index(core), len(content) - content.index(core) - len(core)) if core else (0, 0)
            if self.keeps_whitespace:
                start, end = start - lead, end + trail
            finish = end + len(self.footer)
            if finish > text_length:
                return None
            spans.append((start, finish))
        return spans

    def text_and_spans(self, messages: list[dict], where: str) -> tuple[str, list[tuple[int, int]]]:
        """The rendered chat and its assistant spans: from one marked rendering, else from every prefix."""
        if self.footer is not None and all(isinstance(m["content"], str) for m in messages):
            contents = "".join(m["content"] for m in messages)
            blank = any(m["role"] == "assistant" and not m["content"].strip() for m in messages)
            if OPEN not in contents and CLOSE not in contents and not blank:
                marked = self.render(marked_messages(messages))
                text = marked.replace(OPEN, "").replace(CLOSE, "")
                spans = self.spans(marked, messages)
                if spans is not None and all(text[f - len(self.footer) : f] == self.footer for _, f in spans):
                    return text, spans
        text = self.render(messages)
        return text, prefix_spans(self, messages, text, where)


def marked_messages(messages: list[dict]) -> list[dict]:
    """The messages with each assistant content's non-blank core wrapped in OPEN ... CLOSE."""
    marked = []
    for message in messages:
        content = message["content"]
        if message["role"] == "assistant":
            core = content.strip()
            at = content.index(core)
            content = content[:at] + OPEN + core + CLOSE + content[at + len(core) :]
        marked.append({**message, "content": content})
    return marked


def marker_positions(marked: str) -> list[tuple[int, int]] | None:
    """(start, end) in the unmarked text of each OPEN ... CLOSE pair, in order; None unless they pair up."""
    pairs = list(re.finditer(f"{OPEN}[^{OPEN}{CLOSE}]*{CLOSE}", marked))
    if marked.count(OPEN) != len(pairs) or marked.count(CLOSE) != len(pairs):
        return None
    return [(pair.start() - 2 * n, pair.end() - 2 * n - 2) for n, pair in enumerate(pairs)]


def prefix_spans(renderer: ChatRenderer, messages: list[dict], text: str, where: str) -> list[tuple[int, int]]:
    """Assistant spans found by rendering each prefix of the chat (needs prefixes rendered as prefixes)."""
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        header = renderer.render(messages[:k], add_generation_prompt=True) if k else ""
        turn = renderer.render(messages[: k + 1])
        if not (text.startswith(turn) and turn.startswith(header)):
            raise UsageError(
                f"{where}: the chat template renders this chat's turns differently from the whole chat, "
                "so its assistant turns cannot be located; set train_on: all for this source"
            )
        spans.append((len(header), len(turn)))
    return spans


# The worker processes' own Worker, set by `start_worker` (a pool's initializer).
_WORKER: Worker | None = None


def start_worker(worker: Worker) -> None:
    global _WORKER
    _WORKER = worker


def tokenize_in_worker(chunk: Chunk) -> Tokenized:
    return _WORKER.tokenize(chunk)
