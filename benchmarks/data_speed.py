"""Speed of `ladder adapt --prepare-data` against the tokenizer's own batch encoding, in one run.

The data: the books under $LADDER_DATA/train (a document per paragraph) and chats made of the same
paragraphs (two exchanges each, trained on the assistant turns). Three sides, alternating round by
round, each rated by the same tokens over its best round's wall time:
- prepare: `load_blocks` end to end into a fresh cache (chat rendering, tokenizing in worker
  processes on every core, masks, shards, packing);
- tokenizer: the fast tokenizer's own batch call on the same texts (chats rendered beforehand), its
  Rust threads on every core: the rate to reach (goal: prepare >= 0.8x);
- datasets.map: prepare's worker code under `datasets.Dataset.map(num_proc=cores)` instead of its pool.

    .venv/bin/python -m benchmarks.data_speed [--rounds 2] [--books 24]
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import machine, run_benchmark
from ladder.errors import ArgumentParser


def build_corpus(folder: Path, books: int) -> tuple[Path, Path]:
    """Paragraphs of `books` books (copied, as the prepare reads files) and chats made of them."""
    from ladder.io.files import ladder_data_dir

    names = sorted((ladder_data_dir() / "train").rglob("*.txt"))[:books]
    (folder / "books").mkdir()
    chats = []
    for number, name in enumerate(names):
        text = name.read_text(encoding="utf-8", errors="replace")
        (folder / "books" / f"{number:02d}.txt").write_text(text)
        paragraphs = [p for p in text.replace("\r\n", "\n").split("\n\n") if p.strip()]
        for i in range(0, len(paragraphs) - 3, 4):
            turns = [("user", 0), ("assistant", 1), ("user", 2), ("assistant", 3)]
            chats.append({"messages": [{"role": role, "content": paragraphs[i + k]} for role, k in turns]})
    random.Random(0).shuffle(chats)
    chat_file = folder / "chats.jsonl"
    chat_file.write_text("".join(json.dumps(c) + "\n" for c in chats))
    return folder / "books", chat_file


def texts_of(sources, tokenizer) -> list[str]:
    """The texts the prepare tokenizes: the paragraphs and the rendered chats."""
    from ladder.adapt.sources import local_items

    return [
        item if kind == "text" else tokenizer.apply_chat_template(json.loads(item)["messages"], tokenize=False)
        for i, source in enumerate(sources)
        for kind, item, _ in local_items(source, f"data.train[{i}]")
    ]


def time_tokenizer(tokenizer, texts: list[str]) -> tuple[float, int]:
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    started, tokens = time.perf_counter(), 0
    for i in range(0, len(texts), 1024):
        tokens += sum(map(len, tokenizer(texts[i : i + 1024], add_special_tokens=False)["input_ids"]))
    return time.perf_counter() - started, tokens


def time_prepare(sources, tokenizer, cache: Path) -> float:
    from ladder.adapt.data import load_blocks

    started = time.perf_counter()
    load_blocks(sources, tokenizer, 2048, cache, "train")
    return time.perf_counter() - started


def time_datasets_map(sources, tokenizer) -> float:
    """datasets.map over the items in batches of a chunk's size, with prepare's worker code."""
    import datasets
    import numpy as np

    from ladder.adapt.pack import worker_count
    from ladder.adapt.sources import local_items
    from ladder.adapt.tokenize import Chunk, Worker

    backend, template = tokenizer.backend_tokenizer.to_str(), tokenizer.chat_template
    worker = Worker(backend, template, tokenizer.special_tokens_map, tokenizer.eos_token_id)
    started = time.perf_counter()
    items = [(i, kind, item) for i, source in enumerate(sources) for kind, item, _ in local_items(source, "x")]
    rows = dict(zip(("source", "kind", "item"), map(list, zip(*items))))

    def tokenize(batch: dict) -> dict:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        out = {"ids": [], "targets": []}
        for i in sorted(set(batch["source"])):  # a batch may straddle the two sources
            picked = [n for n, s in enumerate(batch["source"]) if s == i]
            items = [batch["item"][n] for n in picked]
            result = worker.tokenize(Chunk(sources[i], "x", batch["kind"][picked[0]], items, ["x"] * len(picked)))
            ends = np.cumsum(result.lengths)[:-1]
            out["ids"] += [a.astype(np.uint16) for a in np.split(result.ids, ends)]
            out["targets"] += [a for a in np.split(result.targets, ends)]
        return out

    dataset = datasets.Dataset.from_dict(rows)
    mapped = dataset.map(
        tokenize, batched=True, batch_size=512, num_proc=worker_count(), remove_columns=list(rows), keep_in_memory=True
    )
    np.concatenate(mapped.with_format("numpy")["ids"])
    return time.perf_counter() - started


def measure(argv: list[str]) -> int:
    parser = ArgumentParser(prog="benchmarks.data_speed", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="runs per side, alternating")
    parser.add_argument("--books", type=int, default=24, help="how many of the books (the chats come from the same)")
    args = parser.parse_args(argv)
    import datasets
    from transformers import AutoTokenizer

    from ladder.adapt.recipe import SourceSpec
    from ladder.io.loading import embedded_model_path

    datasets.disable_progress_bars()
    gguf = embedded_model_path()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as temporary:
        folder = Path(temporary)
        books, chat_file = build_corpus(folder, args.books)
        sources = [SourceSpec(path=str(books), documents="blank_line"), SourceSpec(path=str(chat_file))]
        texts = texts_of(sources, tokenizer)
        seconds = {"prepare": [], "tokenizer": [], "datasets.map": []}
        for round_number in range(args.rounds):
            seconds["tokenizer"].append(time_tokenizer(tokenizer, texts)[0])
            seconds["prepare"].append(time_prepare(sources, tokenizer, folder / f"cache-{round_number}"))
            seconds["datasets.map"].append(time_datasets_map(sources, tokenizer))
        _, tokens = time_tokenizer(tokenizer, texts)
    where = machine()
    print(
        f"machine: {where['cpu']}, {where['cpus']} CPUs; load average {load_before:.2f}, then {where['load_average']:.2f}"
    )
    print(f"data: {args.books} books as {len(texts):,} documents (paragraphs and chats), {tokens:,} tokens")
    rates = {side: tokens / min(times) for side, times in seconds.items()}
    for side, times in seconds.items():
        print(f"{side:13} {rates[side]:12,.0f} tokens/s  (best of {', '.join(f'{t:.2f}' for t in times)} s)")
    print(f"per core: prepare {rates['prepare'] / len(os.sched_getaffinity(0)):,.0f} tokens/s")
    print(f"datasets.map / prepare's pool: {rates['datasets.map'] / rates['prepare']:.2f}")
    print(f"prepare / tokenizer batch encoding: {rates['prepare'] / rates['tokenizer']:.2f}  (goal >= 0.8)")
    return 0


if __name__ == "__main__":
    sys.exit(run_benchmark("data_speed", measure))
