"""Training data (adapt/data.py, sources.py, tokenize.py): the masks and document boundaries against a
per-token reference; packing and its cache, text, JSON lines, chat records and Hub sources, isolated
documents, held-out blocks, and the order each step reads blocks in. The parallel prepare (kills,
streams, samples, mixtures) is tested in test_data_prepare.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

import ladder
from adapt_runs import chats, metrics, prose, write_recipe
from ladder.adapt import sources as sources_module
from ladder.adapt.cli import main as adapt_main
from ladder.adapt.data import BlockOrder, document_positions, load_blocks, prepare_data
from ladder.adapt.losses import head_losses, next_token_labels
from ladder.adapt.recipe import DataSpec, SourceSpec
from ladder.errors import UsageError
from tiny import random_ids, tiny_llama

REPO = Path(__file__).resolve().parents[1]
# Llama 3's way: each content trimmed, nothing after the end-of-turn marker.
TRIMMING_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n\n' + "
    "message['content'] | trim + '<|im_end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n\n' }}{% endif %}"
)
# A template that changes content: one rendering cannot locate the turns, so each prefix is rendered.
UPPERCASE_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] | upper + "
    "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def reference_document(tokenizer, record: dict | str) -> tuple[list[int], list[int]]:
    """The per-token computation: render the chat, find each assistant turn by rendering its prefixes,
    and mark each token whose characters lie inside a turn; then the EOS, a target where the last token is."""
    if isinstance(record, str):
        ids = tokenizer(record, add_special_tokens=False)["input_ids"]
        return ids + [tokenizer.eos_token_id], [1] * (len(ids) + 1)
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    messages = [
        {"role": m["role"], "content": m["content"]}
        if "role" in m
        else {"role": roles[m["from"]], "content": m["value"]}
        for m in record["messages"]
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for k, message in enumerate(messages):
        if message["role"] == "assistant":
            header = (
                tokenizer.apply_chat_template(messages[:k], tokenize=False, add_generation_prompt=True) if k else ""
            )
            spans.append((len(header), len(tokenizer.apply_chat_template(messages[: k + 1], tokenize=False))))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    targets = [int(any(b <= s and e <= f for b, f in spans)) for s, e in encoded["offset_mapping"]]
    return encoded["input_ids"] + [tokenizer.eos_token_id], targets + [targets[-1] if targets else 1]


@pytest.mark.parametrize("template", ["smollm2", "trimming", "uppercase"])
def test_masks_and_boundaries_equal_the_per_token_reference(tmp_path, smollm2_tokenizer_dir, monkeypatch, template):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    tokenizer.chat_template = {"smollm2": tokenizer.chat_template, "trimming": TRIMMING_TEMPLATE}.get(
        template, UPPERCASE_TEMPLATE
    )
    monkeypatch.setattr(sources_module, "CHUNK_CHARS", 2000)  # many chunks, over two worker processes
    records = chats(40)
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    plain = [prose(i, 1) for i in range(30)]
    (tmp_path / "plain.txt").write_text("\n\n".join(plain))
    sources = [
        SourceSpec(path=str(tmp_path / "chats.jsonl")),
        SourceSpec(path=str(tmp_path / "plain.txt"), documents="blank_line"),
    ]
    blocks = load_blocks(sources, tokenizer, 8, tmp_path / "cache", "train")

    ids, targets, starts = [], [], []
    for document in records + plain:
        document_ids, document_targets = reference_document(tokenizer, document)
        ids += document_ids
        targets += document_targets
        starts += [1] + [0] * (len(document_ids) - 1)
    whole = len(ids) // 8 * 8
    assert blocks.ids.ravel().tolist() == ids[:whole]
    assert blocks.targets.ravel().tolist() == targets[:whole]
    assert blocks.starts.ravel().tolist() == starts[:whole]
    assert 0.2 < blocks.masked_share() < 0.8


# --- packing, sources, and the order each step reads blocks in -----------------------------------


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
    # head_losses takes final hidden states and the LM head's weight: an identity head makes them the logits.
    assert float(head_losses(logits, torch.eye(50), labels)[0]) == pytest.approx(float(direct), rel=1e-6)

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


def test_the_tokenized_data_cache_is_the_shared_cache_root_unless_the_recipe_names_one(tmp_path, monkeypatch):
    # One cache root for runs from any folder, as HF_HOME: $LADDER_CACHE, else the user's cache folder.
    monkeypatch.setenv("LADDER_CACHE", str(tmp_path / "root"))
    monkeypatch.chdir(tmp_path)
    assert DataSpec().cache_folder() == tmp_path / "root" / "adapt"
    assert DataSpec(cache_dir="here/cache").cache_folder() == Path("here/cache")
    monkeypatch.delenv("LADDER_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert DataSpec().cache_folder() == tmp_path / "xdg" / "ladder" / "adapt"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert DataSpec().cache_folder() == Path.home() / ".cache" / "ladder" / "adapt"
