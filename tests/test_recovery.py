"""Recovering per token: the `auto:N` layer search (ladder/layer_search.py, convert and adapt) and
the hidden-state objective with the teacher started from the student's streams (adapt/distill.py).

The search's shortcut (candidates started from the original's stored streams) is checked against
full forwards of each rewired model; the shared-prefix teacher against the teacher run alone.
"""

from __future__ import annotations

import copy
import itertools
import json

import pytest
import torch
import torch.nn.functional as F

import ladder
from adapt_runs import metrics, prose, write_recipe
from ladder.adapt.distill import Distiller
from ladder.adapt.layer_choice import LAYER_SEARCH_FILE
from ladder.adapt.losses import hidden_loss
from ladder.adapt.recipe import load_recipe
from ladder.adapt.train import train
from ladder.cli import main as ladder_main
from ladder.errors import UsageError
from ladder.layer_search import calibration_from_files, choose_ladder_layers, forward_from, layer_inputs
from ladder.layers import (
    AutoLayers,
    overlapped_all_reduces,
    parse_auto_layers,
    parse_ladder_layers,
    parse_layer_choice,
    resolve_layer_choice,
)
from tiny import random_ids, tiny_llama


def test_auto_specs_parse_and_plain_parsing_refuses_them():
    assert parse_auto_layers("auto:3", 6) == AutoLayers(3, contiguous=True)
    assert parse_auto_layers(" auto:6:any ", 6) == AutoLayers(6, contiguous=False)
    assert parse_auto_layers("8", 30) is None and parse_auto_layers(8, 30) is None
    for bad, message in [
        ("auto:0", "1 <= N <= 6"),
        ("auto:7", "1 <= N <= 6"),
        ("auto", "is not auto:N"),
        ("auto:3:all", "is not auto:N"),
    ]:
        with pytest.raises(UsageError, match=message):
            parse_auto_layers(bad, 6, "--layers")
    with pytest.raises(UsageError, match="trainable.layers: 'auto:2' chooses layers by measuring a model"):
        parse_ladder_layers("auto:2", 6, "trainable.layers")
    assert str(AutoLayers(4)) == "auto:4" and str(AutoLayers(4, False)) == "auto:4:any"


def test_a_layer_choice_is_parsed_once_and_only_auto_runs_the_search():
    searched = []

    def search(auto: AutoLayers) -> list[int]:
        searched.append(auto)
        return [1, 2]

    assert parse_layer_choice(None, 6) == [3, 4, 5]  # the upper half
    assert resolve_layer_choice(parse_layer_choice("0-1,4", 6), search) == [0, 1, 4] and not searched
    choice = parse_layer_choice("auto:2:any", 6)
    assert parse_layer_choice(choice, 6) == choice == AutoLayers(2, contiguous=False)
    assert resolve_layer_choice(choice, search) == [1, 2] and searched == [choice]
    with pytest.raises(UsageError, match="1 <= N <= 3"):
        parse_layer_choice(AutoLayers(4), 3, "--layers")


@pytest.mark.parametrize("layers, overlapped", [([], 0), ([5], 1), ([2, 3, 4], 5), ([0, 1, 4], 4), ([1, 3, 5], 3)])
def test_overlap_count(layers, overlapped):
    assert overlapped_all_reduces(layers) == overlapped


def _kl_and_loss(original, rewired, ids):
    """Full forwards, no shortcut: mean KL(original || rewired) and the rewired model's loss increase."""
    with torch.no_grad():
        log_p = F.log_softmax(original(ids).logits[:, :-1].float(), -1).flatten(0, 1)
        log_q = F.log_softmax(rewired(ids).logits[:, :-1].float(), -1).flatten(0, 1)
    labels = ids[:, 1:].flatten()
    kl = F.kl_div(log_q, log_p, log_target=True, reduction="batchmean").item()
    return kl, F.nll_loss(log_q, labels).item() - F.nll_loss(log_p, labels).item()


def test_a_candidate_started_from_stored_streams_equals_its_full_forward():
    model, ids = tiny_llama(), random_ids(batch=2, length=16)
    original = ladder.to_ladder(model, [])
    embeds, kwargs = layer_inputs(original, ids)
    streams = [(embeds, embeds)]
    with torch.no_grad():
        for layer in original.model.layers:
            streams.append(layer(*streams[-1], **kwargs))
        for layers in ([2, 3, 4], [0, 1], [3, 5]):
            rewired = ladder.to_ladder(model, layers)
            start = min(layers)
            torch.testing.assert_close(
                forward_from(rewired, streams[start], start, kwargs), rewired(ids).logits, rtol=0, atol=1e-5
            )


def test_contiguous_search_measures_every_window_and_keeps_the_least_damaged():
    model, calibration = tiny_llama(seed=3), random_ids(batch=3, length=20, seed=5)
    search = choose_ladder_layers(model, calibration, AutoLayers(3), batch=2)
    assert [c.layers for c in search.candidates] == [[0, 1, 2], [1, 2, 3], [2, 3, 4], [3, 4, 5]]
    for candidate in search.candidates:
        kl, loss_increase = _kl_and_loss(model, ladder.to_ladder(model, candidate.layers), calibration)
        assert candidate.kl == pytest.approx(kl, rel=1e-4) and candidate.loss_increase == pytest.approx(
            loss_increase, abs=1e-4
        )
    best = min(search.candidates, key=lambda c: c.kl)
    assert search.chosen == best.layers and search.chosen_kl == best.kl
    assert search.overlapped_all_reduces == 5 and search.calibration_tokens == 3 * 19
    # In full forwards: the original (6 layers) plus 6 - start layers per candidate, over 6 layers.
    assert search.forward_passes == pytest.approx((6 + 6 + 5 + 4 + 3) / 6, abs=0.01)
    assert choose_ladder_layers(model, calibration, AutoLayers(3), batch=2).chosen == search.chosen  # deterministic
    assert not model.training and search.seconds >= 0


def test_any_set_search_ranks_single_layers_and_measures_the_set():
    model, calibration = tiny_llama(seed=4), random_ids(batch=2, length=20, seed=6)
    search = choose_ladder_layers(model, calibration, AutoLayers(3, contiguous=False))
    singles, chosen_set = search.candidates[:6], search.candidates[6]
    assert [c.layers for c in singles] == [[i] for i in range(6)]
    assert search.chosen == sorted(c.layers[0] for c in sorted(singles, key=lambda c: c.kl)[:3]) == chosen_set.layers
    kl, _ = _kl_and_loss(model, ladder.to_ladder(model, search.chosen), calibration)
    assert search.chosen_kl == pytest.approx(kl, rel=1e-4)
    assert search.overlapped_all_reduces == overlapped_all_reduces(search.chosen)


def test_calibration_comes_from_the_middle_of_each_file(tmp_path, smollm2_tokenizer_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    (tmp_path / "a.txt").write_text("HEADER " * 500 + prose(1, 60))
    (tmp_path / "b.txt").write_text(prose(2, 60))
    blocks = calibration_from_files(tokenizer, [tmp_path], blocks=3, seq_len=32)
    assert blocks.shape == (3, 32)
    assert "HEADER" not in tokenizer.decode(blocks[0])
    assert not torch.equal(blocks[0], blocks[2])  # a file used twice gives another window
    (tmp_path / "short.txt").write_text("too short")
    with pytest.raises(UsageError, match="short.txt is too short"):
        calibration_from_files(tokenizer, [tmp_path / "short.txt"], blocks=1, seq_len=32)


def test_convert_auto_records_the_search_in_conversion_json(tmp_path, tiny_checkpoint, capsys):
    calibration = tmp_path / "calibration.txt"
    calibration.write_text(prose(7, 400))
    out = tmp_path / "out"
    assert (
        ladder_main(
            [
                "convert",
                str(tiny_checkpoint),
                "--layers",
                "auto:2",
                "--calibration",
                str(calibration),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    manifest = json.loads((out / "conversion.json").read_text())
    search = manifest["layer_search"]
    assert (
        manifest["ladder_layers"] == search["chosen"] == json.loads((out / "config.json").read_text())["ladder_layers"]
    )
    assert [c["layers"] for c in search["candidates"]] == [[0, 1], [1, 2], [2, 3]]
    assert search["chosen"] == min(search["candidates"], key=lambda c: c["kl"])["layers"]
    assert "layer search   auto:2 chose layers" in printed


def test_convert_refuses_calibration_without_auto(tmp_path, tiny_checkpoint, capsys):
    code = ladder_main(
        [
            "convert",
            str(tiny_checkpoint),
            "--layers",
            "2",
            "--calibration",
            str(tmp_path),
            "--out",
            str(tmp_path / "out"),
        ]
    )
    assert code == 2 and "--calibration goes with --layers auto:N" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_hidden_loss_is_relative_per_position():
    student, teacher = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    assert hidden_loss([teacher], [teacher]) == 0
    loss = hidden_loss([student], [teacher])
    expected = ((student - teacher).pow(2).sum(-1) / teacher.pow(2).sum(-1)).mean()
    torch.testing.assert_close(loss, expected)
    # Scaling one position of both streams, or one layer's streams, leaves the loss unchanged.
    scale = torch.ones(2, 5, 1)
    scale[0, 0] = 100.0
    torch.testing.assert_close(hidden_loss([student * scale], [teacher * scale]), loss)
    torch.testing.assert_close(hidden_loss([student, 30 * student], [teacher, 30 * teacher]), loss)


def test_the_teacher_started_from_the_student_streams_computes_what_it_computes_alone():
    original = tiny_llama(seed=2)
    teacher = ladder.to_ladder(copy.deepcopy(original), []).requires_grad_(False)
    student = ladder.to_ladder(original, [3, 4, 5])
    ids = random_ids(batch=2, length=16)
    outputs = {}
    for shared in (True, False):
        distiller = Distiller(teacher, student.model.layers, [3, 4, 5], shared_prefix=shared)
        with distiller.capture() as captured:
            student(ids)
        assert sorted(captured.streams) == [3, 4, 5] and (captured.prefix is not None) == shared
        outputs[shared] = distiller.teacher_forward(ids, captured, final=True)
    with torch.no_grad():
        alone = teacher(ids, output_hidden_states=True)
    # The final normed hidden states, through the teacher's LM head, are its logits.
    for shared in (True, False):
        torch.testing.assert_close(teacher.lm_head(outputs[shared].final_hidden), alone.logits, rtol=0, atol=1e-5)
    for got_shared, got_alone in zip(outputs[True].streams, outputs[False].streams, strict=True):
        torch.testing.assert_close(got_shared, got_alone, rtol=0, atol=1e-5)
    # hidden_states[i + 1] is the stream after layer i (the last entry is final-normed: not compared).
    for got, layer in zip(outputs[True].streams[:2], [3, 4], strict=True):
        torch.testing.assert_close(got, alone.hidden_states[layer + 1], rtol=0, atol=1e-5)
    # No hooks are left behind: a forward outside `capture` records nothing.
    assert not any(layer._forward_hooks or layer._forward_pre_hooks for layer in student.model.layers)


def test_adapt_auto_layers_with_the_hidden_objective(tmp_path, tiny_checkpoint, corpus):
    recipe = write_recipe(
        tmp_path,
        tiny_checkpoint,
        corpus,
        budget=3 * 256,
        **{"model.ladder_layers": "auto:2", "trainable.mode": "ladder", "objective.name": "hidden"},
    )
    final = train(load_recipe(recipe))
    search = json.loads((tmp_path / "run" / LAYER_SEARCH_FILE).read_text())
    assert search["spec"] == "auto:2" and len(search["candidates"]) == 3
    assert json.loads((final / "config.json").read_text())["ladder_layers"] == search["chosen"]
    assert json.loads((final / LAYER_SEARCH_FILE).read_text()) == search
    steps = [r for r in metrics(tmp_path / "run") if "loss" in r]
    # The rewired student's streams differ from the teacher's: a positive hidden loss (that it trains
    # the student is checked with plain gradient descent below).
    assert len(steps) == 3 and all(0 < r["loss"] < 1 and r["lm_loss"] > 1 for r in steps)


def test_gradient_descent_on_the_hidden_loss_brings_the_streams_closer():
    original = tiny_llama(seed=2)
    teacher = ladder.to_ladder(copy.deepcopy(original), []).requires_grad_(False)
    student = ladder.to_ladder(original, [2, 3, 4, 5]).train().requires_grad_(False)
    trained = [p for index in [2, 3, 4, 5] for p in student.model.layers[index].parameters()]
    for parameter in trained:
        parameter.requires_grad_(True)
    distiller = Distiller(teacher, student.model.layers, [2, 3, 4, 5], shared_prefix=True)
    optimizer = torch.optim.SGD(trained, lr=0.01)
    ids, history = random_ids(batch=4, length=32), []
    for _ in range(5):
        with distiller.capture() as captured:
            student(ids)
        loss = hidden_loss(
            [captured.streams[i] for i in [2, 3, 4, 5]], distiller.teacher_forward(ids, captured, False).streams
        )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        history.append(loss.item())
    assert all(later < earlier for earlier, later in itertools.pairwise(history)) and history[-1] < 0.75 * history[0]
    assert all(p.grad is None for p in teacher.parameters())


def test_lm_plus_hidden_starts_above_lm_and_kd_needs_no_ladder_layer(tmp_path, tiny_checkpoint, corpus):
    plain = write_recipe(tmp_path / "lm", tiny_checkpoint, corpus, budget=256, **{"trainable.mode": "ladder"})
    mixed = write_recipe(
        tmp_path / "mix",
        tiny_checkpoint,
        corpus,
        budget=256,
        **{"trainable.mode": "ladder", "objective.hidden_weight": 2.0},
    )
    train(load_recipe(plain))
    train(load_recipe(mixed))
    lm_step, mixed_step = metrics(tmp_path / "lm" / "run")[1], metrics(tmp_path / "mix" / "run")[1]
    assert mixed_step["lm_loss"] == pytest.approx(lm_step["lm_loss"], rel=1e-6)  # the same forward
    assert mixed_step["loss"] > lm_step["loss"] + 1e-4
    with pytest.raises(UsageError, match="objective.name=hidden is that term alone"):
        load_recipe(
            write_recipe(
                tmp_path / "bad",
                tiny_checkpoint,
                corpus,
                **{"objective.name": "hidden", "objective.hidden_weight": 1.0},
            )
        )
    with pytest.raises(UsageError, match="no ladder layer whose stream"):
        train(
            load_recipe(
                write_recipe(
                    tmp_path / "none",
                    tiny_checkpoint,
                    corpus,
                    budget=256,
                    **{"model.ladder_layers": 0, "objective.name": "hidden"},
                )
            )
        )
