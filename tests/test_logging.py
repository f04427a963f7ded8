"""What commands say: every `ladder` command takes -q and -v (ladder/log.py), -q leaves only
warnings, and library warnings known to be harmless are muted at their source, by name."""

from __future__ import annotations

import logging

import pytest
import torch
from accelerate import PartialState
from accelerate.utils import clean_state_dict_for_safetensors

from ladder.cli import STAGES
from ladder.cli import main as ladder_main
from ladder.convert.cli import build_parser as build_convert_parser
from ladder.log import configure


@pytest.mark.parametrize("command", list(STAGES))
def test_every_command_takes_quiet_and_verbose(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        ladder_main([command, "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert "-q, --quiet" in text and "-v, --verbose" in text, text


def test_quiet_leaves_only_warnings_and_verbose_shows_the_libraries(tmp_path, tiny_checkpoint, capsys):
    assert ladder_main(["convert", str(tiny_checkpoint), "--out", str(tmp_path / "said"), "--no-verify"]) == 0
    said = capsys.readouterr()
    assert said.out.startswith("converted ") and "ladder layers" in said.out, said  # the summary

    assert ladder_main(["convert", str(tiny_checkpoint), "--out", str(tmp_path / "quiet"), "--no-verify", "-q"]) == 0
    quiet = capsys.readouterr()
    assert quiet.out == "" and quiet.err == "", quiet
    assert (tmp_path / "quiet" / "config.json").is_file()

    build_convert_parser().parse_args(["-v"])  # parsing sets the levels
    assert logging.getLogger("transformers").getEffectiveLevel() == logging.INFO
    configure(0)
    assert logging.getLogger("transformers").getEffectiveLevel() == logging.WARNING


def test_accelerates_tied_weight_warning_is_muted_and_its_other_warnings_are_not(caplog):
    PartialState(cpu=True)  # accelerate's logger speaks only once its state exists
    configure(0)
    embedding = torch.zeros(4, 2)
    with caplog.at_level(logging.WARNING):
        cleaned = clean_state_dict_for_safetensors(
            {"model.embed_tokens.weight": embedding, "lm_head.weight": embedding}
        )
        logging.getLogger("accelerate.utils.other").warning("another warning")
    assert list(cleaned) == ["model.embed_tokens.weight"]
    assert [record.getMessage() for record in caplog.records] == ["another warning"]
