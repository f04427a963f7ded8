"""`ladder eval`'s bad input: each one line, before any model loads."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from eval_runs import ladder_eval, write_suite

from ladder.errors import UsageError
from ladder.eval import cli
from ladder.eval.lm_tasks import hub_offline

# --- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--suite", "nightly"], "unknown suite 'nightly'"),
        (["--limit", "0"], "not a positive integer"),
        (["--limit", "ten"], "not a positive integer"),
        (["--limit", "1.5"], "'1.5' is not a positive integer or a fraction between 0 and 1"),
        (["--suite", "smoke", "--tasks", "ladder_piqa"], "argument --tasks: not allowed with argument --suite"),
        (["--tasks", "ladder_piqa,,piqa"], "expected task names separated by commas"),
        (["--data", "/nonexistent/data"], "data folder /nonexistent/data does not exist"),
        (["--device", "tpu"], "--device 'tpu': choose auto, cpu, cuda or cuda:N"),
        (["--dtype", "int8"], "argument --dtype: invalid choice"),
        (["--batch-size", "big"], "not a positive integer"),
        (["--gen-kwargs", "max_gen_toks"], "expected key=value"),
        (["--gen-kwargs", "until=["], r"'until=\[' does not parse as YAML"),
        (["--gen-kwargs", "until=a: b"], "a value is a number, a string"),
        (["--fewshot-as-multiturn"], "fewshot_as_multiturn needs apply_chat_template"),
        (["--data-parallel", "2"], "--data-parallel is for --backend vllm"),
    ],
)
def test_bad_arguments_are_usage_errors(tiny_checkpoint, arguments, message):
    with pytest.raises(UsageError, match=message):
        cli.main([str(tiny_checkpoint), *arguments])


def test_model_that_is_neither_checkpoint_nor_gguf(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(UsageError, match="not a .gguf file"):
        cli.main([str(tmp_path / "weights.bin")])
    with pytest.raises(UsageError, match="has no config.json"):
        cli.main([str(tmp_path)])


def test_unknown_task_fails_before_any_model_loads(tiny_checkpoint, tmp_path):
    suite = write_suite(tmp_path / "typo.yaml", [{"task": "ladder_piqa"}, {"task": "ladder_hellaswg"}])
    with pytest.raises(UsageError, match="unknown task.*ladder_hellaswg"):
        cli.main([str(tiny_checkpoint), "--suite", str(suite), "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_missing_data_file_is_one_line_on_the_command_line(tiny_checkpoint, tmp_path, capsys):
    from ladder.cli import main as ladder_main

    empty = tmp_path / "data"
    empty.mkdir()
    status = ladder_main(["eval", str(tiny_checkpoint), "--data", str(empty), "--out", str(tmp_path / "out")])
    error = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(error) == 1
    assert error[0].startswith("ladder eval: error: data file ") and "is missing" in error[0]


def test_gen_kwargs_that_do_not_parse_are_one_line(capsys):
    from ladder.cli import main as ladder_main

    assert ladder_main(["eval", "embedded", "--gen-kwargs", "max_gen_toks=5,until=[", "--out", "unused"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "ladder eval: error: argument --gen-kwargs: 'until=[' does not parse as YAML: "
        "expected the node content, but found '<stream end>'"
    ]


def test_hub_switches_are_restored(tmp_path):
    import datasets.config
    import huggingface_hub.constants

    before = (os.environ.get("HF_DATASETS_CACHE"), datasets.config.HF_DATASETS_CACHE)
    with hub_offline(tmp_path):
        assert huggingface_hub.constants.HF_HUB_OFFLINE and datasets.config.HF_DATASETS_OFFLINE
        assert datasets.config.HF_DATASETS_CACHE == tmp_path == Path(os.environ["HF_DATASETS_CACHE"])
    assert (os.environ.get("HF_DATASETS_CACHE"), datasets.config.HF_DATASETS_CACHE) == before


def test_lm_eval_spellings_are_accepted_or_answered_in_one_line(tiny_checkpoint, capsys):
    args = cli.build_parser().parse_args(
        [str(tiny_checkpoint), "--output_path", "x", "--batch_size", "4", "--num_fewshot", "2"]
    )
    assert (args.out, args.batch_size, args.num_fewshot) == (Path("x"), 4, 2)
    assert cli.build_parser().parse_args([str(tiny_checkpoint), "--num-fewshot", "0"]).num_fewshot == 0
    assert ladder_eval(str(tiny_checkpoint), "--model_args", "pretrained=x,dtype=float32") == 2
    assert ladder_eval(str(tiny_checkpoint), "--num-fewshot", "-1") == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 2 and "--model_args: name the model as MODEL" in error[0], error
    assert "argument --num-fewshot/--num_fewshot: '-1' is not a non-negative integer" in error[1]


def test_an_unknown_task_is_called_a_task(tiny_checkpoint, tmp_path, capsys):
    assert ladder_eval(str(tiny_checkpoint), "--tasks", "ladder_nope", "--out", str(tmp_path / "out")) == 2
    (error,) = capsys.readouterr().err.strip().splitlines()
    assert error.startswith("ladder eval: error: unknown task(s) ladder_nope; ours are ladder_")


def test_too_many_processes_is_one_line_before_lm_evals_warnings(tiny_checkpoint, tmp_path, monkeypatch, capfd):
    """lm-eval's task warnings and datasets' bars (HellaSwag's Map over its documents) are quiet
    while the launcher checks the tasks: the error is the only line, whatever an earlier command
    in this process set."""
    import datasets

    monkeypatch.setattr(logging.getLogger("lm_eval"), "level", logging.WARNING)
    datasets.enable_progress_bars()
    tasks = ["--tasks", "ladder_wikitext,ladder_hellaswag", "--limit", "4"]
    assert ladder_eval(str(tiny_checkpoint), *tasks, "--processes", "8", "--out", str(tmp_path / "out")) == 2
    assert capfd.readouterr().err.strip().splitlines() == [
        "ladder eval: error: --processes 8: ladder_wikitext scores 4 item(s), fewer than one per process; "
        "use at most 4 process(es) or more items (--limit, the suite's limit)"
    ]
