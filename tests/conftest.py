"""Test session setup: no network, a private HF cache and ladder cache, shared tiny checkpoints and
corpus, the embedded SmolLM2 converted once, and the vLLM jobs (greedy engines, families, eval) side by side.

The environment is set before transformers is imported anywhere, so no test can reach the Hub
or write into the user's cache.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
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

import family_engines  # noqa: E402
from adapt_runs import prose  # noqa: E402
from serving import NEW_TOKENS, PROMPTS, SERVE_ENV, TINY_LADDER_LAYERS, TINY_LAYERS, ServeJob, VLLMJob  # noqa: E402
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


@pytest.fixture(scope="session")
def vllm_models(tmp_path_factory, smollm2_tokenizer_dir, smollm2_ladder) -> dict[str, Path]:
    """What the session's vLLM job serves: the embedded SmolLM2 rewired (smollm2_ladder), and a random
    Llama whose 4 query and 2 KV heads of 32 (the smallest vLLM's CPU attention takes) split over 2
    ranks, plain and converted at serving.TINY_LADDER_LAYERS. Tests must not modify them."""
    from ladder.convert.convert import convert_checkpoint

    root = tmp_path_factory.mktemp("vllm-models")
    shape = dict(num_hidden_layers=TINY_LAYERS, hidden_size=128, intermediate_size=256, head_dim=32)
    save_tiny_checkpoint(root / "tiny-plain", smollm2_tokenizer_dir, **shape)
    convert_checkpoint(root / "tiny-plain", root / "tiny-ladder", ladder_layers=TINY_LADDER_LAYERS, verify=False)
    return {"smollm2-ladder": smollm2_ladder, "tiny-plain": root / "tiny-plain", "tiny-ladder": root / "tiny-ladder"}


@pytest.fixture(scope="session")
def greedy_prompt_ids(smollm2_tokenizer_dir) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    return [tokenizer(text).input_ids for text in PROMPTS]


@pytest.fixture(scope="session")
def family_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """tests/family_engines.py's checkpoints of every family, and their tokenizer ("tokenizer")."""
    return family_engines.write_checkpoints(tmp_path_factory.mktemp("family-checkpoints"))


@pytest.fixture(scope="session")
def family_prompts(family_checkpoints) -> list[list[int]]:
    return family_engines.random_prompts(family_checkpoints["tokenizer"])


@pytest.fixture(scope="session")
def vllm_jobs(request, tmp_path_factory) -> Iterator[dict[str, ServeJob]]:
    """The session's vLLM jobs that its tests need ("greedy", "families", "eval"), each in .venv-serve
    processes of its own, started together when the first is needed: an engine compiles mostly on one
    core, so side by side they take less than one after another, while the tests wait for them."""
    needed = {name for item in request.session.items for name in item.fixturenames}
    jobs = {}
    if "vllm_greedy" in needed:
        jobs["greedy"] = greedy_job(
            request.getfixturevalue("vllm_models"),
            request.getfixturevalue("greedy_prompt_ids"),
            tmp_path_factory.mktemp("vllm-greedy"),
        )
    if "vllm_families" in needed:
        runs = family_engines.runs(
            request.getfixturevalue("family_checkpoints"), request.getfixturevalue("family_prompts")
        )
        jobs["families"] = VLLMJob(runs, tmp_path_factory.mktemp("vllm-families"), in_process=True)
    if "vllm_eval" in needed:  # tests/test_vllm.py scores the same with the HF backend
        work, model = tmp_path_factory.mktemp("vllm-eval"), request.getfixturevalue("vllm_models")["tiny-ladder"]
        command = ["eval", model, "--suite", "smoke", "--no-cache", "--out", work / "scores"]
        jobs["eval"] = ServeJob(
            [SERVE_ENV / "bin" / "ladder", *command, "--backend", "vllm", "--data-parallel", 2], work
        )
    yield jobs
    for job in jobs.values():
        job.stop()


def greedy_job(models: dict[str, Path], prompt_ids: list[list[int]], work: Path) -> VLLMJob:
    """Every vLLM engine the session compares or reads, in one .venv-serve process (one vLLM import,
    one compile each): tests/test_vllm.py compares their greedy tokens with transformers',
    tests/test_serving_compiled.py reads the code inductor built at TP=2 (in its run's own
    `compile_cache`). SmolLM2 runs in vLLM's default mode, torch.compile (Dynamo traces our layer
    loop, inductor builds it in C++: minutes), which is what `vllm serve` and `ladder serve` run; its
    9 heads do not split over 2 ranks, so the tiny ladder model runs TP=2, compiled too, and TP=1
    eager; the plain Llama (vLLM's own model) runs eager. The TP=1 engines run in the runner's own
    process (no engine process to start and import vLLM again: 5 s against 26 s for an eager one)."""
    runs = [  # TP=2 first, in its own processes; then the TP=1 engines in the runner's (`in_process`)
        dict(name="tiny-ladder-tp2", model=models["tiny-ladder"], tp=2, eager=False, compile_cache=work / "tp2"),
        dict(name="smollm2-ladder", model=models["smollm2-ladder"], tp=1, eager=False, in_process=True),
        dict(name="tiny-ladder-tp1", model=models["tiny-ladder"], tp=1, eager=True),
        dict(name="tiny-plain", model=models["tiny-plain"], tp=1, eager=True),
    ]
    for run in runs:
        run.update({key: str(value) for key, value in run.items() if isinstance(value, Path)})
        run.update(prompts=prompt_ids, max_tokens=NEW_TOKENS)
    return VLLMJob(runs, work)


@pytest.fixture(scope="session")
def vllm_greedy(vllm_jobs) -> dict:
    """The greedy job's results (greedy_job), per run name."""
    results = vllm_jobs["greedy"].result()
    results["tiny-ladder-tp2"]["compile_cache"] = vllm_jobs["greedy"].work / "tp2"
    return results


@pytest.fixture(scope="session")
def vllm_eval(vllm_jobs) -> tuple[int, str, Path]:
    """`ladder eval --backend vllm --data-parallel 2` of the tiny ladder model on the smoke suite: its
    exit status, output and scores folder."""
    return *vllm_jobs["eval"].wait(), vllm_jobs["eval"].work / "scores"


@pytest.fixture(scope="session")
def vllm_families(vllm_jobs) -> dict:
    """The family job's results (tests/family_engines.py), per run name."""
    return vllm_jobs["families"].result()


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
