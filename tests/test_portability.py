"""Checkpoints that travel: a converted checkpoint is read the same way outside this environment.

- With `trust_remote_code=True` in transformers 5.16.1 (the oldest the shipped modeling file
  supports; vLLM's CPU build needs >=5.16.1,<5.20) and 5.25.0 (the newest), where `ladder` is not
  installed: logits and greedy tokens (KV cache) equal this package's model.
- By a transformers 4.47 reader (what the official ladder code targets): config.json gives it the
  same RoPE, so it computes the same logits.

Each reader runs in its own virtual environment, `.venv-compat/transformers-VERSION`, built by
`make compat` from tests/compat/transformers-VERSION.txt (`make test` builds them first); the
workers it runs are in tests/compat/. Without that environment the test is skipped.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from ladder import LadderLlamaForCausalLM
from ladder.convert.convert import convert_checkpoint
from tiny import random_ids

# Needs the other transformers versions (.venv-compat), which `make test` builds: `make test-fast` skips it.
pytestmark = pytest.mark.envs

REPOSITORY = Path(__file__).resolve().parents[1]
WORKERS = REPOSITORY / "tests" / "compat"

OLDEST_TRANSFORMERS_5 = "5.16.1"
NEWEST_TRANSFORMERS_5 = "5.25.0"
TRANSFORMERS_4 = "4.47.1"

# RoPE as SmolLM2 has it (only rope_theta differs from the default) and as Llama 3.1 has it.
ROPE_VARIANTS = {
    "rope-theta": {"rope_type": "default", "rope_theta": 100000.0},
    "rope-llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}


def compat_python(version: str) -> Path:
    python = REPOSITORY / ".venv-compat" / f"transformers-{version}" / "bin" / "python"
    if not python.is_file():
        pytest.skip(f"no transformers {version} environment: run `make compat`")
    return python


@pytest.fixture(scope="module")
def converted(tiny_checkpoint, tmp_path_factory) -> dict[str, Path]:
    """`ladder convert` outputs (upper 2 of 4 layers ladder) of the tiny checkpoint, one per RoPE variant."""
    root = tmp_path_factory.mktemp("portable")
    outputs = {}
    for name, rope in ROPE_VARIANTS.items():
        source = Path(shutil.copytree(tiny_checkpoint, root / f"source-{name}"))
        config = json.loads((source / "config.json").read_text())
        config["rope_parameters"] = rope
        (source / "config.json").write_text(json.dumps(config))
        outputs[name] = root / f"ladder-{name}"
        convert_checkpoint(source, outputs[name], ladder_layers=2, verify=False)  # compared below instead
    return outputs


@pytest.fixture(scope="module")
def input_ids(tmp_path_factory) -> tuple[torch.Tensor, Path]:
    ids = random_ids(batch=2, length=16, vocab_size=49152)
    path = tmp_path_factory.mktemp("ids") / "input_ids.pt"
    torch.save(ids, path)
    return ids, path


def run_worker(python: Path, worker: str, ids_path: Path, checkpoints: list[Path], tmp_path: Path) -> dict:
    """Run a worker in a clean process: no PYTHONPATH, outside the repository (so `ladder` cannot
    be imported), with a private HF cache for the remote code it copies."""
    output = tmp_path / "result.pt"
    environment = {key: value for key, value in os.environ.items() if not key.startswith("PYTHON")}
    environment.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    completed = subprocess.run(
        [str(python), str(WORKERS / worker), str(ids_path), str(output), *map(str, checkpoints)],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return torch.load(output)


@pytest.fixture(scope="module")
@torch.no_grad()
def ours(converted, input_ids) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each converted checkpoint's logits and greedy tokens in this package's model, once."""
    ids, outputs = input_ids[0], {}
    for name, checkpoint in converted.items():
        model = LadderLlamaForCausalLM.from_pretrained(checkpoint).eval()
        generated = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8, do_sample=False
        )
        outputs[name] = model(ids).logits, generated
    return outputs


@pytest.mark.parametrize("version", [OLDEST_TRANSFORMERS_5, NEWEST_TRANSFORMERS_5])
def test_remote_code_loads_in_other_transformers(version, converted, input_ids, ours, tmp_path):
    ids, ids_path = input_ids
    results = run_worker(compat_python(version), "load_remote.py", ids_path, list(converted.values()), tmp_path)
    assert results["transformers"] == version
    for name, checkpoint in converted.items():
        result = results[str(checkpoint)]
        # Built from the files the checkpoint carries, not from an installed package.
        assert result["model_module"].startswith("transformers_modules."), result["model_module"]
        logits, generated = ours[name]
        torch.testing.assert_close(result["logits"], logits, rtol=0, atol=1e-5, msg=f"{name} on {version}")
        assert torch.equal(result["generated"], generated), f"{name} on {version}: greedy tokens differ"


def test_transformers4_reader_reads_the_same_model(converted, input_ids, tmp_path):
    ids, ids_path = input_ids
    python = compat_python(TRANSFORMERS_4)
    results = run_worker(python, "read_with_transformers4.py", ids_path, list(converted.values()), tmp_path)
    assert results["transformers"] == TRANSFORMERS_4
    for name, checkpoint in converted.items():
        result = results[str(checkpoint)]
        rope = dict(ROPE_VARIANTS[name])
        assert result["rope_theta"] == rope.pop("rope_theta")
        assert result["rope_scaling"] == (rope if rope["rope_type"] != "default" else None)
        model = LadderLlamaForCausalLM.from_pretrained(checkpoint).eval()
        torch.testing.assert_close(result["inv_freq"], model.model.rotary_emb.inv_freq, rtol=0, atol=0)
        with torch.no_grad():
            logits = model(ids).logits
        torch.testing.assert_close(result["logits"], logits, rtol=0, atol=1e-5, msg=name)
