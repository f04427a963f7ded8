"""What the tests that run `ladder adapt` share: generated prose and chats, a recipe for the tiny
checkpoint, a run's metrics and weights, and the adapt command as a subprocess (one process, or
FSDP under `accelerate launch`) with the ways to watch it."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch
import yaml
from safetensors.torch import load_file

from ladder.adapt.recipe import SourceSpec
from ladder.launch import free_port

REPO = Path(__file__).resolve().parents[1]
FSDP_CONFIG = REPO / "recipes" / "accelerate" / "fsdp-cpu-2proc.yaml"
STEPS = 8  # a reference run's steps, 256 tokens each; checkpoints at steps 3 and 6


WORDS = (
    "the a house river lantern quiet walked under over she he they old new bright small letter "
    "morning evening garden window road stone bird spoke answered slowly again never always"
).split()


def prose(seed: int, paragraphs: int) -> str:
    rng = random.Random(seed)
    return "\n\n".join(
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60))).capitalize() + "." for _ in range(paragraphs)
    )


def write_recipe(directory: Path, checkpoint: Path, corpus: Path, **overrides) -> Path:
    recipe = {
        "model": {"path": str(checkpoint), "ladder_layers": 2},
        "data": {
            "train": [str(corpus / "train")],
            "eval": [str(corpus / "heldout.txt")],
            "seq_len": 64,
            "eval_blocks": 8,
            "cache_dir": str(directory / "cache"),
        },
        "budget": 8 * 4 * 64,
        "batch": {"micro_batch": 4, "grad_accum": 1},
        "optimizer": {"lr": 3e-3},
        "schedule": {"warmup_steps": 2, "decay": "cosine"},
        "checkpoint_every": 3,
        "eval_every": 4,
        "output_dir": str(directory / "run"),
        "logging": {"progress": False},
    }
    for key, value in overrides.items():
        node = recipe
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def chat_corpus(folder: Path, chat: list[dict]) -> Path:
    """A corpus whose training data is one chat record (`train/chats.jsonl`), with a held-out text."""
    (folder / "train").mkdir(parents=True)
    (folder / "train" / "chats.jsonl").write_text(json.dumps({"messages": chat}) + "\n")
    (folder / "heldout.txt").write_text("The wind rose over the hills at dawn. " * 300)
    return folder


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> list[float]:
    return [record["loss"] for record in metrics(run_dir) if "loss" in record]


def run_adapt(args: list[str], launcher: list[str] | None = None, **popen) -> subprocess.Popen:
    command = (launcher or [sys.executable]) + ["-m", "ladder.adapt.cli", *args]
    return subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)


def chats(count: int) -> list[dict]:
    """Chat records of every shape: a system turn, several exchanges, whitespace around contents, an
    empty assistant turn, ShareGPT's field names."""
    records = []
    for i in range(count):
        messages = [{"role": "system", "content": "Be brief."}] if i % 3 == 0 else []
        for turn in range(1 + i % 3):
            messages.append({"role": "user", "content": prose(i * 7 + turn, 1)})
            answer = prose(i * 7 + turn + 100, 1)
            messages.append(
                {"role": "assistant", "content": [answer, f"  {answer}\n\n", "", f"\n🦉 {answer} é🦉"][(i + turn) % 4]}
            )
        if i % 5 == 4:
            names = {"user": "human", "assistant": "gpt", "system": "system"}
            records.append({"messages": [{"from": names[m["role"]], "value": m["content"]} for m in messages]})
        else:
            records.append({"messages": messages})
    return records


def books(folder: Path, count: int = 60) -> list[SourceSpec]:
    """A chat file and a text file of many small documents, in many chunks."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chats(count)))
    (folder / "plain.txt").write_text("\n\n".join(prose(i, 1) for i in range(count)))
    return [
        SourceSpec(path=str(folder / "chats.jsonl")),
        SourceSpec(path=str(folder / "plain.txt"), documents="blank_line"),
    ]


def fsdp_launcher() -> list[str]:
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(FSDP_CONFIG),
        "--main_process_port",
        str(free_port()),
    ]


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "model" / "model.safetensors")


def wait_for_losses(process: subprocess.Popen, run_dir: Path, count: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        if (run_dir / "metrics.jsonl").exists() and len(losses(run_dir)) >= count:
            return
        time.sleep(0.05)


def ranks(launcher: subprocess.Popen) -> list[psutil.Process]:
    """The training processes `accelerate launch` started (torchrun's workers)."""
    return [child for child in psutil.Process(launcher.pid).children() if "LOCAL_RANK" in child.environ()]


def assert_preempted(output: str, run_dir: Path, recipe: Path, signal_name: str) -> int:
    """The run said where it stopped and how to resume, and left complete checkpoints only; returns the step."""
    said = [line for line in output.splitlines() if "resume with:" in line]
    assert len(said) == 1, output
    step = len(losses(run_dir))
    checkpoint = run_dir / "checkpoints" / f"step-{step:06d}"
    assert said[0].startswith(f"ladder adapt: {signal_name}: stopped after step {step} with a checkpoint there, ")
    assert said[0].split(", ")[-1].startswith(f"{checkpoint}; resume with: ladder adapt {recipe} resume=true")
    assert (checkpoint / "trainer_state.json").is_file() and not (run_dir / "model").exists()
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")], "a temporary was left"
    return step
