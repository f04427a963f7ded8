"""adapt's GPU paths, each test on the CPU and (a GPU check, `pytest -m gpu`) on CUDA: the bf16 head
loss, and compiled bf16 training under the 8-GPU FSDP config with preemption and resume. Beside them
what the lent GPU machine's image needs of adapt (no gguf there) and of its launch configs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from adapt_runs import losses, prose, write_recipe
from tiny import DEVICES, save_tiny_checkpoint, save_word_tokenizer

REPO = Path(__file__).resolve().parents[1]
ACCELERATE_CONFIGS = sorted((REPO / "recipes" / "accelerate").glob("*.yaml"))
EIGHT_GPU_CONFIG = REPO / "recipes" / "accelerate" / "fsdp-8gpu.yaml"
# Three launches take minutes on a CPU: make gpu-image-env (benchmarks/gpu_check.py --cpu) asks for them.
ADAPT_STEPS_ON_CPU = os.environ.get("LADDER_ADAPT_STEPS_ON_CPU") == "1"
CHECKPOINTING = "model.activation_checkpointing"


@pytest.fixture(scope="module")
def word_checkpoint(tmp_path_factory) -> Path:
    """A tiny Llama with a word-level tokenizer built here: what the GPU machine can make offline."""
    tokenizer = save_word_tokenizer(tmp_path_factory.mktemp("word-tokenizer"))
    return save_tiny_checkpoint(tmp_path_factory.mktemp("word-llama"), tokenizer, num_hidden_layers=4)


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_head_loss_matches_fp64_over_the_same_operands(device):
    """adapt/losses.py: the chunked head loss with bf16 operands and fp32 accumulation, compiled, against
    fp64 over the same bf16-rounded operands, in the loss and both gradients; on CUDA at the 8B head's
    vocabulary (on the CPU the product is rounded to bf16 first: a small shape)."""
    from ladder.adapt.losses import head_losses, next_token_labels

    device = torch.device(device)
    generator = torch.Generator(device).manual_seed(0)
    batch, seq, width, vocab = (2, 2048, 2048, 128256) if device.type == "cuda" else (2, 64, 32, 512)
    hidden = torch.randn(batch, seq, width, device=device, generator=generator, requires_grad=True)
    weight = (torch.randn(vocab, width, device=device, generator=generator) / width**0.5).requires_grad_()
    labels = next_token_labels(torch.randint(0, vocab, (batch, seq), device=device, generator=generator))

    logits = hidden.bfloat16().double() @ weight.bfloat16().double().T
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    expected_grads = torch.autograd.grad(expected, (hidden, weight))
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = torch.compile(lambda h, w: head_losses(h, w, labels)[0])(hidden, weight)
        grads = torch.autograd.grad(loss, (hidden, weight))

    assert loss.dtype == torch.float32
    assert abs(float(loss) - float(expected)) / abs(float(expected)) < 1e-4
    for got, want in zip(grads, expected_grads):
        assert float((got.double() - want).abs().max() / want.abs().max()) < 2e-2


def launch_adapt(recipe: Path, *overrides: str) -> subprocess.Popen:
    """`ladder adapt RECIPE` under accelerate launch with the 8-GPU config at one process (FSDP2 at
    world size 1: NCCL on a GPU, gloo on the CPU), with the preemption settings of that config's launch line."""
    from ladder.launch import free_port

    environment = dict(
        os.environ, PET_SIGNALS_TO_HANDLE="SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", TORCH_ELASTIC_SHUTDOWN_TIMEOUT="300"
    )
    command = [
        *(sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(EIGHT_GPU_CONFIG)),
        *("--num_processes", "1", "--main_process_port", str(free_port())),
        *("-m", "ladder.adapt.cli", str(recipe), *overrides),
    ]
    # From the recipe's folder: `-m` puts the working folder first on sys.path, where a checkout's
    # ladder/ would hide the installed package's stages (where the checkout is not installed editable).
    return subprocess.Popen(
        command, cwd=recipe.parent, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def own_lines(output: str) -> str:
    """The launched run's own output, without torchrun's report of its failure that follows it."""
    return output.split('Traceback (most recent call last):\n  File "<frozen runpy>"')[0][-4000:]


def steps_logged(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    return sum("loss" in json.loads(line) for line in metrics.read_text().splitlines()) if metrics.is_file() else 0


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_compiled_bf16_fsdp_training_recomputes_and_resumes_after_sigterm(device, word_checkpoint, tmp_path):
    """Compiled layers, bf16, FSDP2 under the 8-GPU config at one process: selective recompute trains 12
    steps with finite losses; full recompute, stopped by a SIGTERM to the launcher after 2 steps (torchrun
    forwards it with the config's settings), leaves a whole checkpoint of its last step, which resumes."""
    if device == "cpu" and not ADAPT_STEPS_ON_CPU:
        pytest.skip("three launches, minutes on a CPU: make gpu-image-env runs it (LADDER_ADAPT_STEPS_ON_CPU=1)")
    from ladder.adapt.checkpoint import STATE_FILE, checkpoints

    corpus = tmp_path / "corpus"
    (corpus / "train").mkdir(parents=True)
    for index in range(4):
        (corpus / "train" / f"part{index}.txt").write_text(prose(index, 100))
    (corpus / "heldout.txt").write_text(prose(99, 40))
    settings = {"model.compile": True, "precision": "bf16", "budget": 12 * 4 * 64}
    settings |= {"checkpoint_every": 4, "eval_every": 6, "data.eval_blocks": 4}

    selective = write_recipe(
        tmp_path / "selective", word_checkpoint, corpus, **settings, **{CHECKPOINTING: "selective"}
    )
    output, _ = launch_adapt(selective).communicate(timeout=240)
    run_dir = tmp_path / "selective" / "run"
    assert (run_dir / "model").is_dir(), own_lines(output)
    assert len(losses(run_dir)) == 12 and all(loss < 1e4 for loss in losses(run_dir)), losses(run_dir)

    full = write_recipe(tmp_path / "full", word_checkpoint, corpus, **settings, **{CHECKPOINTING: "full"})
    run_dir = tmp_path / "full" / "run"
    process = launch_adapt(full)
    deadline = time.monotonic() + 180
    while steps_logged(run_dir) < 2 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)  # to the launcher: torchrun passes it on and waits 300 s
    output, _ = process.communicate(timeout=240)
    assert "SIGTERM: stopped after step" in output, own_lines(output)
    kept = checkpoints(run_dir / "checkpoints")
    assert kept and json.loads((kept[-1] / STATE_FILE).read_text())["step"] == len(losses(run_dir)), own_lines(output)
    resumed = launch_adapt(full, "resume=true")
    output, _ = resumed.communicate(timeout=240)
    assert resumed.returncode == 0 and (run_dir / "model").is_dir(), own_lines(output)
    assert all(loss < 1e4 for loss in losses(run_dir)), losses(run_dir)


def test_adapt_loads_a_checkpoint_folder_where_gguf_is_not_installed(monkeypatch, word_checkpoint):
    """The lent GPU machine's image has no gguf, which only GGUF input needs (issue 42 item 1)."""
    from ladder.adapt.models import load_student

    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` raises ImportError, as where it is missing
    model, tokenizer, _ = load_student(word_checkpoint)
    assert model.config.num_hidden_layers == 4 and tokenizer.bos_token == "<s>"


@pytest.mark.parametrize("config", ACCELERATE_CONFIGS, ids=lambda path: path.name)
def test_every_accelerate_config_leaves_activation_checkpointing_to_the_recipe(config):
    """accelerate's own checkpointing would recompute every layer whatever the recipe (or its plan) chose,
    and on top of the recipe's own (issue 42 item 5)."""
    fsdp = yaml.safe_load(config.read_text()).get("fsdp_config") or {}
    assert fsdp.get("fsdp_activation_checkpointing", False) is False
