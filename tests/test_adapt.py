"""adapt/: data packing and caching, the training loop, exact resume after SIGKILL, two processes
against one, divergence, the final checkpoint, trainable modes and objectives, CLI errors.

Runs the real loop on the tiny 4-layer checkpoint (SmolLM2's tokenizer) with generated prose.
"""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import ladder
from ladder.adapt.cli import main as adapt_main
from ladder.adapt.data import BlockOrder, document_positions, load_blocks, prepare_data
from ladder.adapt.losses import lm_loss, next_token_labels
from ladder.adapt.recipe import DataSpec, SourceSpec, load_recipe
from ladder.adapt.train import train
from ladder.cli import main as ladder_main
from ladder.errors import UsageError
from ladder.launch import multi_process_launcher
from tiny import random_ids, tiny_llama, two_processes

REPO = Path(__file__).resolve().parents[1]
WORDS = (
    "the a house river lantern quiet walked under over she he they old new bright small letter "
    "morning evening garden window road stone bird spoke answered slowly again never always"
).split()


def prose(seed: int, paragraphs: int) -> str:
    rng = random.Random(seed)
    return "\n\n".join(
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60))).capitalize() + "." for _ in range(paragraphs)
    )


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("corpus")
    (folder / "train").mkdir()
    for i in range(3):
        (folder / "train" / f"book{i}.txt").write_text(prose(i, 40))
    (folder / "heldout.txt").write_text(prose(99, 30))
    return folder


def write_recipe(directory: Path, checkpoint: Path, corpus: Path, **overrides) -> Path:
    recipe = {
        "model": {"path": str(checkpoint), "ladder_layers": 2},
        "data": {
            "train": [str(corpus / "train")],
            "eval": [str(corpus / "heldout.txt")],
            "seq_len": 64,
            "eval_blocks": 8,
            "cache_dir": str(directory / "cache"),
        },
        "budget": 8 * 4 * 64,
        "batch": {"micro_batch": 4, "grad_accum": 1},
        "optimizer": {"lr": 3e-3},
        "schedule": {"warmup_steps": 2, "decay": "cosine"},
        "checkpoint_every": 3,
        "eval_every": 4,
        "output_dir": str(directory / "run"),
        "logging": {"progress": False},
    }
    for key, value in overrides.items():
        node = recipe
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> list[float]:
    return [record["loss"] for record in metrics(run_dir) if "loss" in record]


def tensorboard_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """(step, value) per scalar tag, as TensorBoard reads a run folder (purged steps dropped)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(directory))
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def wandb_history(directory: Path) -> list[tuple[str, dict]]:
    """(run folder, row) for every history row wandb wrote offline under `directory`, oldest run first.
    A `.wandb` file is
    a 7-byte header (`:W&B`, magic, version) and then a LevelDB-style log of protobuf `Record`s:
    32 KiB blocks of chunks (crc32 4 bytes, length 2, type 1: full, first, middle, last)."""
    from wandb.proto import wandb_internal_pb2

    rows = []
    for path in sorted(directory.glob("offline-run-*/run-*.wandb")):
        data, position, pending = path.read_bytes(), 7, b""
        assert data[:4] == b":W&B"
        while position + 7 <= len(data):
            if (left := 32768 - position % 32768) < 7:
                position += left  # a block's tail too short for a chunk header is padding
                continue
            length, kind = int.from_bytes(data[position + 4 : position + 6], "little"), data[position + 6]
            pending += data[position + 7 : position + 7 + length]
            position += 7 + length
            if kind in (1, 4):
                record = wandb_internal_pb2.Record()
                record.ParseFromString(pending)
                pending = b""
                if record.WhichOneof("record_type") == "history":
                    rows.append(
                        (
                            path.parent.name,
                            {
                                item.key or ".".join(item.nested_key): json.loads(item.value_json)
                                for item in record.history.item
                            },
                        )
                    )
    return rows


def run_adapt(args: list[str], launcher: list[str] | None = None, **popen) -> subprocess.Popen:
    command = (launcher or [sys.executable]) + ["-m", "adapt.cli", *args]
    return subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)


# --- data -------------------------------------------------------------------------------------------


def test_packing_puts_eos_after_every_document_and_caches(tmp_path, smollm2_tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    documents = [prose(1, 3), prose(2, 2)]
    (tmp_path / "a.txt").write_text(documents[0])
    (tmp_path / "b.txt").write_text(documents[1])
    sources = [SourceSpec(path=str(tmp_path / "*.txt"))]
    blocks = load_blocks(sources, tokenizer, 16, tmp_path / "cache", "train")

    stream = []
    for text in documents:
        stream += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    whole = len(stream) // 16 * 16
    assert blocks.ids.shape == (whole // 16, 16)
    assert blocks.ids.ravel().tolist() == stream[:whole]
    assert blocks.targets.all() and blocks.masked_share() == 0  # plain text: every token is trained on

    (cached,) = (tmp_path / "cache").iterdir()
    written = (cached / "blocks.bin").stat().st_mtime_ns
    again = load_blocks(sources, tokenizer, 16, tmp_path / "cache", "train")
    assert (cached / "blocks.bin").stat().st_mtime_ns == written and np.array_equal(again.ids, blocks.ids)
    load_blocks(sources, tokenizer, 32, tmp_path / "cache", "train")  # another seq_len: another entry
    (tmp_path / "b.txt").write_text(documents[1] + " More.")  # changed bytes: another entry
    load_blocks(sources, tokenizer, 16, tmp_path / "cache", "train")
    assert len(list((tmp_path / "cache").iterdir())) == 3


def test_blank_line_documents_jsonl_and_chat_records(tmp_path, smollm2_tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    (tmp_path / "p.txt").write_text("First block.\n\nSecond block.\n\n\n")
    texts = [{"text": "A record."}, {"text": "Another record."}]
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps(t) for t in texts) + "\n")
    openai = {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]}
    sharegpt = {"conversations": [{"from": "human", "value": "Hi?"}, {"from": "gpt", "value": "Hello."}]}
    (tmp_path / "c.jsonl").write_text(json.dumps(openai) + "\n")
    (tmp_path / "s.jsonl").write_text(json.dumps(sharegpt) + "\n")
    sources = [
        SourceSpec(path=str(tmp_path / "p.txt"), documents="blank_line"),
        SourceSpec(path=str(tmp_path / "t.jsonl")),
        SourceSpec(path=str(tmp_path / "c.jsonl")),
        SourceSpec(path=str(tmp_path / "s.jsonl"), chat_field="conversations"),
    ]
    blocks = load_blocks(sources, tokenizer, 4, tmp_path / "cache", "train")
    chat = tokenizer.apply_chat_template(openai["messages"], tokenize=False)
    expected = []
    for text in ["First block.", "Second block.", "A record.", "Another record.", chat, chat]:
        expected += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert blocks.ids.ravel().tolist() == expected[: len(expected) // 4 * 4]
    assert "<|im_start|>assistant" in chat


def test_hf_source_streams_a_dataset_and_renders_chats(tmp_path, smollm2_tokenizer_dir):
    # `hf:` goes through datasets.load_dataset(streaming=True); a local dataset folder stands in
    # for a Hub name here, as the tests run offline.
    tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    dataset = tmp_path / "instruct"
    dataset.mkdir()
    records = [
        {"conversations": [{"from": "human", "value": f"Question {i}?"}, {"from": "gpt", "value": prose(i, 1)}]}
        for i in range(20)
    ]
    (dataset / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    source = SourceSpec(path=f"hf:{dataset}", chat_field="conversations", max_tokens=300)
    blocks = load_blocks([source], tokenizer, 32, tmp_path / "cache", "train")
    assert blocks.ids.shape == (300 // 32, 32)
    first = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Question 0?"}, {"role": "assistant", "content": prose(0, 1)}], tokenize=False
    )
    ids = tokenizer(first, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert blocks.ids.ravel().tolist()[: len(ids)] == ids[: blocks.ids.size]


def test_chat_records_train_on_the_assistant_turns_only(tmp_path, smollm2_tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    chat = [
        {"role": "user", "content": "Name a bird."},
        {"role": "assistant", "content": "A lantern-eyed owl."},
        {"role": "user", "content": "Another?"},
        {"role": "assistant", "content": "A heron."},
    ]
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": chat}) + "\n")
    text = tokenizer.apply_chat_template(chat, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    # Direct computation: tokenize the rendered chat piece by piece; each assistant piece runs from the
    # end of its generation prompt to the end of its turn.
    expected, done = [], ""
    for k in range(len(chat)):
        turn = tokenizer.apply_chat_template(chat[: k + 1], tokenize=False)
        if chat[k]["role"] == "assistant":
            header = tokenizer.apply_chat_template(chat[:k], tokenize=False, add_generation_prompt=True)
            expected += [0] * len(tokenizer(header[len(done) :], add_special_tokens=False)["input_ids"])
            expected += [1] * len(tokenizer(turn[len(header) :], add_special_tokens=False)["input_ids"])
        else:
            expected += [0] * len(tokenizer(turn[len(done) :], add_special_tokens=False)["input_ids"])
        done = turn
    expected.append(1)  # the EOS after the last assistant turn
    assert len(expected) == len(ids) and 0 < sum(expected) < len(expected)

    blocks = load_blocks([SourceSpec(path=str(tmp_path / "c.jsonl"))], tokenizer, len(ids), tmp_path / "cache", "train")
    assert blocks.ids.ravel().tolist() == ids and blocks.targets.ravel().tolist() == expected
    assert tokenizer.decode([t for t, keep in zip(ids, expected) if keep]).startswith("A lantern-eyed owl.")
    meta = json.loads(next((tmp_path / "cache").glob("train-*/meta.json")).read_text())
    assert meta["masked_share"] == pytest.approx(1 - sum(expected) / len(expected), abs=1e-6)
    everything = load_blocks(
        [SourceSpec(path=str(tmp_path / "c.jsonl"), train_on="all")], tokenizer, len(ids), tmp_path / "cache", "train"
    )
    assert everything.targets.all() and len(list((tmp_path / "cache").iterdir())) == 2  # train_on is in the key

    # The loss: mean cross-entropy over exactly the positions whose next token is an assistant token.
    logits = torch.randn(1, len(ids), 50, generator=torch.Generator().manual_seed(0))
    input_ids = torch.tensor([ids]) % 50
    labels = next_token_labels(input_ids, torch.tensor([expected]))
    kept = [t for t in range(len(ids) - 1) if expected[t + 1]]
    direct = torch.nn.functional.cross_entropy(logits[0, kept], input_ids[0, [t + 1 for t in kept]])
    # lm_loss takes final hidden states and the LM head's weight: an identity head makes them the logits.
    assert float(lm_loss(logits, torch.eye(50), labels)) == pytest.approx(float(direct), rel=1e-6)

    (tmp_path / "t.txt").write_text("Plain prose.")
    with pytest.raises(UsageError, match="train_on: assistant needs chat records"):
        load_blocks(
            [SourceSpec(path=str(tmp_path / "t.txt"), train_on="assistant")], tokenizer, 2, tmp_path / "cache", "train"
        )


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_isolated_documents_compute_what_each_document_computes_alone(attention):
    model = ladder.to_ladder(tiny_llama(), [3, 4, 5])
    model.set_attn_implementation(attention)
    lengths = [5, 9, 4, 6]  # the first continues a document cut by the packing
    ids = random_ids(batch=1, length=sum(lengths))
    starts = np.zeros((1, sum(lengths)), dtype=np.uint8)
    starts[0, np.cumsum([0, *lengths[:-1]])[1:]] = 1
    positions = document_positions(starts)
    assert positions.tolist() == [[*range(5), *range(9), *range(4), *range(6)]]
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=torch.from_numpy(positions), use_cache=False).logits
        alone = torch.cat([model(input_ids=piece, use_cache=False).logits for piece in ids.split(lengths, dim=1)], 1)
        plain = model(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(plain[:, 5:], alone[:, 5:], atol=1e-3)  # without isolation, documents see each other


def test_chat_training_with_isolated_documents_runs_and_reports_the_masked_share(tmp_path, tiny_checkpoint, capsys):
    records = [
        {"messages": [{"role": "user", "content": prose(i, 1)}, {"role": "assistant", "content": prose(i + 50, 1)}]}
        for i in range(24)
    ]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    recipe = write_recipe(
        tmp_path,
        tiny_checkpoint,
        tmp_path,
        budget=2 * 4 * 64,
        **{
            "data.train": [str(tmp_path / "chat.jsonl")],
            "data.eval": [],
            "data.heldout_fraction": 0.2,
            "data.isolate_documents": True,
        },
    )
    assert adapt_main([str(recipe), "--prepare-data"]) == 0
    share = float(re.search(r"([\d.]+)% of the training tokens are masked", capsys.readouterr().out).group(1))
    assert 20 < share < 80
    assert adapt_main([str(recipe)]) == 0
    assert f"({share:.1f}% of the training tokens masked from the loss)" in capsys.readouterr().out
    assert [r["step"] for r in metrics(tmp_path / "run") if "loss" in r] == [1, 2]
    assert all(np.isfinite(r.get("loss", r.get("eval_loss"))) for r in metrics(tmp_path / "run"))


def test_heldout_blocks_come_off_the_end_of_training(tmp_path, smollm2_tokenizer_dir, corpus):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    all_blocks = load_blocks([SourceSpec(path=str(corpus / "train"))], tokenizer, 64, tmp_path / "cache", "train")
    spec = DataSpec(
        train=[SourceSpec(path=str(corpus / "train"))],
        heldout_fraction=0.1,
        eval_blocks=1000,
        seq_len=64,
        cache_dir=str(tmp_path / "cache"),
    )
    splits = prepare_data(spec, tokenizer)
    held = int(np.ceil(len(all_blocks) * 0.1))
    assert len(splits.train) == len(all_blocks) - held and len(splits.eval) == held
    assert np.array_equal(splits.eval.ids, all_blocks.ids[-held:])


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: SourceSpec(path=str(d / "missing.txt")), "does not exist"),
        (lambda d: SourceSpec(path=str(d / "*.md")), "matches no file"),
        (
            lambda d: (d / "x.jsonl").write_text('{"body": "x"}\n') and SourceSpec(path=str(d / "x.jsonl")),
            r"x.jsonl:1: no text field 'text'",
        ),
        (
            lambda d: (d / "y.jsonl").write_text('{"text": "x"}\nnot json\n') and SourceSpec(path=str(d / "y.jsonl")),
            r"y.jsonl:2 is not JSON",
        ),
    ],
    ids=["missing", "empty-glob", "no-field", "bad-json"],
)
def test_bad_sources_are_named(tmp_path, smollm2_tokenizer_dir, make, message):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    with pytest.raises(UsageError, match=message):
        load_blocks([make(tmp_path)], tokenizer, 8, tmp_path / "cache", "train")
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").iterdir())


def test_each_step_reads_the_same_blocks_with_any_number_of_processes():
    one = BlockOrder(blocks=10, seed=3, micro_batch=4, grad_accum=2, processes=1)
    two = BlockOrder(blocks=10, seed=3, micro_batch=2, grad_accum=2, processes=2)
    for step in range(5):  # crosses epochs: 8 blocks per step, 10 blocks
        alone = np.concatenate([one.indices(step, a, 0) for a in range(2)])
        shared = np.concatenate([two.indices(step, a, p) for a in range(2) for p in range(2)])
        assert sorted(alone) == sorted(shared)
    first_epoch = np.concatenate([one.indices(0, a, 0) for a in range(2)] + [one.indices(1, 0, 0)[:2]])
    assert sorted(first_epoch) == list(range(10))  # each block once per epoch


# --- training ---------------------------------------------------------------------------------------


def test_training_lowers_the_loss_and_writes_a_normal_checkpoint(tmp_path, tiny_checkpoint, corpus):
    recipe = load_recipe(write_recipe(tmp_path, tiny_checkpoint, corpus))
    final = train(recipe)
    records = metrics(tmp_path / "run")
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    assert [r["step"] for r in records if "eval_loss" in r] == [0, 4, 8]
    assert evals[-1] < evals[0] - 0.1
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 9))
    assert [r["tokens"] for r in steps] == [256 * s for s in range(1, 9)]
    assert all(r["grad_norm"] > 0 and r["tokens_per_s"] > 0 for r in steps)
    for r in steps:  # one process: per device is all; every block's last position predicts nothing
        assert r["tokens_per_s_per_device"] == pytest.approx(r["tokens_per_s"])
        assert r["labelled_tokens_per_s_per_device"] == pytest.approx(r["tokens_per_s"] * 63 / 64)
        assert 200 * 2**20 < r["peak_memory_bytes"] < 8 * 2**30 and 0 < r["data_wait_share"] < 0.5
        assert 0 < r["mfu"] < 1  # against this CPU's measured matmul peak
    assert steps[0]["lr"] == pytest.approx(1.5e-3) and steps[1]["lr"] == pytest.approx(3e-3)  # warmup
    assert steps[-1]["lr"] < steps[2]["lr"]  # then decay
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step-000003", "step-000006"]

    model = AutoModelForCausalLM.from_pretrained(final)
    assert isinstance(model, ladder.LadderLlamaForCausalLM) and model.config.ladder_layers == [2, 3]
    assert AutoTokenizer.from_pretrained(final).eos_token_id is not None
    assert load_recipe(final / "recipe.yaml").to_dict() == recipe.to_dict()
    # The saved model is the trained one: its held-out loss is the last one logged.
    heldout = prepare_data(recipe.data, AutoTokenizer.from_pretrained(final)).eval.ids
    ids = torch.from_numpy(heldout.astype(np.int64))
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1]
    loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").mean(1).mean()
    assert float(loss) == pytest.approx(evals[-1], rel=1e-5)


def test_a_run_killed_at_any_step_resumes_exactly(tmp_path, tiny_checkpoint, corpus, monkeypatch):
    straight = write_recipe(tmp_path / "straight", tiny_checkpoint, corpus, budget=10 * 256, checkpoint_every=3)
    train(load_recipe(straight))

    # The killed run logs to TensorBoard and to wandb (offline) too; the resumed one must not repeat steps.
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    recipe = write_recipe(
        tmp_path / "killed",
        tiny_checkpoint,
        corpus,
        budget=10 * 256,
        checkpoint_every=3,
        **{"logging.log_with": ["tensorboard", "wandb"]},
    )
    run_dir = tmp_path / "killed" / "run"
    process = run_adapt([str(recipe)])
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        if (run_dir / "metrics.jsonl").exists() and len(losses(run_dir)) >= 5:
            break
        time.sleep(0.05)
    if process.poll() is not None and not (run_dir / "model").exists():  # it failed: say why, not a missing file
        pytest.fail(f"the run ended (exit {process.returncode}) before it could be killed:\n{process.stdout.read()}")
    process.send_signal(signal.SIGKILL)  # somewhere after step 5: the checkpoint at step 3 (or 6) is the latest
    process.wait()
    assert not (run_dir / "model").exists(), "the run finished before it could be killed"
    logged_before_resume = len(losses(run_dir))

    assert adapt_main([str(recipe), "resume=true"]) == 0
    assert losses(run_dir) == losses(tmp_path / "straight" / "run")
    assert logged_before_resume >= 5
    events = tensorboard_scalars(run_dir / "recipe")
    assert [step for step, _ in events["loss"]] == list(range(1, 11))  # each step once, across both runs
    assert [value for _, value in events["loss"]] == pytest.approx(losses(run_dir), rel=1e-6)
    assert [step for step, _ in events["eval_loss"]] == [0, 4, 8, 10]
    # wandb: the resumed run reopens the killed run's id (offline, a second folder of the same run), starts
    # after the checkpoint, and any step both wrote (logged by the killed run but not checkpointed) holds
    # the same values, so the synced run has one value per step. (What the killed process had not yet
    # handed to wandb when SIGKILL came is lost: the steps before the checkpoint may have a gap.)
    assert {path.name.split("-")[-1] for path in (run_dir / "wandb").glob("offline-run-*")} == {
        (run_dir / "wandb-run-id").read_text().split("-")[-1]
    }
    history = [(run, row) for run, row in wandb_history(run_dir / "wandb") if "loss" in row]
    # The resumed run is the newer of the two run folders. The killed one may hold no row at all: wandb
    # writes from its own service process, which can lose everything not yet written when SIGKILL comes.
    folders = sorted(path.name for path in (run_dir / "wandb").glob("offline-run-*"))
    assert len(folders) == 2
    resumed_steps = [row["_step"] for run, row in history if run == folders[-1]]
    assert resumed_steps == list(range(resumed_steps[0], 11)) and resumed_steps[0] - 1 in (3, 6)
    by_step = {}
    for _, row in history:
        by_step.setdefault(row["_step"], set()).add(row["loss"])
    assert set(range(resumed_steps[0], 11)) <= set(by_step) <= set(range(1, 11))
    assert all(len(values) == 1 for values in by_step.values())
    resumed = load_file(run_dir / "model" / "model.safetensors")
    reference = load_file(tmp_path / "straight" / "run" / "model" / "model.safetensors")
    assert resumed.keys() == reference.keys()
    assert all(torch.equal(resumed[name], reference[name]) for name in reference)


@two_processes
def test_two_processes_give_the_loss_curve_of_one(tmp_path, tiny_checkpoint, corpus):
    single = write_recipe(tmp_path / "one", tiny_checkpoint, corpus, budget=6 * 256)
    train(load_recipe(single))
    double = write_recipe(tmp_path / "two", tiny_checkpoint, corpus, budget=6 * 256, **{"batch.micro_batch": 2})
    # `--multi_gpu` is what makes accelerate start several processes (through torchrun); with no
    # GPU, adapt runs them on CPU over gloo. (`--cpu --num_processes 2` starts only one.)
    launcher = multi_process_launcher(2)
    refused = run_adapt([str(double)], launcher=launcher)
    output, _ = refused.communicate(timeout=300)
    assert refused.returncode != 0 and output.count("ladder adapt: error: the data is not prepared") == 1, output
    assert "Loading weights" not in output, output
    assert adapt_main([str(double), "--prepare-data"]) == 0
    process = run_adapt([str(double)], launcher=launcher)
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output
    assert "2 process(es)" in output
    one, two = metrics(tmp_path / "one" / "run"), metrics(tmp_path / "two" / "run")
    assert [r["step"] for r in one] == [r["step"] for r in two]
    for a, b in zip(one, two):
        for key, tolerance in (("loss", 1e-5), ("eval_loss", 1e-5), ("grad_norm", 1e-4)):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=tolerance), (key, a, b)


def test_a_diverging_run_stops_and_keeps_its_last_checkpoint(tmp_path, tiny_checkpoint, corpus, capsys):
    recipe = write_recipe(
        tmp_path, tiny_checkpoint, corpus, checkpoint_every=1, keep_checkpoints=5, **{"schedule.warmup_steps": 0}
    )
    assert adapt_main([str(recipe), "optimizer.lr=1e30"]) == 1  # the first update overflows the weights
    error = capsys.readouterr().err.strip().splitlines()[-1]  # after transformers' loading bar
    assert error.startswith("ladder adapt: training stopped at step 2: loss nan")
    assert str(tmp_path / "run" / "checkpoints" / "step-000001") in error
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["step-000001"]
    assert not (tmp_path / "run" / "model").exists()
    assert [r["step"] for r in metrics(tmp_path / "run") if "loss" in r] == [1]


def test_trainable_ladder_changes_only_the_ladder_layers(tmp_path, tiny_checkpoint, corpus):
    final = train(
        load_recipe(write_recipe(tmp_path, tiny_checkpoint, corpus, budget=2 * 256, **{"trainable.mode": "ladder"}))
    )
    before, after = load_file(tiny_checkpoint / "model.safetensors"), load_file(final / "model.safetensors")
    for name, tensor in before.items():
        in_ladder = name.startswith(("model.layers.2.", "model.layers.3."))
        assert torch.equal(tensor, after[name]) != in_ladder, name


def test_lora_adapters_are_merged_into_the_weights(tmp_path, tiny_checkpoint, corpus):
    final = train(
        load_recipe(
            write_recipe(
                tmp_path,
                tiny_checkpoint,
                corpus,
                budget=3 * 256,
                **{"trainable.mode": "lora", "trainable.lora.target_modules": ["q_proj", "v_proj"]},
            )
        )
    )
    before, after = load_file(tiny_checkpoint / "model.safetensors"), load_file(final / "model.safetensors")
    assert after.keys() == before.keys()  # no adapter tensors left
    for name, tensor in before.items():
        assert torch.equal(tensor, after[name]) != name.endswith(("q_proj.weight", "v_proj.weight")), name


def test_distillation_from_an_identical_teacher_starts_at_zero(tmp_path, tiny_checkpoint, corpus):
    # No ladder layer: the student is the teacher, so the KL of the first step is zero, and with
    # mix the loss is (1 - w) times the next-token loss.
    recipe = write_recipe(
        tmp_path,
        tiny_checkpoint,
        corpus,
        budget=2 * 256,
        **{"model.ladder_layers": 0, "objective.name": "kd", "objective.temperature": 2.0},
    )
    train(load_recipe(recipe))
    first = [r for r in metrics(tmp_path / "run") if "loss" in r][0]
    assert abs(first["loss"]) < 1e-5 and first["lm_loss"] > 5
    mixed = write_recipe(
        tmp_path / "mix",
        tiny_checkpoint,
        corpus,
        budget=256,
        **{"model.ladder_layers": 2, "objective.name": "mix", "objective.kd_weight": 0.25},
    )
    train(load_recipe(mixed))
    first = [r for r in metrics(tmp_path / "mix" / "run") if "loss" in r][0]
    assert first["loss"] > 0.75 * first["lm_loss"]  # plus a positive KL: the ladder student differs


def test_gradient_checkpointing_computes_the_same_step(tmp_path, tiny_checkpoint, corpus):
    plain = write_recipe(tmp_path / "plain", tiny_checkpoint, corpus, budget=2 * 256)
    checkpointed = write_recipe(
        tmp_path / "ckpt", tiny_checkpoint, corpus, budget=2 * 256, **{"model.gradient_checkpointing": True}
    )
    train(load_recipe(plain))
    train(load_recipe(checkpointed))
    assert losses(tmp_path / "ckpt" / "run") == pytest.approx(losses(tmp_path / "plain" / "run"), rel=1e-6)


def test_bf16_trains_under_autocast_and_saves_bf16(tmp_path, tiny_checkpoint, corpus):
    # Its own process: accelerate fixes the precision once per process.
    process = run_adapt([str(write_recipe(tmp_path, tiny_checkpoint, corpus, budget=256, precision="bf16"))])
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 0, output
    final = tmp_path / "run" / "model"
    assert json.loads((final / "config.json").read_text())["dtype"] == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in load_file(final / "model.safetensors").values())
    assert all(np.isfinite(r["loss"]) for r in metrics(tmp_path / "run") if "loss" in r)


def test_sampled_documents_come_from_the_model_and_train_a_recipe(tmp_path, tiny_checkpoint, capsys):
    from ladder.adapt.sample import sample_documents
    from ladder.io.loading import load_model

    out = tmp_path / "samples.jsonl"
    args = ["sample", str(tiny_checkpoint), "--tokens", "100", "--length", "20", "--batch-size", "2", "--out", str(out)]
    assert ladder_main(args) == 0
    texts = [json.loads(line)["text"] for line in out.read_text().splitlines()]
    assert len(texts) == 5  # 100 tokens in documents of 20
    first = out.read_bytes()
    assert ladder_main([*args, "--force"]) == 0 and out.read_bytes() == first  # the same seed, the same file

    # The file holds what the model sampled: a first token and 20 sampled, none of them end-of-text
    # (sampled here on the command's default device: the CPU's and a GPU's random streams differ).
    model, tokenizer = load_model(tiny_checkpoint)
    model.to("cuda" if torch.cuda.is_available() else "cpu")
    documents = sample_documents(model, tokenizer, 5, 20, 2, seed=0)
    assert [tokenizer.decode(ids) for ids in documents] == texts
    assert all(len(ids) == 21 and tokenizer.eos_token_id not in ids[1:] for ids in documents)
    assert sample_documents(model, tokenizer, 5, 20, 2, seed=1) != documents

    assert ladder_main(args) == 2  # an existing file is kept
    assert "exists" in capsys.readouterr().err and out.read_bytes() == first

    data = {"data.train": [str(out)], "data.eval": [], "data.seq_len": 16}
    recipe = write_recipe(tmp_path, tiny_checkpoint, tmp_path, budget=2 * 4 * 16, **data)
    assert (train(load_recipe(recipe)) / "model.safetensors").is_file()


# --- refusals ---------------------------------------------------------------------------------------


def test_an_earlier_run_is_not_overwritten(tmp_path, tiny_checkpoint, corpus, capsys):
    recipe = write_recipe(tmp_path, tiny_checkpoint, corpus, budget=256)
    assert ladder_main(["adapt", str(recipe)]) == 0
    written = (tmp_path / "run" / "model" / "model.safetensors").read_bytes()
    assert ladder_main(["adapt", str(recipe)]) == 2
    assert "holds an earlier run: pass resume=true" in capsys.readouterr().err
    assert ladder_main(["adapt", str(recipe), "resume=true"]) == 0  # complete: nothing to do
    assert (tmp_path / "run" / "model" / "model.safetensors").read_bytes() == written


def test_resume_refuses_a_changed_recipe(tmp_path, tiny_checkpoint, corpus, capsys):
    recipe = write_recipe(tmp_path, tiny_checkpoint, corpus, budget=4 * 256, checkpoint_every=2)
    train(load_recipe(recipe))
    (tmp_path / "run" / "model").rename(tmp_path / "done")  # as if killed after the checkpoint at step 2
    assert ladder_main(["adapt", str(recipe), "resume=true", "optimizer.lr=0.1"]) == 2
    error = capsys.readouterr().err
    assert "the recipe differs" in error and "at optimizer.lr;" in error


def test_resume_refuses_changed_data_at_the_same_path(tmp_path, tiny_checkpoint, corpus, capsys):
    data = tmp_path / "data"
    data.mkdir()
    for book in (corpus / "train").iterdir():
        (data / book.name).write_bytes(book.read_bytes())
    recipe = write_recipe(
        tmp_path, tiny_checkpoint, corpus, budget=2 * 256, checkpoint_every=1, **{"data.train": [str(data)]}
    )
    train(load_recipe(recipe))
    (tmp_path / "run" / "model").rename(tmp_path / "done")  # as if killed after the checkpoint at step 1
    changed = data / "book1.txt"
    changed.write_text(prose(7, 40))  # the same recipe, the same path, other text
    kept = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file() and p != changed}
    capsys.readouterr()
    assert ladder_main(["adapt", str(recipe), "resume=true"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    checkpoint = tmp_path / "run" / "checkpoints" / "step-000001"
    assert len(lines) == 1 and lines[0].startswith(
        f"ladder adapt: error: resume: the data differ from those {checkpoint} was trained on: {changed} changed "
    ), lines  # one line, before any weight loads (no loading bar)
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file() and p != changed} == kept
    changed.write_bytes((corpus / "train" / "book1.txt").read_bytes())  # put back: the run continues
    assert ladder_main(["adapt", str(recipe), "resume=true"]) == 0


@pytest.mark.parametrize(
    "overrides, message, before_loading",
    [
        (["model.teacher=/nonexistent", "objective.name=kd"], "model path /nonexistent does not exist", True),
        (["model.ladder_layers=9"], "model.ladder_layers: ladder_layers=9", True),
        (["model.ladder_layers=null"], "model.ladder_layers: model.path is an original Llama", True),
        (["budget=100"], "less than one step", True),
        (["data.train=/nonexistent/*.txt"], "matches no file", True),
        (["logging.log_with=[mlflow]"], "logging.log_with: mlflow needs its package (pip install mlflow)", True),
        (
            ["logging.log_with=[tensorbored]"],
            "logging.log_with[0]: 'tensorbored' is not one of tensorboard, wandb",
            True,
        ),
        (["trainable.mode=lora", "trainable.lora.target_modules=[nothing]"], "trainable.lora.target_modules", False),
    ],
)
def test_bad_recipes_fail_with_one_line(tmp_path, tiny_checkpoint, corpus, capsys, overrides, message, before_loading):
    recipe = write_recipe(tmp_path, tiny_checkpoint, corpus)
    assert ladder_main(["adapt", str(recipe), *overrides]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("ladder adapt: error: ") and message in lines[-1], lines
    assert (len(lines) == 1) == before_loading, "refused before any weight loads (no loading bar)"
    assert not (tmp_path / "run").exists()


def test_cli_prints_the_resolved_recipe(tmp_path, tiny_checkpoint, corpus, capsys):
    recipe = write_recipe(tmp_path, tiny_checkpoint, corpus)
    assert ladder_main(["adapt", str(recipe), "optimizer.lr=5e-4", "--print-recipe"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["optimizer"]["lr"] == 5e-4 and printed["name"] == "recipe"
    assert ladder_main(["adapt"]) == 2
    assert "a recipe is needed" in capsys.readouterr().err
    assert ladder_main(["adapt", str(recipe), "--prepare-data"]) == 0  # tokenize only: no weights, no run
    assert "training and 8 evaluation blocks" in capsys.readouterr().out
    assert len(list((tmp_path / "cache").iterdir())) == 2 and not (tmp_path / "run").exists()


def test_flags_and_overrides_mix_in_any_order(tmp_path, tiny_checkpoint, corpus, capsys):
    recipe = write_recipe(tmp_path, tiny_checkpoint, corpus)
    assert ladder_main(["adapt", str(recipe), "--print-recipe", "optimizer.lr=5e-4", "budget=2048"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["optimizer"]["lr"] == 5e-4 and printed["budget"] == 2048
    assert ladder_main(["adapt", "--print-recipe", str(recipe), "budget=4096"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["budget"] == 4096
    assert ladder_main(["adapt", str(recipe), "budget=2048", "--print-recipes", "optimizer.lr=5e-4"]) == 2
    assert capsys.readouterr().err.splitlines() == ["ladder adapt: error: unrecognized arguments: --print-recipes"]


# --- the objectives and LoRA against independent computations --------------------------------------


def test_kd_loss_is_the_forward_kl_at_temperature_times_t_squared(tiny_checkpoint):
    # Teacher: the tiny original; student: its ladder rewiring (different logits). The reference
    # is written out from the definition, in float64: mean over positions of
    # T² · Σ_v p_T(v) (log p_T(v) - log q_T(v)), with p the teacher's and q the student's softmax at T.
    from ladder.adapt.losses import kd_loss

    teacher = AutoModelForCausalLM.from_pretrained(tiny_checkpoint).eval()
    student = ladder.to_ladder(AutoModelForCausalLM.from_pretrained(tiny_checkpoint), 2).eval()
    ids = torch.randint(0, teacher.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # A random tiny model's distributions are nearly uniform, where forward and reverse KL agree
        # to second order; sharpened logits (x100, through the LM head's weight) make the direction,
        # and T, matter. kd_loss takes final hidden states and LM head weights (it never holds all logits).
        teacher_hidden, student_hidden = teacher.model(input_ids=ids)[0], student.model(input_ids=ids)[0]
        teacher_weight, student_weight = 100 * teacher.lm_head.weight, 100 * student.lm_head.weight
        teacher_logits, student_logits = teacher_hidden @ teacher_weight.T, student_hidden @ student_weight.T
    for temperature in (1.0, 2.0):
        p = (teacher_logits.double() / temperature).log_softmax(-1)
        q = (student_logits.double() / temperature).log_softmax(-1)
        expected = temperature**2 * (p.exp() * (p - q)).sum(-1).mean()
        reverse = temperature**2 * (q.exp() * (q - p)).sum(-1).mean()
        assert expected > 0.05 and abs(reverse / expected - 1) > 1e-3  # 10x the tolerance: the directions differ
        computed = kd_loss(student_hidden, student_weight, teacher_hidden, teacher_weight, temperature)
        assert float(computed) == pytest.approx(float(expected), rel=1e-4)


def test_merged_lora_model_gives_the_logits_of_the_peft_model(tmp_path, tiny_checkpoint, corpus):
    from ladder.adapt.train import AdaptRun

    recipe = load_recipe(
        write_recipe(
            tmp_path,
            tiny_checkpoint,
            corpus,
            budget=3 * 256,
            **{"trainable.mode": "lora", "trainable.lora.target_modules": ["q_proj", "v_proj"]},
        )
    )
    run = AdaptRun(recipe)
    assert run.setup() is None
    run.train()
    device = run.accelerator.device
    ids = torch.randint(0, 49152, (2, 24), generator=torch.Generator().manual_seed(0)).to(device)
    peft_model = run.accelerator.unwrap_model(run.model).eval()
    with torch.no_grad():
        before_merge = peft_model(input_ids=ids).logits
        with peft_model.disable_adapter():
            without_adapters = peft_model(input_ids=ids).logits
    final = run.save_final()
    run.cleanup()
    merged = AutoModelForCausalLM.from_pretrained(final).to(device).eval()
    with torch.no_grad():
        after_merge = merged(input_ids=ids).logits
    assert (before_merge - without_adapters).abs().max() > 1e-3  # the adapters learned something
    torch.testing.assert_close(after_merge, before_merge, atol=1e-4, rtol=0)


# --- Chunked losses: equal to the full-logits computation ----------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("kd_weight", [0.0, 0.3, 1.0])
def test_chunked_losses_equal_the_full_logits_computation(kd_weight, temperature):
    from ladder.adapt.losses import head_losses, kd_loss, lm_loss, next_token_labels

    generator = torch.Generator().manual_seed(0)
    batch, seq, width, vocab = 2, 37, 16, 50
    hidden = torch.randn(batch, seq, width, generator=generator, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, width, generator=generator, dtype=torch.float64, requires_grad=True)
    teacher_hidden = torch.randn(batch, seq, width, generator=generator, dtype=torch.float64)
    teacher_weight = torch.randn(vocab, width, generator=generator, dtype=torch.float64)
    labels = next_token_labels(torch.randint(0, vocab, (batch, seq), generator=generator))
    labels[0, 5:12] = -100  # masked positions (chat masking) count for nothing

    logits = hidden @ weight.T
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    student = (logits / temperature).log_softmax(-1).flatten(0, 1)
    teacher = ((teacher_hidden @ teacher_weight.T) / temperature).log_softmax(-1).flatten(0, 1)
    kd = torch.nn.functional.kl_div(student, teacher, log_target=True, reduction="batchmean") * temperature**2
    expected = (1 - kd_weight) * ce + kd_weight * kd
    expected_grads = torch.autograd.grad(expected, (hidden, weight))

    loss, next_token = head_losses(
        hidden, weight, labels, teacher_hidden, teacher_weight, kd_weight, temperature, chunk_tokens=10
    )  # 74 positions: 8 chunks, the last one short
    grads = torch.autograd.grad(loss, (hidden, weight))
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(next_token, ce, rtol=1e-10, atol=1e-12)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(lm_loss(hidden, weight, labels, chunk_tokens=7), ce, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(
        kd_loss(hidden, weight, teacher_hidden, teacher_weight, temperature, chunk_tokens=7), kd, rtol=1e-10, atol=1e-12
    )


def test_losses_in_lm_head_computes_no_logits_and_trains_like_the_plain_loss(tiny_checkpoint):
    from ladder.adapt.losses import head_losses, losses_in_lm_head, next_token_labels

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint).train()
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    labels = next_token_labels(ids)
    plain = torch.nn.functional.cross_entropy(model(input_ids=ids).logits.flatten(0, 1), labels.flatten())
    plain_grads = torch.autograd.grad(plain, list(model.parameters()))
    with losses_in_lm_head(model, lambda hidden, weight: head_losses(hidden, weight, labels, chunk_tokens=16)) as out:
        logits = model(input_ids=ids).logits
    assert logits.shape == (2, 0, model.config.vocab_size)
    loss, _ = out[0]
    grads = torch.autograd.grad(loss, list(model.parameters()))
    torch.testing.assert_close(loss, plain, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, plain_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert model(input_ids=ids).logits.shape == (2, 24, model.config.vocab_size)  # the hook is gone


def test_held_out_losses_come_chunk_by_chunk_and_equal_the_full_logits(tiny_checkpoint):
    """`block_loss_sums` (adapt's held-out evaluation) computes its logits a chunk of positions at a
    time inside the head, with the sums of the plain cross-entropy over full logits; chunks hold
    16 MiB of float32 logits on the CPU."""
    from ladder.adapt import losses
    from ladder.adapt.losses import IGNORE_INDEX, block_loss_sums, chunk_positions, next_token_labels, token_losses

    assert chunk_positions(49_152) == 85 and chunk_positions(2**40) == 1
    # On an accelerator a chunk spans at least 1,024 positions of a 128k vocabulary: the head weight is
    # read a few times per micro-step, not 63 (issue 29).
    assert chunk_positions(128_256, "cuda") == chunk_positions(128_256, "meta") == 1046
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint).eval()
    ids = torch.randint(0, model.config.vocab_size, (3, 40), generator=torch.Generator().manual_seed(2))
    labels = next_token_labels(ids)
    labels[1, :25] = IGNORE_INDEX
    with torch.no_grad():
        plain = torch.nn.functional.cross_entropy(
            model(input_ids=ids).logits.flatten(0, 1), labels.flatten(), reduction="none"
        ).view(3, 40)
    chunk_sizes = []
    original = token_losses

    def recording(hidden, weight, labels, chunk_tokens=None):
        chunk_sizes.append(chunk_positions(weight.shape[0], weight.device))
        return original(hidden, weight, labels, chunk_tokens=7)  # 120 positions: 18 chunks, the last short

    losses.token_losses = recording
    try:
        sums, counts = block_loss_sums(model, ids, labels)
    finally:
        losses.token_losses = original
    assert chunk_sizes == [chunk_positions(model.config.vocab_size)]
    torch.testing.assert_close(sums, plain.sum(dim=1), rtol=1e-5, atol=1e-5)
    assert counts.tolist() == [39, 14, 39]


# --- Training in less memory: the same forward and gradients ---------------------------------------


def saved_bytes(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(logits, bytes of the distinct tensors autograd keeps for backward) of one forward."""
    storages = {}

    def pack(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logits = model(input_ids=ids).logits
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return logits, sum(size for pointer, size in storages.items() if pointer not in parameters)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_fewer_saved_activations_give_the_same_forward_and_gradients(autocast):
    from peft import LoraConfig, get_peft_model

    from ladder.adapt.memory import CheckpointedLlamaRMSNorm, LeanLlamaMLP, keep_fewer_activations

    plain = ladder.to_ladder(tiny_llama(), [2, 3]).train()
    lean = ladder.to_ladder(tiny_llama(), [2, 3]).train()
    for model in (plain, lean):
        model.model.layers[:2].requires_grad_(False)  # as `trainable: ladder` leaves them
    config = lean.config
    assert keep_fewer_activations(lean) == config.num_hidden_layers * 3 + 1  # MLPs, two norms each, the final norm
    assert type(lean.model.layers[3].mlp) is LeanLlamaMLP
    assert type(lean.model.norm) is CheckpointedLlamaRMSNorm
    ids = random_ids(batch=2, length=24, vocab_size=config.vocab_size)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        (plain_logits, plain_saved), (lean_logits, lean_saved) = saved_bytes(plain, ids), saved_bytes(lean, ids)
    assert torch.equal(lean_logits, plain_logits)
    # Per trained layer: silu(gate) and the product (tokens x intermediate, in the projections' dtype),
    # and each norm's normalized input (float32: Llama's norm computes in float32).
    projected = 2 if autocast else 4
    tokens = ids.numel()
    spared = 2 * (2 * tokens * config.intermediate_size * projected + 2 * tokens * config.hidden_size * 4)
    assert lean_saved <= plain_saved - spared
    plain_logits.float().square().mean().backward()
    lean_logits.float().square().mean().backward()
    for (name, want), got in zip(plain.named_parameters(), lean.parameters()):
        assert (got.grad is None) == (want.grad is None), name
        if want.grad is not None:
            assert got.grad.dtype == want.grad.dtype
            torch.testing.assert_close(got.grad, want.grad, rtol=1e-6, atol=1e-9, msg=name)

    # LoRA wraps the projections: that MLP keeps its own forward (the norms still change).
    wrapped = get_peft_model(ladder.to_ladder(tiny_llama(), [2, 3]), LoraConfig(r=2, target_modules=["gate_proj"]))
    assert keep_fewer_activations(wrapped) == config.num_hidden_layers * 2 + 1
    assert type(wrapped.base_model.model.model.layers[3].mlp) is not LeanLlamaMLP


def test_allocated_optimizer_state_trains_like_the_lazily_allocated_one():
    from ladder.adapt.memory import allocate_optimizer_state

    generator = torch.Generator().manual_seed(0)
    start = [torch.randn(5, 3, generator=generator), torch.randn(3, generator=generator)]
    gradients = [[torch.randn_like(p) for p in start] for _ in range(3)]
    results = []
    for allocate in (False, True):
        parameters = [p.clone().requires_grad_() for p in start]
        optimizer = torch.optim.AdamW(
            [{"params": parameters[:1], "weight_decay": 0.1}, {"params": parameters[1:], "weight_decay": 0.0}],
            lr=0.1,
            fused=True,
        )
        if allocate:
            allocate_optimizer_state(optimizer)
            assert all(torch.count_nonzero(optimizer.state[p]["exp_avg_sq"]) == 0 for p in parameters)
        for step in gradients:
            for parameter, gradient in zip(parameters, step):
                parameter.grad = gradient.clone()
            optimizer.step()
        results.append((parameters, optimizer.state_dict()["state"]))
    (lazy, lazy_state), (allocated, allocated_state) = results
    for want, got in zip(lazy, allocated):
        assert torch.equal(got, want)
    for index, want in lazy_state.items():
        for key, value in want.items():
            assert torch.equal(allocated_state[index][key], value), key
