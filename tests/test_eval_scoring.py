"""The hf backend's scoring against lm-eval's own (shared contexts, `--batch-size auto`, a bf16
head), and where the weights run (device, dtype, the vllm backend's start method)."""

from __future__ import annotations

import io
import os
import sys

import numpy as np
import pytest
from tqdm import tqdm

from ladder.errors import UsageError
from ladder.eval.backends.hf import LoadedHFLM
from ladder.eval.harness import ItemProgress
from ladder.eval.runtime import DEFAULT_BATCH_SIZE, Runtime, resolve_runtime
from ladder.io.loading import DTYPES, load_model

pytest_plugins = ("eval_runs",)  # its ladder_checkpoints fixture


@pytest.mark.parametrize("which", ["llama", "ladder"])
def test_shared_context_scoring_equals_lm_evals_per_request(tiny_checkpoint, ladder_checkpoints, which):
    """`LoadedHFLM` runs each shared context once and the head only on continuation positions; per
    request it gives lm-eval's own HFLM numbers: 4 choices of different lengths on one context,
    one-token continuations, a context of one token, contexts longer than max_length (left
    truncation, so that two different contexts share their truncated tail), batches that split a
    group's requests from the next group's."""
    from lm_eval.models.huggingface import HFLM

    path = tiny_checkpoint if which == "llama" else ladder_checkpoints[0]
    model, tokenizer = load_model(path, dtype=DTYPES["float32"])
    lm = LoadedHFLM(model, tokenizer, Runtime("cpu", "float32", batch_size=3))
    lm._max_length = 24
    rng = np.random.default_rng(0)

    def tokens(count: int) -> list[int]:
        return rng.integers(1, len(tokenizer), count).tolist()

    shared, long_tail = tokens(9), tokens(21)
    requests = [
        *[(shared, tokens(count)) for count in (1, 3, 5, 2)],
        (tokens(14), tokens(1)),
        (tokens(14), tokens(1)),
        (tokens(7) + long_tail, tokens(4)),  # both truncate to long_tail + the continuation
        (tokens(3) + long_tail, tokens(4)),
        (tokens(8), tokens(3)),  # one batch of three contexts of different lengths
        (tokens(5), tokens(2)),
        (tokens(1), tokens(6)),
        (tokens(2), tokens(24)),  # the continuation alone fills max_length
    ]
    requests = [((f"c{index}", "x"), context, continuation) for index, (context, continuation) in enumerate(requests)]
    ours = lm._loglikelihood_tokens(requests)
    stock = HFLM._loglikelihood_tokens(lm, requests)
    assert [greedy for _, greedy in ours] == [greedy for _, greedy in stock]
    np.testing.assert_allclose([value for value, _ in ours], [value for value, _ in stock], rtol=1e-5)


def _random_requests(tokenizer, count: int, seed: int = 0) -> list:
    """lm-eval's (request, context tokens, continuation tokens): pairs of choices after one context."""
    rng = np.random.default_rng(seed)
    requests = []
    for index in range(count):
        context = rng.integers(1, len(tokenizer), 6 + index % 5).tolist()
        for choice in range(2):
            requests.append(
                ((f"c{index}", f"x{choice}"), context, rng.integers(1, len(tokenizer), 2 + choice).tolist())
            )
    return requests


def test_batch_size_auto_keeps_the_shared_context_scorer(tiny_checkpoint):
    """Under `--batch-size auto` lm-eval's detection picks the batch size and the shared-context
    scorer still scores (the head sees only continuation rows, [rows, hidden]; lm-eval's own path
    and its detection run it on [batch, positions, hidden]), with lm-eval's numbers."""
    from lm_eval.models.huggingface import HFLM

    model, tokenizer = load_model(tiny_checkpoint, dtype=DTYPES["float32"])
    lm = LoadedHFLM(model, tokenizer, Runtime("cpu", "float32", batch_size="auto"))
    lm.max_batch_size = 4  # the detection's first try (64 full-length rows) is slow on a CPU
    head_inputs = []
    hook = model.lm_head.register_forward_hook(lambda module, inputs, output: head_inputs.append(inputs[0].dim()))
    requests = _random_requests(tokenizer, 6)
    ours = lm._loglikelihood_tokens(requests)
    assert 2 in head_inputs  # (besides the detection's full-length batches)
    head_inputs.clear()
    stock = HFLM._loglikelihood_tokens(lm, requests)
    hook.remove()
    assert set(head_inputs) == {3}
    assert [greedy for _, greedy in ours] == [greedy for _, greedy in stock]
    np.testing.assert_allclose([value for value, _ in ours], [value for value, _ in stock], rtol=1e-5)


def test_bfloat16_head_log_softmax_runs_in_float32(tiny_checkpoint):
    """A bf16 model's continuation log-likelihoods equal the head and log-softmax taken in float64
    over the same bf16 hidden states; bf16 logits (what the head gives in the model's dtype) are
    off by far more."""
    import torch

    model, tokenizer = load_model(tiny_checkpoint, dtype=DTYPES["bfloat16"])
    with torch.no_grad():
        model.lm_head.weight.mul_(30)  # logits of a trained model's size (random ones are near 0)
    lm = LoadedHFLM(model, tokenizer, Runtime("cpu", "bfloat16", batch_size=4))
    requests = _random_requests(tokenizer, 4, seed=1)
    ours = [value for value, _ in lm._loglikelihood_tokens(requests)]
    exact, rounded = [], []
    for _, context, continuation in requests:
        ids = torch.tensor([context + continuation[:-1]])
        with torch.no_grad():
            hidden = model.model(input_ids=ids).last_hidden_state[0, len(context) - 1 :]
        targets = torch.tensor(continuation)[:, None]
        logits = hidden.double() @ model.lm_head.weight.double().T
        exact.append(float(torch.log_softmax(logits, dim=-1).gather(1, targets).sum()))
        rounded.append(float(torch.log_softmax(model.lm_head(hidden).double(), dim=-1).gather(1, targets).sum()))
    np.testing.assert_allclose(ours, exact, atol=2e-4)
    assert max(abs(a - b) for a, b in zip(rounded, exact)) > 1e-2  # the check can tell them apart


def test_runtime_defaults_to_cpu_float32_without_a_gpu():
    import torch

    runtime = resolve_runtime()
    if torch.cuda.is_available():
        assert runtime.device == "cuda:0" and runtime.dtype in ("bfloat16", "float16")
    else:
        assert (runtime.device, runtime.dtype, runtime.processes) == ("cpu", "float32", 1)
        with pytest.raises(UsageError, match="no CUDA GPU is visible"):
            resolve_runtime("cuda:0")
    assert resolve_runtime("cpu", "bfloat16").dtype == "bfloat16"
    # lm-eval's search for the largest batch is for GPU memory: on the CPU `auto` is the default.
    assert resolve_runtime("cpu", "float32", "auto").batch_size == DEFAULT_BATCH_SIZE
    with pytest.raises(UsageError, match="--device 'gpu'"):
        resolve_runtime("gpu")


def test_vllm_backend_spawns_its_engines_where_cuda_may_be(monkeypatch):
    """Where torch has CUDA, vLLM's start method is spawn before vLLM is first imported, and this
    process never initialises the CUDA driver: torch.cuda.is_available() does, without setting the
    flag vLLM reads to choose spawn, and vLLM's forked engine then failed. A CUDA build with one GPU
    (counted through NVML) is patched in: there is no GPU here."""
    import importlib.abc

    import torch

    from ladder.eval.backends import get_backend

    def initialises_the_driver(*args, **kwargs):
        raise AssertionError("the CUDA driver was initialised in the process that starts vLLM")

    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")  # restored after the test
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD")
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_available", initialises_the_driver)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", initialises_the_driver)
    start_methods = []  # VLLM_WORKER_MULTIPROC_METHOD at each import of vllm

    class ImportWatch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "vllm":
                start_methods.append(os.environ.get("VLLM_WORKER_MULTIPROC_METHOD"))
            return None

    monkeypatch.setattr(sys, "meta_path", [ImportWatch(), *sys.meta_path])
    runtime = resolve_runtime(backend="vllm")
    with pytest.raises(UsageError, match="vLLM is not installed"):  # in this environment
        get_backend("vllm").check(runtime, [])
    assert runtime.device == "cuda:0"
    assert start_methods and set(start_methods) == {"spawn"}


def test_the_progress_bar_moves_per_item_as_batches_are_scored(tiny_checkpoint):
    """Four items of two choices, one item's requests a batch: the run's bar shows 1/4, 2/4, 3/4
    as the batches are scored, not 0/4 until the task ends."""
    model, tokenizer = load_model(tiny_checkpoint, dtype=DTYPES["float32"])
    lm = LoadedHFLM(model, tokenizer, Runtime("cpu", "float32", batch_size=1))
    shown = io.StringIO()
    with tqdm(total=4, file=shown, mininterval=0, miniters=1) as bar:
        counter = ItemProgress(lm, bar)
        requests = _random_requests(tokenizer, 4)
        counter.items, counter.per_request = 4, 4 / len(requests)
        lm._loglikelihood_tokens(requests)
    assert all(f"{n}/4" in shown.getvalue() for n in (1, 2, 3, 4))
