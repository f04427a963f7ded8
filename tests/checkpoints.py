"""What the tests of convert/ and of the checkpoints it reads share: the CLI with its output captured,
a folder's digests, copies and edits of a checkpoint, a GGUF file of any architecture, and a private
mount namespace for a small tmpfs, and a Hub cache laid out as `hf download` leaves it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from ladder.cli import main as ladder_main
from ladder.io.files import sha256_file


def run_convert(capsys, *args) -> tuple[int, str, str]:
    code = ladder_main(["convert", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def resaved(checkpoint: Path, destination: Path, **save_options) -> Path:
    """A checkpoint saved again by transformers (e.g. sharded), with its tokenizer."""
    from transformers import LlamaForCausalLM

    LlamaForCausalLM.from_pretrained(checkpoint).save_pretrained(destination, **save_options)
    for name in TOKENIZER_FILES:
        shutil.copy(checkpoint / name, destination / name)
    return destination


def snapshot(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): sha256_file(p) for p in sorted(directory.rglob("*")) if p.is_file()}


def copy_of(checkpoint: Path, destination: Path) -> Path:
    return Path(shutil.copytree(checkpoint, destination))


def write_gguf(path: Path, architecture: str, tensor_type: gguf.GGMLQuantizationType, block_count: int = 2) -> Path:
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(block_count)
    _, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
    writer.add_tensor("token_embd.weight", np.zeros((2, type_size), dtype=np.uint8), raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def edit_config(source: Path, **changes) -> None:
    config = json.loads((source / "config.json").read_text())
    config.update(changes)
    (source / "config.json").write_text(json.dumps(config))


def edit_tensors(source: Path, edit) -> None:
    tensors = load_file(source / "model.safetensors")
    edit(tensors)
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})


def private_mount_namespace() -> list[str]:
    """A private mount namespace, so the test can mount a small tmpfs that vanishes with it."""
    prefix = ["unshare", "--mount", "--propagation", "private"]
    if os.geteuid() != 0:
        prefix = ["unshare", "--user", "--map-root-user", "--mount"]
    if (
        shutil.which("unshare") is None
        or subprocess.run([*prefix, "mount", "-t", "tmpfs", "tmpfs", "/mnt"], capture_output=True).returncode != 0
    ):
        pytest.skip("cannot mount a tmpfs in a private mount namespace here")
    return prefix


# The commit of every snapshot `cache_hub_model` lays out.
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_hub_model(cache: Path, repo: str, checkpoint: Path, files=("config.json", "model.safetensors")) -> Path:
    """Lay `checkpoint` into a Hub cache as `hf download` leaves it: blobs, a snapshot of links, refs/main."""
    storage = cache / f"models--{repo.replace('/', '--')}"
    snapshot = storage / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (storage / "blobs").mkdir()
    for name in files:
        blob = storage / "blobs" / name.replace(".", "-")
        shutil.copyfile(checkpoint / name, blob)
        (snapshot / name).symlink_to(Path("..", "..", "blobs", blob.name))
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(COMMIT)
    return snapshot
