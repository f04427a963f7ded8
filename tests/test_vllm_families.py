"""Every family served by vLLM (its CPU backend): Llama, Mistral, Qwen2 and Qwen3 ladder models
(ladder/serving/model.py) against vLLM's own model of the family and against transformers.

Tiny random checkpoints made by transformers' own classes (tests/tiny.py): head_dim 32 (the smallest
vLLM's CPU attention takes), Qwen2's q/k/v biases and Qwen3's q/k norms perturbed off their initial
values, and sliding windows shorter than the prompts for Mistral and Qwen2 (every layer of Qwen2:
`max_window_layers` 0). All engines run one after another in one subprocess of .venv-serve
(tests/vllm_runner.py), in that process (`in_process`: no engine or worker processes to start), eager
and, with no ladder layers, compiled too. Every family's ladder checkpoint is written by `ladder
convert`; one live `ladder serve` of the converted Qwen3 answers one completion (the HTTP layer is the
same for every family).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from ladder import to_ladder
from ladder.convert.cli import main as convert_main
from ladder.launch import free_port
from ladder.model.config_rules import CLASS_NAMES, ladder_architecture
from serving import SERVE_ENV, serve_env_vars, vllm_runs
from tiny import save_word_tokenizer, tiny_model

# Needs vLLM's environment (.venv-serve), which `make test` builds: `make test-fast` skips it.
pytestmark = pytest.mark.envs

FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]
LADDER_LAYERS = [0, 2, 3]  # ladder first, ladder -> standard, standard -> ladder, ladder -> ladder
WINDOW = 6
SLIDING = {
    "mistral": dict(sliding_window=WINDOW),
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0),
}
MAX_MODEL_LEN = 64
NEW_TOKENS = 8
PROMPT_LENGTHS = (9, 17)  # both longer than the window
# fp32 on both sides; vLLM's kernels sum in another order than transformers' (see tests/test_vllm.py).
LOGPROB_ATOL = 1e-3
TIE_MARGIN = 1e-4  # vLLM's greedy token may be another only where the reference's best two are closer


def engine_runs(family: str) -> list[tuple[str, str, bool]]:
    """(run name, checkpoint, eager) of a family's engines: its own model and its ladder form with no
    ladder layers, eager and compiled (an inductor build each: vLLM's compile cache keys on the model),
    and its ladder form with LADDER_LAYERS, eager."""
    own = [family, f"{family}-ladder0"]
    runs = [(name, name, True) for name in [*own, f"{family}-ladder"]]
    return runs + [(f"{name}-compiled", name, False) for name in own]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return save_word_tokenizer(tmp_path_factory.mktemp("words"))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer_dir) -> dict:
    """Per family: the family's own checkpoint, its ladder form with no ladder layers, and with
    LADDER_LAYERS, written by `ladder convert` (the others by `to_ladder` and save_pretrained)."""
    root = tmp_path_factory.mktemp("family-checkpoints")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    paths = {}
    for seed, family in enumerate(FAMILIES):
        model = tiny_model(
            family,
            seed,
            vocab_size=len(tokenizer),
            hidden_size=128,
            intermediate_size=256,
            head_dim=32,
            num_hidden_layers=4,
            max_position_embeddings=MAX_MODEL_LEN,
            **special,
            **SLIDING.get(family, {}),
        )
        model.generation_config = GenerationConfig(**special)
        for name, form in {family: model, f"{family}-ladder0": to_ladder(model, [])}.items():
            form.save_pretrained(root / name)
            tokenizer.save_pretrained(root / name)
            paths[name] = root / name
        paths[f"{family}-ladder"] = converted = root / f"{family}-ladder"
        layers = ",".join(map(str, LADDER_LAYERS))
        assert convert_main([str(paths[family]), "--layers", layers, "--out", str(converted), "--no-verify"]) == 0
    return paths


@pytest.fixture(scope="module")
def prompts(tokenizer_dir) -> list[list[int]]:
    """Random words (not <unk>, <s>, </s>)."""
    vocabulary = len(AutoTokenizer.from_pretrained(tokenizer_dir))
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocabulary, (length,), generator=generator).tolist() for length in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def served(checkpoints, prompts, tmp_path_factory) -> dict:
    """Every engine of every family, in one subprocess."""
    runs = [
        dict(
            name=name,
            model=str(checkpoints[checkpoint]),
            tp=1,
            eager=eager,
            prompts=prompts,
            max_tokens=NEW_TOKENS,
            max_model_len=MAX_MODEL_LEN,
        )
        for family in FAMILIES
        for name, checkpoint, eager in engine_runs(family)
    ]
    return vllm_runs(runs, tmp_path_factory.mktemp("vllm-families"), in_process=True)


@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize("family", FAMILIES)
def test_no_ladder_layers_is_vllms_own_model(served, family, mode):
    """With no ladder layers the ladder model is vLLM's own model of the family, to the bit: the
    same prompt log-probabilities, greedy tokens and their log-probabilities."""
    suffix = "-compiled" if mode == "compiled" else ""
    own, ladder = served[family + suffix], served[f"{family}-ladder0{suffix}"]
    assert own["model_classes"] == [f"vllm.model_executor.models.{family}.{CLASS_NAMES[family]}ForCausalLM"]
    assert ladder["model_classes"] == [f"ladder.serving.model.{ladder_architecture(family)}"]
    assert (own["compilation_mode"] == "NONE") == (ladder["compilation_mode"] == "NONE") == (mode == "eager")
    for key in ("prompt_logprobs", "tokens", "logprobs"):
        assert ladder[key] == own[key], f"{family}, {mode}: {key} differ"


def reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


@pytest.mark.parametrize("family", FAMILIES)
def test_ladder_layers_match_transformers(served, checkpoints, prompts, family):
    """With ladder layers, vLLM's ladder model computes the transformers ladder model's function
    (ladder/model/modeling_ladder.py) on the same checkpoint: on vLLM's own greedy path, fed to
    transformers whole, each prompt token's and each generated token's log-probability agree, and
    each generated token is transformers' best (or within a tie of it). vLLM's generation reads its
    KV cache; the reference has none."""
    result = served[f"{family}-ladder"]
    assert result["model_classes"] == [f"ladder.serving.model.{ladder_architecture(family)}"]
    model = AutoModelForCausalLM.from_pretrained(checkpoints[f"{family}-ladder"], dtype=torch.float32).eval()
    assert type(model).__name__ == ladder_architecture(family)
    assert model.config.ladder_layers == LADDER_LAYERS
    for prompt, tokens, logprobs, prompt_logprobs in zip(
        prompts, result["tokens"], result["logprobs"], result["prompt_logprobs"]
    ):
        steps = reference_logprobs(model, prompt + tokens)
        sequence = torch.tensor(prompt + tokens)
        chosen = steps[:-1].gather(1, sequence[1:, None])[:, 0]
        served_logprobs = torch.tensor(prompt_logprobs + logprobs)
        assert (served_logprobs - chosen).abs().max().item() <= LOGPROB_ATOL, f"{family}: log-probabilities differ"
        generated = steps[len(prompt) - 1 : -1]
        assert (generated.max(dim=-1).values - chosen[len(prompt) - 1 :]).max().item() < TIE_MARGIN, (
            f"{family}: vLLM's greedy tokens are not transformers' best"
        )


KEY = "families-test-key"


@pytest.fixture(scope="module")
def live_server(checkpoints, tmp_path_factory):
    """`ladder serve` of the converted Qwen3 checkpoint on loopback with a key (eager), once /health
    answers; stopped by SIGTERM (`ladder serve` became `vllm serve`, the same process)."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("live-server") / "server.log"
    arguments = ["--dtype", "float32", "--max-model-len", MAX_MODEL_LEN, "--enforce-eager"]
    command = [SERVE_ENV / "bin" / "ladder", "serve", checkpoints["qwen3-ladder"], "--port", port, "--api-key", KEY]
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            [*map(str, command), "--", *map(str, arguments)],
            env=serve_env_vars(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert server.poll() is None, f"`ladder serve` exited ({server.returncode}): {log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "`ladder serve` did not answer /health within 600 s"
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:  # not listening yet
                time.sleep(2)
        yield base
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def test_converted_qwen3_serves_transformers_greedy_text(live_server, checkpoints, prompts, tokenizer_dir):
    """`ladder convert` of a Qwen3 checkpoint, then `ladder serve` of it (a live server, one greedy
    completions request for both prompts): the same text as transformers generating greedily from the
    converted checkpoint."""
    converted = checkpoints["qwen3-ladder"]
    body = dict(model=converted.name, prompt=prompts, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    request = urllib.request.Request(
        live_server + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        choices = sorted(json.loads(response.read())["choices"], key=lambda choice: choice["index"])
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    assert len(choices) == len(prompts)
    for prompt, choice in zip(prompts, choices):
        with torch.no_grad():
            generated = model.generate(
                torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
            )
        # A completion's text is what the generated tokens add to the prompt's text (here the space
        # between words); vLLM skips special tokens by default.
        text = [tokenizer.decode(ids, skip_special_tokens=True) for ids in (prompt, generated[0])]
        assert text[0] + choice["text"] == text[1]
