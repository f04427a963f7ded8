"""adapt/: the training loop, exact resume after SIGKILL, two processes against one, divergence, the
final checkpoint, trainable modes and objectives end to end, refusals and CLI errors. The data it
reads is tested in test_data.py, the objectives against their definitions in test_adapt_objectives.py.

Runs the real loop on the tiny 4-layer checkpoint (SmolLM2's tokenizer) with generated prose.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import ladder
from adapt_runs import losses, metrics, prose, run_adapt, write_recipe
from ladder.adapt.cli import main as adapt_main
from ladder.adapt.data import prepare_data
from ladder.adapt.recipe import load_recipe
from ladder.adapt.train import train
from ladder.cli import main as ladder_main
from ladder.launch import multi_process_launcher
from tiny import two_processes


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
    assert load_recipe(final / "recipe.yaml").model_dump() == recipe.model_dump()
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
        (["model.ladder_layers=null"], "model.ladder_layers: model.path is not a ladder model yet", True),
        (["budget=100"], "less than one step", True),
        (["data.train=/nonexistent/*.txt"], "matches no file", True),
        (["logging.log_with=[mlflow]"], "logging.log_with: mlflow needs its package (pip install mlflow)", True),
        (
            ["logging.log_with=[tensorbored]"],
            "logging.log_with[0] = 'tensorbored': input should be 'tensorboard', 'wandb'",
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
