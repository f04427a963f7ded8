"""Chat templates bounded by the operating system (issue 43 item 3): every way past the old
hand-counted budget (center, indent, format's padding, `~` doubling, fan-out macro recursion,
nested loops with no calls) ends in one line naming the model and the limit, through `ladder eval
--apply-chat-template` (before any model loads, and inside lm-eval's rendering of real prompts)
and `ladder adapt --prepare-data`. The limits are small here (512 MB, 2 s); each render batch
has one worker process."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from adapt_runs import chat_corpus, write_recipe
from ladder import chat_template
from ladder.chat_template import PROBE_CHAT, TemplateLimitExceeded, TemplateWorker
from ladder.cli import main as ladder_main

MEMORY, SECONDS = 512 << 20, 2.0

BYPASSES = {
    "center": ("{{ 'x'.center(2 * 10**9) }}", "512 MB"),
    "indent": ("{{ ('x\\n' * 1000) | indent(10**9) }}", "512 MB"),
    "format padding": ("{{ '%0*d' | format(10**9, 1) }}", "512 MB"),
    "~ doubling": (
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
        "512 MB",
    ),
    "macro recursion": (
        "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
        "2 s",
    ),
    "nested range loops": ("{% for i in range(10**5) %}{% for j in range(10**5) %}{% endfor %}{% endfor %}", "2 s"),
}
# Harmless on eval's probe chat ("Hi"), explosive on any real prompt: lm-eval's rendering meets it.
ON_REAL_PROMPTS = "{% if messages[0].content == 'Hi' %}ok{% else %}{{ 'x'.center(2 * 10**9) }}{% endif %}"


@pytest.fixture(autouse=True)
def small_limits(monkeypatch):
    monkeypatch.setattr(chat_template, "MAX_RENDER_BYTES", MEMORY)
    monkeypatch.setattr(chat_template, "MAX_RENDER_SECONDS", SECONDS)


def _with_template(tiny_checkpoint: Path, folder: Path, template: str) -> Path:
    model = Path(shutil.copytree(tiny_checkpoint, folder))
    (model / "chat_template.jinja").write_text(template)
    return model


def _one_line(capfd, *words: str) -> str:
    # Past the progress bars (lines that redraw themselves with \r), one line.
    error = [line for line in capfd.readouterr().err.split("\n") if line.strip() and "\r" not in line]
    assert len(error) == 1, error[-20:]
    for word in words:
        assert word in error[0], error[0]
    return error[0]


@pytest.mark.parametrize("template,limit", BYPASSES.values(), ids=BYPASSES)
def test_eval_stops_a_template_at_its_limit_before_any_model_loads(tiny_checkpoint, tmp_path, capfd, template, limit):
    model = _with_template(tiny_checkpoint, tmp_path / "model", template)
    out = tmp_path / "out"
    arguments = ["eval", str(model), "--out", str(out), "--limit", "2", "--no-cache", "--apply-chat-template"]
    assert ladder_main(arguments) == 2
    _one_line(capfd, "the chat template of", str(model), f"past {limit}")
    assert not out.exists()


def test_eval_stops_a_template_that_explodes_on_real_prompts(tiny_checkpoint, tmp_path, capfd):
    """lm-eval renders each prompt through the model's `apply_chat_template`: in the worker here."""
    model = _with_template(tiny_checkpoint, tmp_path / "model", ON_REAL_PROMPTS)
    out = tmp_path / "out"
    arguments = ["eval", str(model), "--out", str(out), "--tasks", "ladder_piqa", "--limit", "1", "--no-cache"]
    assert ladder_main([*arguments, "--apply-chat-template"]) == 2
    _one_line(capfd, "the chat template of", str(model), "past 512 MB")
    assert not out.exists()


@pytest.mark.parametrize("template,limit", BYPASSES.values(), ids=BYPASSES)
def test_adapt_prepare_data_stops_a_template_at_its_limit(tiny_checkpoint, tmp_path, capfd, template, limit):
    model = _with_template(tiny_checkpoint, tmp_path / "model", template)
    recipe = write_recipe(tmp_path, model, chat_corpus(tmp_path / "corpus", PROBE_CHAT))
    assert ladder_main(["adapt", str(recipe), "--prepare-data"]) == 2
    _one_line(capfd, "the chat template of", str(model), f"past {limit}")


def test_the_worker_renders_as_transformers_and_recovers_after_a_limit(smollm2_tokenizer_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    chat = [{"role": "system", "content": "Be brief."}, *PROBE_CHAT]
    with TemplateWorker() as worker:
        with pytest.raises(TemplateLimitExceeded, match="past 512 MB"):
            worker.render(BYPASSES["center"][0], chat)
        for options in ({"add_generation_prompt": True}, {"continue_final_message": True}):
            expected = tokenizer.apply_chat_template(chat, tokenize=False, **options)
            rendered = worker.render(tokenizer.chat_template, chat, **options, **tokenizer.special_tokens_map)
            assert rendered == expected
        with pytest.raises(chat_template.TemplateError, match="no system messages"):
            worker.render("{{ raise_exception('no system messages') }}", chat)
