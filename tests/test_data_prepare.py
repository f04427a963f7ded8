"""`ladder adapt --prepare-data` on every core (adapt/pack.py, sources.py): resumption after SIGKILL of
the prepare or of a worker, a failing stream reopened where it stopped, seeded samples of local and
Hub sources, mixtures and their settings, the cache's size printed before and after, wide token ids."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import httpx2
import numpy as np
import psutil
import pytest
from transformers import AutoTokenizer

from adapt_runs import books, prose
from ladder.adapt import sources as sources_module
from ladder.adapt.data import load_blocks
from ladder.adapt.pack import ChunkRunner, Sampling, worker_count
from ladder.adapt.recipe import SourceSpec, load_recipe
from ladder.adapt.sources import resumable_batches, source_chunks
from ladder.adapt.tokenize import Chunk, Worker
from ladder.errors import UsageError
from ladder.log import configure

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def said():
    """The `ladder` logger as a command sets it: several tests read what the prepare says, also when this
    file runs alone (no earlier command in the session configured it)."""
    configure(0)


PREPARE_SCRIPT = """
import sys
from pathlib import Path
from transformers import AutoTokenizer
from ladder.adapt.data import load_blocks
from ladder.adapt.recipe import SourceSpec
from ladder.errors import run_command
sources = [SourceSpec(**s) for s in {sources!r}]
tokenizer = AutoTokenizer.from_pretrained({tokenizer!r})
def prepare(argv):
    load_blocks(sources, tokenizer, 16, Path({cache!r}), "train")
sys.exit(run_command("adapt", prepare, []))
"""


@pytest.mark.parametrize(
    "kind, kill_after, victim", [("local", 1, "prepare"), ("local", 30, "prepare"), ("hub", 15, "prepare"),
                                 ("local", 5, "worker")]
)  # fmt: skip
def test_a_prepare_killed_at_any_point_resumes_to_the_same_bytes(
    tmp_path, smollm2_tokenizer_dir, monkeypatch, kind, kill_after, victim
):
    """SIGKILL of the prepare, or of one of its tokenizer workers (the OOM killer's choice): the run
    ends (a dead worker: in one line, not a wait for its chunk forever), and the next one continues."""
    if victim == "worker" and worker_count() < 2:
        pytest.skip("one core: the prepare tokenizes in its own process")
    sources = books(tmp_path / "data", 100)
    if kind == "hub":  # `hf:` streams through datasets; a local dataset folder stands in for a Hub name
        (tmp_path / "data" / "hub").mkdir()
        (tmp_path / "data" / "chats.jsonl").rename(tmp_path / "data" / "hub" / "train.jsonl")
        sources = [SourceSpec(path=f"hf:{tmp_path / 'data' / 'hub'}", max_tokens=20000), sources[1]]
    tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    straight = load_blocks(sources, tokenizer, 16, tmp_path / "straight", "train")  # chunked the usual way

    # A child chunked finely (a shard per record), killed once it has written `kill_after` shards.
    script = PREPARE_SCRIPT.format(
        sources=[vars(s) for s in sources], tokenizer=str(smollm2_tokenizer_dir), cache=str(tmp_path / "cache")
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=REPO,
        env={**os.environ, "LADDER_DATA_CHUNK_CHARS": "200"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 120
    while len(list((tmp_path / "cache").glob(".train-*.shards-200/*.npz"))) < kill_after:
        assert child.poll() is None and time.monotonic() < deadline, child.stdout.read().decode()
        time.sleep(0.01)
    if victim == "prepare":
        child.send_signal(signal.SIGKILL)
        child.wait()
    else:
        prepare = psutil.Process(child.pid)
        # A tokenizer worker: forked, so it runs the prepare's own command line.
        next(p for p in prepare.children() if p.cmdline() == prepare.cmdline()).kill()  # SIGKILL
        output = child.communicate(timeout=120)[0].decode()
        assert child.returncode == 2 and "tokenizer worker process ended abruptly" in output.splitlines()[-1]
    assert not list((tmp_path / "cache").glob("train-*")), "the prepare finished before it was killed"
    kept = len(list((tmp_path / "cache").glob(".train-*.shards-200/*.npz")))

    monkeypatch.setattr(sources_module, "CHUNK_CHARS", 200)  # the child's chunking, to continue its shards
    resumed = load_blocks(sources, tokenizer, 16, tmp_path / "cache", "train")
    (entry,) = (tmp_path / "cache").glob("train-*")
    (reference,) = (tmp_path / "straight").glob("train-*")
    for name in ("blocks.bin", "targets.bits", "starts.bits", "meta.json"):
        assert (entry / name).read_bytes() == (reference / name).read_bytes(), name
    assert np.array_equal(resumed.ids, straight.ids) and kept >= kill_after
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [entry.name], "the shards are cleared"


def test_a_worker_dead_before_the_next_chunk_is_sent_ends_the_run_in_one_line(smollm2_tokenizer_dir):
    """The kill test above races the pool: a worker that dies between chunks breaks the pool before
    the next `submit`, which then raises (once a traceback and status 1 in CI). Here that order is fixed."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    worker = Worker(tokenizer.backend_tokenizer.to_str(), None, tokenizer.special_tokens_map, tokenizer.eos_token_id)
    source = SourceSpec(path="books")
    with ChunkRunner(worker, 2) as runner:
        this = psutil.Process()
        next(p for p in this.children() if p.cmdline() == this.cmdline()).kill()  # a forked worker
        with contextlib.suppress(BrokenProcessPool):  # until the executor has noticed the death
            while True:
                runner.pool.submit(int).result(timeout=30)
        jobs = ((n, Chunk(source, "books", "text", ["some words"], ["books:1"])) for n in range(3))
        with pytest.raises(UsageError, match="tokenizer worker process ended abruptly"):
            list(runner.run(jobs))


# A network error as the standard library raises it, and as huggingface_hub's HTTP client (httpx2
# from huggingface_hub 2.x; not an OSError) does when the Hub streams a dataset.
NETWORK_ERRORS = {"OSError": ConnectionError, "httpx2": httpx2.ReadError}


@pytest.mark.parametrize("client", NETWORK_ERRORS)
def test_a_failing_stream_is_reopened_where_it_stopped(client, capsys):
    import datasets

    failures = []

    def records(shards: list[int]):
        for shard in shards:
            for n in range(25):
                if shard == 1 and n == 12 and len(failures) < 2:  # twice, in the middle of the second file
                    failures.append(n)
                    raise NETWORK_ERRORS[client]("connection reset by peer")
                yield {"n": shard * 25 + n}

    def open_stream():
        return datasets.IterableDataset.from_generator(records, gen_kwargs={"shards": [0, 1, 2, 3]})

    def read(state=None, **retrying) -> list[int]:
        batches = resumable_batches(open_stream, state, "the stream", 10, **retrying)
        return [record["n"] for batch, _ in batches for record in batch]

    # The batch of records 30-39 fails at record 37, twice: it is read again from record 30.
    assert read(retries=2, wait=0.01) == list(range(100)) and len(failures) == 2
    assert capsys.readouterr().err.count("connection reset by peer); retrying") == 2
    # From a saved position (a shard's), the stream continues after it.
    positions = [position for _, position in resumable_batches(open_stream, None, "the stream", 10)]
    assert read(json.dumps(positions[5])) == list(range(60, 100))

    failures.clear()
    with pytest.raises(UsageError, match="cannot read the stream: connection reset by peer"):
        read(retries=1, wait=0.01)


def split_documents(blocks, part: slice = slice(None)) -> list[np.ndarray]:
    """The token ids of each document in (a part of) the blocks, split at the document starts."""
    ids, starts = blocks.ids.ravel()[part], blocks.starts.ravel()[part]
    return [ids[a:b] for a, b in itertools.pairwise([*np.flatnonzero(starts), len(ids)])]


def documents_of(blocks, tokenizer) -> list[str]:
    return [tokenizer.decode(ids).removesuffix(tokenizer.eos_token) for ids in split_documents(blocks)]


def test_a_seeded_sample_is_drawn_from_the_whole_source(tmp_path, smollm2_tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    paragraphs = [f"Paragraph {i}. " + prose(i, 1) for i in range(200)]
    (tmp_path / "book.txt").write_text("\n\n".join(paragraphs))
    source = [SourceSpec(path=str(tmp_path / "book.txt"), documents="blank_line", max_tokens=3000)]

    def sample(seed, cache):
        blocks = load_blocks(source, tokenizer, 16, tmp_path / cache, "train", Sampling(seed=seed))
        return blocks, [paragraphs.index(d) for d in documents_of(blocks, tokenizer)[:-1]]  # the last is cut

    in_order, first = sample(None, "a")
    assert first == list(range(len(first)))  # no seed: the first documents, as before
    one, drawn = sample(1, "b")
    again, drawn_again = sample(1, "c")
    other, drawn_other = sample(2, "d")
    assert np.array_equal(one.ids, again.ids) and drawn == drawn_again
    assert not np.array_equal(one.ids, other.ids) and drawn != drawn_other
    for picked in (drawn, drawn_other):
        assert len(set(picked)) == len(picked) and max(picked) > 150 and min(picked) < 50  # from all over
    assert abs(one.ids.size - in_order.ids.size) < 16


def test_mixed_sources_keep_their_weights(tmp_path, smollm2_tokenizer_dir, capsys):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    (tmp_path / "a.txt").write_text("\n\n".join(f"Apple {i}. " + prose(i, 1) for i in range(300)))
    (tmp_path / "b.txt").write_text("\n\n".join(f"River {i}. " + prose(i + 500, 1) for i in range(300)))
    sources = [
        SourceSpec(path=str(tmp_path / "a.txt"), documents="blank_line", weight=3),
        SourceSpec(path=str(tmp_path / "b.txt"), documents="blank_line", weight=1),
    ]

    def shares(blocks, part=slice(None)):
        tokens = {"Apple": 0, "River": 0}
        for ids in split_documents(blocks, part):
            tokens[tokenizer.decode(ids[:1]).strip()] += len(ids)
        return tokens["Apple"] / (tokens["Apple"] + tokens["River"])

    blocks = load_blocks(sources, tokenizer, 64, tmp_path / "cache", "train", Sampling(seed=0, mix_tokens=12000))
    assert blocks.ids.size == 12000 // 64 * 64
    assert shares(blocks) == pytest.approx(0.75, abs=0.01)
    assert shares(blocks, slice(-1200, None)) == pytest.approx(0.75, abs=0.05)  # the held-out tail too

    # More than the sources hold: the mixture shrinks to keep its weights, and says so.
    large = load_blocks(sources, tokenizer, 64, tmp_path / "cache", "train", Sampling(seed=0, mix_tokens=10**6))
    assert shares(large) == pytest.approx(0.75, abs=0.01)
    assert "less than its share" in capsys.readouterr().out


def test_the_size_is_printed_before_and_after(tmp_path, smollm2_tokenizer_dir, capsys):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    blocks = load_blocks(books(tmp_path), tokenizer, 32, tmp_path / "cache", "train")
    before, after = capsys.readouterr().out.splitlines()[:2]
    (entry,) = (tmp_path / "cache").glob("train-*")
    written = sum(
        f.stat().st_size for f in entry.iterdir() if f.suffix != ".json" and not f.name.startswith(".")
    )  # not the output marker
    assert blocks.ids.dtype == np.uint16 and written == blocks.ids.size * 2 + 2 * len(blocks) * 4  # 2 bits a token
    estimated = int(before.split("about ")[1].split(" tokens")[0].replace(",", ""))
    assert 0.5 < estimated / blocks.ids.size < 2 and "2.25 bytes per token" in before
    assert f"{written / 1e6:,.1f} MB" in after and f"{len(blocks):,} blocks of 32 tokens" in after


def test_a_seeded_hub_sample_takes_each_file_in_turn_and_resumes_exactly(tmp_path, monkeypatch):
    for part in range(4):  # a dataset of four files, as a Hub dataset is stored
        (tmp_path / f"part-{part}.jsonl").write_text(
            "".join(json.dumps({"text": f"{part}.{r}"}) + "\n" for r in range(6))
        )
    source = SourceSpec(path=f"hf:{tmp_path}")
    monkeypatch.setattr(sources_module, "CHUNK_CHARS", 3 * sources_module.RECORD_CHARS)  # 3 records a chunk

    def read(seed, state=None):
        return [record["text"] for chunk in source_chunks(source, "k", seed, 0, state) for record in chunk.items]

    in_order, one, other = read(None), read(1), read(2)
    assert in_order == [f"{p}.{r}" for p in range(4) for r in range(6)]
    assert sorted(one) == sorted(in_order) and one == read(1) and one != other
    assert sorted(record.split(".")[0] for record in one[:4]) == ["0", "1", "2", "3"]  # a record of each file
    second = list(source_chunks(source, "k", 1, 0, None))[1]  # a shard's position: after the second chunk
    assert read(1, second.state) == one[6:]


def test_ids_past_uint16_are_kept_in_uint32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(70000)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="w69999")
    (tmp_path / "a.txt").write_text("w1 w65535 w65536 w69998 w3 w70001 w2")
    blocks = load_blocks([SourceSpec(path=str(tmp_path / "a.txt"))], tokenizer, 4, tmp_path / "cache", "train")
    assert blocks.ids.dtype == np.uint32
    assert blocks.ids.ravel().tolist() == [1, 65535, 65536, 69998, 3, 0, 2, 69999]


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"data.train.0.weight": 1}, "weight every data.train source, or none"),
        ({"data.train.0.weight": 1, "data.train.1.weight": 1}, "data.mix_tokens goes with weights"),
        ({"data.mix_tokens": 1000}, "data.mix_tokens goes with weights"),
        (
            {"data.train.0.weight": 1, "data.train.1.weight": 1, "data.mix_tokens": 10, "data.train.1.max_tokens": 5},
            r"data.train\[1\]: a weighted source takes its share",
        ),
        ({"data.train.0.weight": -1}, r"data.train\[0\].weight = -1: input should be greater than or equal to 0"),
    ],
)
def test_mixture_settings_are_checked(tmp_path, overrides, message):

    recipe = {"data": {"train": [str(tmp_path / "a.txt"), str(tmp_path / "b.txt")]}}
    (tmp_path / "r.yaml").write_text(json.dumps(recipe))
    with pytest.raises(UsageError, match=message):
        load_recipe(tmp_path / "r.yaml", [f"{key}={value}" for key, value in overrides.items()])
