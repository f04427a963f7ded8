"""Hostile inputs, second round (issue 37): inputs built to exhaust memory (YAML alias bombs, chat
templates that loop or repeat without end) and malformed files that used to end in a traceback.
The trials built to exhaust memory run the real command in a subprocess whose address space is
capped (`resource.RLIMIT_AS`), so that the code before the fix fails in a bounded way (a MemoryError
traceback, or the timeout) instead of filling the machine; the others call the command in this
process. After the fix each is one line and status 2, with nothing written."""

from __future__ import annotations

import json
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from adapt_runs import REPO, chat_corpus, write_recipe
from checkpoints import snapshot
from file_server import write_manifest
from ladder.cli import main as ladder_main
from ladder.errors import UsageError
from ladder.io.data_fetch import DataFile
from ladder.io.files import sha256_file
from ladder.model.config_rules import HIDDEN_ACTS, ROPE_TYPES

# Far more than any of these commands needs to refuse its input, far less than the machine has.
MEMORY_CAP = 3 << 30


def ladder_capped(*args: object, timeout: float = 300) -> subprocess.CompletedProcess:
    """`ladder ARGS` in a subprocess whose address space is capped at MEMORY_CAP."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))

    return subprocess.run(
        [sys.executable, "-m", "ladder.cli", *map(str, args)],
        cwd=REPO,
        preexec_fn=cap,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_one_line_refusal(result: subprocess.CompletedProcess, *words: str) -> str:
    assert result.returncode == 2, result.stderr[-2000:]
    return assert_one_line(result.stderr, *words)


def assert_one_line(stderr: str, *words: str) -> str:
    error = stderr.strip()
    assert len(error.splitlines()) == 1 and len(error) < 600, error[:2000]
    for word in words:
        assert word in error, error
    return error


def assert_ladder_refuses(capsys, args: list[object], *words: str) -> str:
    """`ladder ARGS` in this process ends in one line naming `words`, status 2."""
    status = ladder_main(list(map(str, args)))
    stderr = capsys.readouterr().err
    assert status == 2, stderr[-2000:]
    return assert_one_line(stderr, *words)


def alias_bomb(levels: int = 12, width: int = 9) -> list[str]:
    """YAML lines anchoring `a{levels}`: a list that aliases expand to width**levels leaves."""
    lines = ["a0: &a0 [lol]"]
    for level in range(1, levels + 1):
        lines.append(f"a{level}: &a{level} [" + ", ".join([f"*a{level - 1}"] * width) + "]")
    return lines


def flow_alias_bomb(levels: int = 12, width: int = 9) -> str:
    """The same bomb on one line, as a `key=value` override's value."""
    parts = ["a0: &a0 [lol]"]
    for level in range(1, levels + 1):
        parts.append(f"a{level}: &a{level} [" + ", ".join([f"*a{level - 1}"] * width) + "]")
    return "{" + ", ".join(parts) + "}"


def test_a_recipe_alias_bomb_is_refused_in_one_line(tmp_path, tiny_checkpoint, corpus):
    """The recipe's error message used to expand the bomb with repr (past 3 GB)."""
    recipe = write_recipe(tmp_path, tiny_checkpoint, corpus)
    text = "\n".join(line for line in recipe.read_text().splitlines() if not line.startswith("budget:"))
    recipe.write_text(text + "\nbudget:\n" + "".join(f"  {line}\n" for line in alias_bomb()))
    result = ladder_capped("adapt", recipe)
    assert_one_line_refusal(result, str(recipe), "alias")
    assert not (tmp_path / "run").exists()


def test_an_override_alias_bomb_is_refused_in_one_line(tmp_path, tiny_checkpoint, corpus):
    recipe = write_recipe(tmp_path, tiny_checkpoint, corpus)
    result = ladder_capped("adapt", recipe, f"budget={flow_alias_bomb()}")
    assert_one_line_refusal(result, "budget", "alias")
    assert not (tmp_path / "run").exists()


def test_a_suite_alias_bomb_is_refused_in_one_line(tmp_path, tiny_checkpoint):
    """The suite's error message used to expand the bomb with repr."""
    suite = tmp_path / "bomb.yaml"
    # The anchors inside a key the suite knows, so that the check of its value meets the bomb.
    suite.write_text("offline:\n" + "".join(f"  {line}\n" for line in alias_bomb()) + "tasks: [ladder_piqa]\n")
    result = ladder_capped("eval", tiny_checkpoint, "--suite", suite, "--out", tmp_path / "report", "--device", "cpu")
    assert_one_line_refusal(result, str(suite), "alias")
    assert not (tmp_path / "report").exists()


def test_adam_eps_below_zero_is_refused_with_the_recipe(tmp_path, tiny_checkpoint, corpus, capsys):
    """optimizer.eps=-1 used to pass the recipe and fail in torch's Adam, a traceback after the model loaded."""
    recipe = write_recipe(tmp_path, tiny_checkpoint, corpus)
    assert_ladder_refuses(capsys, ["adapt", recipe, "optimizer.eps=-1"], "optimizer.eps")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("scheme", ["file", "ftp"])
def test_a_data_manifest_url_that_is_not_http_is_refused(tmp_path, scheme, capsys):
    """pooch took `file://` (a traceback: 'Unrecognized URL protocol') and `ftp://` as they came."""
    source = tmp_path / "secret.txt"
    source.write_text("a file of this machine")
    url = source.as_uri() if scheme == "file" else "ftp://127.0.0.1:9/secret.txt"
    entry = DataFile("books/secret.txt", source.stat().st_size, sha256_file(source), url)
    manifest = write_manifest(tmp_path / "manifest.tsv", [entry])
    args = ["data", "--dest", tmp_path / "data", "--manifest", manifest]
    assert_ladder_refuses(capsys, args, f"{scheme}://", "books/secret.txt")
    assert not (tmp_path / "data" / "books").exists()


def _edit_json(path: Path, edit) -> None:
    value = json.loads(path.read_text())
    edit(value)
    path.write_text(json.dumps(value))


def _first_merge_malformed(tokenizer: dict) -> None:
    tokenizer["model"]["merges"][0] = ["a"]


def _token_past_the_vocabulary(tokenizer: dict) -> None:
    vocabulary = tokenizer["model"]["vocab"]
    vocabulary[next(iter(vocabulary))] = 10**6


def _json(edit):
    return lambda path: _edit_json(path, edit)


def _text(text: str):
    return lambda path: path.write_text(text)


def _corrupt_header(path: Path) -> None:
    with open(path, "r+b") as handle:
        handle.seek(8)  # past the header's length: its JSON
        handle.write(b"{garbage")


# What each trial does to a copy of the tiny checkpoint: (file, edit of that file).
MALFORMED_CHECKPOINTS = {
    "tokenizer merges malformed": ("tokenizer.json", _json(_first_merge_malformed)),
    "tokenizer id past the vocabulary": ("tokenizer.json", _json(_token_past_the_vocabulary)),
    "tokenizer.json not JSON": ("tokenizer.json", _text("not JSON {")),
    "unknown rope type": ("config.json", _json(lambda c: c.update(rope_parameters={"rope_type": "bogus"}))),
    "unknown hidden_act": ("config.json", _json(lambda c: c.update(hidden_act="bogus"))),
    "max_position_embeddings 1": ("config.json", _json(lambda c: c.update(max_position_embeddings=1))),
    "config.json a list": ("config.json", _text("[1, 2]")),
    "config.json 200k levels deep": ("config.json", _text("[" * 200_000 + "]" * 200_000)),
    "safetensors header corrupt": ("model.safetensors", _corrupt_header),
}
EXPECTED_WORDS = {
    "tokenizer merges malformed": ["tokenizer.json", "malformed"],
    "tokenizer id past the vocabulary": ["tokenizer.json", "vocab_size"],
    "tokenizer.json not JSON": ["tokenizer.json", "malformed"],
    "unknown rope type": ["config.json", "rope_type 'bogus'"],
    "unknown hidden_act": ["config.json", "hidden_act 'bogus'"],
    "max_position_embeddings 1": ["config.json", "max_position_embeddings"],
    "config.json a list": ["config.json", "JSON object"],
    "config.json 200k levels deep": ["config.json", "deeply"],
    "safetensors header corrupt": ["model.safetensors", "not a valid safetensors file"],
}


def malformed_checkpoint(tiny_checkpoint: Path, folder: Path, trial: str) -> Path:
    model = Path(shutil.copytree(tiny_checkpoint, folder / "model"))
    name, edit = MALFORMED_CHECKPOINTS[trial]
    edit(model / name)
    return model


# Every trial through convert; eval and adapt read the checkpoint through the same checks
# (`ladder.io.loading.check_checkpoint`): a config trial and a tokenizer trial each.
MALFORMED_TRIALS = [
    *(("convert", trial) for trial in MALFORMED_CHECKPOINTS),
    ("eval", "tokenizer merges malformed"),
    ("eval", "tokenizer id past the vocabulary"),
    ("eval", "max_position_embeddings 1"),
    ("eval", "safetensors header corrupt"),
    ("adapt", "safetensors header corrupt"),
    ("adapt", "tokenizer merges malformed"),
    ("adapt", "unknown hidden_act"),
]


@pytest.mark.parametrize(("command", "trial"), MALFORMED_TRIALS)
def test_a_malformed_checkpoint_is_one_line_before_anything_is_written(
    tmp_path, tiny_checkpoint, corpus, capsys, command, trial
):
    """Each used to be a traceback (transformers' KeyError, tokenizers' Exception, a RecursionError,
    an AttributeError on a list, eval's scorer refusing every continuation), or worse: convert copied
    a tokenizer.json that is not JSON and verified with random ids, exit 0; eval scored with token
    ids past the embedding."""
    model = malformed_checkpoint(tiny_checkpoint, tmp_path, trial)
    before = snapshot(model)
    out = tmp_path / "out"
    args = {
        "convert": ["convert", model, "--out", out, "--layers", "2"],
        "eval": ["eval", model, "--out", out, "--limit", "2", "--device", "cpu", "--no-cache"],
        "adapt": ["adapt", write_recipe(tmp_path, model, corpus, output_dir=str(out))],
    }[command]
    assert_ladder_refuses(capsys, args, *EXPECTED_WORDS[trial])
    assert not out.exists() and snapshot(model) == before


def test_the_config_rules_name_only_what_transformers_builds():
    from transformers.activations import ACT2CLS
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    assert set(HIDDEN_ACTS) <= set(ACT2CLS)
    assert set(ROPE_TYPES) - {"default"} <= set(ROPE_INIT_FUNCTIONS)


TEMPLATE_BOMBS = {
    "a string repeated 10**9 times": "{{ 'x' * 10**9 }}",
    "nested range(100000) loops": "{% for i in range(100000) %}{% for j in range(100000) %}{{ j }}{% endfor %}{% endfor %}",
}


# The trials of one command after another in one capped process: its imports and model loads once.
# The render clock is shortened (10 s) as in the time-limit test below; the memory budget is not.
CAPPED_TRIALS = """
import contextlib, io, json, sys
from ladder import chat_template
from ladder.cli import main
chat_template.MAX_RENDER_SECONDS = 3.0
results = []
for argv in json.loads(sys.argv[1]):
    with contextlib.redirect_stderr(io.StringIO()) as error:
        status = main(argv)
    results.append([status, error.getvalue()])
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def template_bomb_refusals(tmp_path_factory, tiny_checkpoint) -> dict[tuple[str, str], tuple[int, str, Path]]:
    """(template, command) -> the status, stderr and model folder of `ladder adapt --prepare-data` or
    `ladder eval --apply-chat-template` on a copy of the tiny checkpoint with that chat template, all
    run in one subprocess whose address space is capped at MEMORY_CAP."""
    trials, argvs = [], []
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    for name, template in TEMPLATE_BOMBS.items():
        for command in ("adapt", "eval"):
            folder = tmp_path_factory.mktemp("template-bomb")
            model = Path(shutil.copytree(tiny_checkpoint, folder / "model"))
            (model / "chat_template.jinja").write_text(template)
            if command == "adapt":
                argv = ["adapt", write_recipe(folder, model, chat_corpus(folder / "corpus", chat)), "--prepare-data"]
            else:
                argv = ["eval", model, "--out", folder / "report", "--limit", "2", "--device", "cpu"]
                argv.append("--apply-chat-template")
            trials.append((name, command, model))
            argvs.append(list(map(str, argv)))

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))

    done = subprocess.run(
        [sys.executable, "-c", CAPPED_TRIALS, json.dumps(argvs)],
        cwd=REPO,
        preexec_fn=cap,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    return {(name, command): (*result, model) for (name, command, model), result in zip(trials, results)}


@pytest.mark.slow  # the adapt and eval commands in a capped process (a memory and time limit are the point)
@pytest.mark.parametrize("command", ["adapt", "eval"])
@pytest.mark.parametrize("template", TEMPLATE_BOMBS)
def test_a_chat_template_past_its_budget_is_one_line_naming_it(template_bomb_refusals, template, command):
    """Such templates grew adapt's tokenizer workers past 8-10 GB (here: past the cap, or the timeout);
    eval's chats are rendered by lm-eval through transformers, after a probe chat within the budget."""
    status, error, model = template_bomb_refusals[template, command]
    assert status == 2, error[-2000:]
    assert_one_line(error, "the chat template of", str(model), "past")
    assert not (model.parent / "report").exists()


def test_a_chat_template_that_loops_without_output_stops_at_its_time_limit(monkeypatch):
    """Loops that print nothing pass the output limit: the clock stops them (shortened here)."""
    from ladder import chat_template
    from ladder.adapt.tokenize import ChatRenderer

    monkeypatch.setattr(chat_template, "MAX_RENDER_SECONDS", 0.5)
    silent = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    with pytest.raises(UsageError, match=r"the chat template of model M failed on this chat: it ran past 0.5 s"):
        ChatRenderer(silent, {}, "model M")
