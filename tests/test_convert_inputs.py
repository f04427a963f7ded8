"""convert/ refuses bad input in one line, before any work, writing nothing and leaving the source
untouched; a SIGKILL or a full disk leaves no output."""

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import gguf
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from checkpoints import (
    copy_of,
    edit_config,
    edit_tensors,
    private_mount_namespace,
    resaved,
    run_convert,
    snapshot,
    write_gguf,
)
from ladder.io.files import sha256_file

# --- Bad input: one line, exit 2, nothing written, the source untouched ----------------------------


def _overwrite_start(path: Path, data: bytes) -> None:
    with open(path, "r+b") as handle:
        handle.write(data)


def _truncate(path: Path, keep: int) -> None:
    with open(path, "r+b") as handle:
        handle.truncate(keep)


BAD_INPUTS = {
    # name: (make the source in `work` from a copy of the tiny checkpoint `src`, extra args, message)
    "missing-path": (lambda src, work: work / "nowhere", [], "does not exist"),
    "unsupported-family": (
        lambda src, work: edit_config(src, model_type="gemma") or src,
        [],
        "model_type 'gemma'; supported families: llama, mistral, qwen2, qwen3 (and their ladder forms",
    ),
    "layers-out-of-range": (lambda src, work: src, ["--layers", "5"], "0 <= N <= 4"),
    "layer-index-out-of-range": (lambda src, work: src, ["--layers", "2-4"], "out of range"),
    "layers-duplicated": (lambda src, work: src, ["--layers", "1,1"], "duplicate"),
    "layers-not-a-number": (lambda src, work: src, ["--layers", "upper"], "is not a number"),
    "out-inside-source": (lambda src, work: src, ["--out", "{src}/ladder"], "overlaps the input"),
    "out-is-source": (lambda src, work: src, ["--out", "{src}", "--force"], "overlaps the input"),
    "out-contains-source": (lambda src, work: src, ["--out", "{work}", "--force"], "overlaps the input"),
    "shard-missing": (
        lambda src, work: sorted((work / "sharded").glob("*.safetensors"))[1].unlink() or work / "sharded",
        [],
        "model-00002-of-00003.safetensors named in model.safetensors.index.json is missing",
    ),
    "truncated": (
        lambda src, work: _truncate(src / "model.safetensors", 1_000_000) or src,
        [],
        "not a valid safetensors file: Error while deserializing header: incomplete metadata",
    ),
    "corrupt-header": (
        lambda src, work: _overwrite_start(src / "model.safetensors", b"\x10" + b"\0" * 7 + b"not json" * 2) or src,
        [],
        "invalid JSON in header",
    ),
    "pickle-weights": (
        lambda src, work: (src / "model.safetensors").rename(src / "pytorch_model.bin") and src,
        [],
        "has no safetensors weights",
    ),
    "unexpected-tensor": (
        lambda src, work: edit_tensors(src, lambda t: t.update(extra=torch.zeros(2))) or src,
        [],
        "tensor extra is not part of a llama model with this config",
    ),
    "missing-tensor": (
        lambda src, work: edit_tensors(src, lambda t: t.pop("model.norm.weight")) or src,
        [],
        "lacks 1 tensor(s) its config needs: model.norm.weight",
    ),
    "wrong-shape": (
        lambda src, work: edit_config(src, intermediate_size=96) or src,
        [],
        "has shape [128, 64]; the config needs [96, 64]",
    ),
    "gguf-other-architecture": (
        lambda src, work: write_gguf(work / "m.gguf", "gpt2", gguf.GGMLQuantizationType.F32),
        [],
        "holds a 'gpt2' model; only the 'llama' architecture converts",
    ),
    "gguf-unsupported-type": (
        lambda src, work: write_gguf(work / "m.gguf", "llama", gguf.GGMLQuantizationType.Q8_K),
        [],
        "quantization type Q8_K, which gguf",
    ),
    "bad-shard-size": (lambda src, work: src, ["--max-shard-size", "lots"], "is not a size like 5GB"),
    "bad-dtype": (lambda src, work: src, ["--dtype", "int8"], "invalid choice: 'int8'"),
}


@pytest.fixture(scope="module")
def sharded_source(tiny_checkpoint, tmp_path_factory) -> Path:
    return resaved(tiny_checkpoint, tmp_path_factory.mktemp("sharded") / "sharded", max_shard_size="5MB")


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_and_writes_nothing(case, tiny_checkpoint, sharded_source, tmp_path, capsys):
    make, extra, message = BAD_INPUTS[case]
    work = tmp_path / "work"
    source_copy = copy_of(tiny_checkpoint, work / "src")
    shutil.copytree(sharded_source, work / "sharded")
    source = make(source_copy, work)
    before = snapshot(work)
    extra = [arg.format(src=source_copy, work=work) for arg in extra]
    out = [] if "--out" in extra else ["--out", tmp_path / "out"]
    code, stdout, stderr = run_convert(capsys, source, *out, *extra)
    assert code == 2, stdout + stderr
    assert message in stderr and stderr.count("\n") == 1, stderr
    assert stderr.startswith("ladder convert: error: ")
    assert snapshot(work) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]


def test_console_command_prints_no_traceback(tmp_path):
    result = subprocess.run(
        [str(Path(sys.executable).parent / "ladder"), "convert", str(tmp_path / "nowhere")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "does not exist" in result.stderr


# --- Interruptions -------------------------------------------------------------------------------


def test_sigkill_mid_copy_leaves_no_output_and_a_rerun_works(tmp_path, capsys):
    source = tmp_path / "big"
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(source, max_shard_size="20MB")  # ~190 MB in 10 shards
    shards = {p.name: p.stat().st_size for p in source.glob("*.safetensors")}
    out = tmp_path / "out"
    child = subprocess.Popen(
        [
            "nice",
            "-n",
            "19",
            sys.executable,
            "-m",
            "ladder.cli",
            "convert",
            str(source),
            "--out",
            str(out),
            "--no-verify",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".out.tmp-*/*.safetensors")):  # the copy has begun
        assert child.poll() is None and time.monotonic() < deadline, "the conversion ended before it was killed"
        time.sleep(0.001)
    child.send_signal(signal.SIGKILL)
    assert child.wait() == -signal.SIGKILL
    assert not out.exists()
    [leftover] = tmp_path.glob(".out.tmp-*")
    complete = [p for p in leftover.glob("*.safetensors") if p.stat().st_size == shards[p.name]]
    assert len(complete) < len(shards), "killed after the copy finished: not mid-copy"

    code, _, _ = run_convert(capsys, source, "--out", out, "--no-verify")
    assert code == 0 and not leftover.exists()
    for name in shards:
        assert sha256_file(out / name) == sha256_file(source / name)


def test_full_disk_is_one_line_and_leaves_nothing(tiny_checkpoint, tmp_path):
    """A real ENOSPC: the output goes to a 12 MB tmpfs (the weights need 26 MB)."""
    prefix = private_mount_namespace()
    disk = tmp_path / "disk"
    disk.mkdir()
    script = (
        f"mount -t tmpfs -o size=12m tmpfs {disk} && {sys.executable} -m ladder.cli convert "
        f"{tiny_checkpoint} --out {disk}/out --no-verify; echo exit=$?; ls -A {disk}"
    )
    result = subprocess.run([*prefix, "sh", "-c", script], capture_output=True, text=True, timeout=300)
    assert result.stdout.strip() == "exit=2", result.stdout + result.stderr  # and `ls` listed nothing
    assert result.stderr.strip() == f"ladder convert: error: no space left on the device while writing {disk}/out"
