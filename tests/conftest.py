"""Test session setup: no network, a private HF cache and ladder cache, shared tiny checkpoints and
corpus, and the embedded SmolLM2 converted once.

The environment is set before transformers is imported anywhere, so no test can reach the Hub
or write into the user's cache.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

# `python -m pytest` from the checkout puts it on sys.path, where the stage folders would import a
# second time under their folder names (`adapt.recipe` beside `ladder.adapt.recipe`, two classes
# for one): the suite imports the stages as the package installs them, `ladder.*`, only.
_CHECKOUT = Path(__file__).resolve().parents[1]
sys.path[:] = [str(Path(entry or os.curdir).resolve()) for entry in sys.path]
sys.path[:] = [entry for entry in sys.path if Path(entry) != _CHECKOUT]
# Tests name the checkout's files (recipes/, eval/tasks/) as a user in it does: run from any folder,
# the suite runs in the checkout (sys.path holds no relative entry that this would change).
os.chdir(_CHECKOUT)

_HF_HOME = tempfile.mkdtemp(prefix="ladder-tests-hf-")
# The cache root of tokenized data and eval scores (LADDER_CACHE): the session's own, never the user's.
_LADDER_CACHE = tempfile.mkdtemp(prefix="ladder-tests-cache-")
os.environ.update(
    HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=_HF_HOME, LADDER_CACHE=_LADDER_CACHE
)

import pytest  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from adapt_runs import prose  # noqa: E402
from tiny import save_tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir(tmp_path_factory) -> Path:
    """The real SmolLM2 tokenizer (with its chat template), read once from the embedded GGUF file."""
    from ladder.io.loading import embedded_model_path

    gguf = embedded_model_path()
    directory = tmp_path_factory.mktemp("smollm2-tokenizer")
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, smollm2_tokenizer_dir) -> Path:
    """A tiny random Llama checkpoint directory with SmolLM2's tokenizer (vocab 49152), as
    `save_pretrained` writes it: config.json, model.safetensors, tokenizer, generation config.
    Shared by the whole session: tests must not modify it (copy it first)."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), smollm2_tokenizer_dir, num_hidden_layers=4)


@pytest.fixture(scope="session")
def smollm2_ladder(tmp_path_factory) -> Path:
    """The embedded SmolLM2 converted once for the session, unverified, at ladder layers 0,2,3,22-29:
    the upper 8 of its 30 (`ladder convert --layers 8`, which vLLM's compiled mode once served wrongly)
    and a non-contiguous set below them with every kind of neighbour. Tests must not modify it."""
    from ladder.convert.convert import convert_checkpoint

    model = tmp_path_factory.mktemp("smollm2-ladder") / "smollm2-ladder"
    convert_checkpoint(None, model, ladder_layers="0,2,3,22-29", verify=False)
    return model


@pytest.fixture
def gguf_parses(monkeypatch) -> list:
    """The paths `gguf.GGUFReader` parses during the test, one entry per parse (the real reader runs)."""
    import gguf

    parsed, reader = [], gguf.GGUFReader

    def counting_reader(path, *args, **kwargs):
        parsed.append(path)
        return reader(path, *args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", counting_reader)
    return parsed


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face cache for this test (the tests run with HF_HUB_OFFLINE=1); fill it with
    checkpoints.cache_hub_model."""
    import huggingface_hub

    cache = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Three books of generated prose in `train/` and a held-out file, for adapt runs on `tiny_checkpoint`."""
    folder = tmp_path_factory.mktemp("corpus")
    (folder / "train").mkdir()
    for i in range(3):
        (folder / "train" / f"book{i}.txt").write_text(prose(i, 40))
    (folder / "heldout.txt").write_text(prose(99, 30))
    return folder
