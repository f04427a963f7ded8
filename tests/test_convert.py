"""convert/: the real CLI on tiny checkpoints (copies of the `tiny_checkpoint` fixture, made sharded
or tied), the weight modes (copy, hard links), and the embedded SmolLM2 once."""

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

import ladder
from checkpoints import TOKENIZER_FILES, copy_of, resaved, run_convert, snapshot
from ladder import LadderLlamaForCausalLM, to_ladder
from ladder.convert.layout import default_output_dir
from ladder.io.files import sha256_file
from ladder.io.loading import embedded_model_path
from tiny import random_ids

REPOSITORY = Path(__file__).resolve().parents[1]


def all_tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def expected_logits(checkpoint: Path, ladder_layers: list[int], ids: torch.Tensor) -> torch.Tensor:
    original = LlamaForCausalLM.from_pretrained(checkpoint).eval()
    with torch.no_grad():
        return to_ladder(original, ladder_layers)(ids).logits


@pytest.fixture(scope="module")
def sharded_source(tiny_checkpoint, tmp_path_factory) -> Path:
    return resaved(tiny_checkpoint, tmp_path_factory.mktemp("sharded") / "sharded", max_shard_size="5MB")


# --- Conversions that work ---------------------------------------------------------------------


def test_tiny_checkpoint_end_to_end(tiny_checkpoint, tmp_path, capsys):
    source = copy_of(tiny_checkpoint, tmp_path / "tiny")
    before = snapshot(source)
    out = tmp_path / "out"
    code, stdout, _ = run_convert(capsys, source, "--out", out, "--layers", "2")
    assert code == 0
    assert snapshot(source) == before
    assert "ladder layers  2 of 4: 2-3" in stdout and "copied: 39 tensors, float32" in stdout
    assert "max |Δ| of hidden states before layer 2: 0 (must be 0)" in stdout

    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llamaLadder" and config["ladder_layers"] == [2, 3]
    assert set(config["auto_map"]) == {"AutoConfig", "AutoModelForCausalLM"}
    for name in (
        "modeling_ladder.py",
        "configuration_ladder.py",
        "generation_config.json",
        "README.md",
        *TOKENIZER_FILES,
    ):
        assert (out / name).is_file(), name
    # Copied as is: the same bytes, so the same tensors and dtypes.
    assert sha256_file(out / "model.safetensors") == sha256_file(source / "model.safetensors")
    manifest = json.loads((out / "conversion.json").read_text())
    assert manifest["ladder_layers"] == [2, 3] and manifest["weights"] == "copied"
    assert manifest["version"] == ladder.__version__ and manifest["damage"]["hidden_max_abs_diff"] == 0
    assert 0 < manifest["damage"]["top1_agreement"] <= 1 and manifest["damage"]["mean_kl"] > 0
    assert "2 of its 4 layers are rewired (2-3)" in (out / "README.md").read_text()

    ids = random_ids(vocab_size=1000)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert isinstance(model, LadderLlamaForCausalLM)
    with torch.no_grad():
        logits = model(ids).logits
        generated = model.generate(ids[:1], max_new_tokens=5, do_sample=False)
    assert torch.equal(logits, expected_logits(source, [2, 3], ids))
    torch.save({"ids": ids, "logits": logits, "generated": generated}, tmp_path / "expected.pt")

    # Elsewhere, without the ladder package: remote code, from the files in OUT only.
    script = f"""
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
expected = torch.load({str(tmp_path / "expected.pt")!r})
model = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True).eval()
tokenizer = AutoTokenizer.from_pretrained({str(out)!r}, trust_remote_code=True)
assert "ladder" not in sys.modules and type(model).__module__.startswith("transformers_modules")
with torch.no_grad():
    assert torch.equal(model(expected["ids"]).logits, expected["logits"])
    generated = model.generate(expected["ids"][:1], max_new_tokens=5, do_sample=False)
assert torch.equal(generated, expected["generated"])
print("ok", model.config.ladder_layers, tokenizer("Hello world")["input_ids"])
"""
    environment = {**os.environ, "HF_HOME": str(tmp_path / "hf_home")}
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    hello = AutoTokenizer.from_pretrained(source)("Hello world")["input_ids"]
    assert f"ok [2, 3] {hello}" in result.stdout


def test_sharded_source_keeps_its_shards_or_reshards_on_request(tiny_checkpoint, tmp_path, capsys):
    source = resaved(tiny_checkpoint, tmp_path / "sharded", max_shard_size="5MB")
    source_shards = sorted(p.name for p in source.glob("*.safetensors"))
    assert len(source_shards) > 2
    before = snapshot(source)

    code, stdout, _ = run_convert(capsys, source, "--out", tmp_path / "same", "--no-verify")
    assert code == 0 and "copied" in stdout and "damage         skipped: --no-verify" in stdout
    for name in source_shards:
        assert sha256_file(tmp_path / "same" / name) == before[name]
    index = json.loads((tmp_path / "same" / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == json.loads((source / "model.safetensors.index.json").read_text())["weight_map"]

    out = tmp_path / "bf16"
    code, stdout, _ = run_convert(capsys, source, "--out", out, "--dtype", "bfloat16", "--max-shard-size", "3MB")
    assert code == 0 and "rewritten" in stdout and "bfloat16" in stdout
    original, converted = all_tensors(source), all_tensors(out)
    assert converted.keys() == original.keys()
    for name, tensor in original.items():
        assert converted[name].dtype == torch.bfloat16 and torch.equal(converted[name], tensor.to(torch.bfloat16))
    for path in out.glob("*.safetensors"):  # at most 3 MB, unless one tensor is larger on its own
        assert path.stat().st_size <= 3_000_000 + 4096 or len(load_file(path)) == 1
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert json.loads((out / "conversion.json").read_text())["damage"]["hidden_max_abs_diff"] == 0
    assert snapshot(source) == before


def test_tied_embeddings_with_a_stored_lm_head(tmp_path, capsys, smollm2_tokenizer_dir):
    """A tied model whose file also holds lm_head.weight (some checkpoints do): dropped on purpose."""
    source = tmp_path / "tied"
    from tiny import tiny_llama

    model = tiny_llama(tie_word_embeddings=True, vocab_size=300, num_hidden_layers=4)
    model.save_pretrained(source)
    tensors = load_file(source / "model.safetensors")
    assert "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # old checkpoints stored it
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})

    code, stdout, _ = run_convert(capsys, source, "--out", tmp_path / "out", "--layers", "1-2")
    assert code == 0, stdout
    assert "lm_head.weight (tied to model.embed_tokens.weight)" in stdout and "rewritten" in stdout
    written = load_file(tmp_path / "out" / "model.safetensors")
    assert "lm_head.weight" not in written and not any("inv_freq" in name for name in written)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert loaded.config.ladder_layers == [1, 2]
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    assert torch.equal(loaded.model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_no_ladder_layers_reproduces_the_logits_exactly(tiny_checkpoint, tmp_path, capsys):
    code, stdout, _ = run_convert(capsys, tiny_checkpoint, "--out", tmp_path / "out", "--layers", "0")
    assert code == 0 and "max |Δ| of logits: 0 (must be 0)" in stdout
    ids = random_ids(vocab_size=1000)
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(tmp_path / "out")(ids).logits
        original = LlamaForCausalLM.from_pretrained(tiny_checkpoint)(ids).logits
    assert torch.equal(logits, original)


@pytest.mark.parametrize("spec, layers", [("1", [3]), ("0-1", [0, 1]), ("3,0", [0, 3])])
def test_layer_forms(tiny_checkpoint, tmp_path, capsys, spec, layers):
    code, _, _ = run_convert(capsys, tiny_checkpoint, "--out", tmp_path / "out", "--layers", spec, "--no-verify")
    assert code == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["ladder_layers"] == layers


def test_existing_output_needs_force_and_force_replaces_only_a_conversion(tiny_checkpoint, tmp_path, capsys):
    """--force deleted any folder, also one holding other models (issue 28, item 4)."""
    models = tmp_path / "models"
    (models / "llama").mkdir(parents=True)
    (models / "llama" / "model.safetensors").write_text("mine")
    code, _, stderr = run_convert(capsys, tiny_checkpoint, "--out", models, "--no-verify")
    assert code == 2 and "--force" in stderr
    code, _, stderr = run_convert(capsys, tiny_checkpoint, "--out", models, "--no-verify", "--force")
    assert code == 2 and stderr.count("\n") == 1 and "replaces only an earlier output of `ladder convert`" in stderr
    assert [str(p.relative_to(models)) for p in models.rglob("*")] == ["llama", "llama/model.safetensors"]
    out = tmp_path / "out"
    assert run_convert(capsys, tiny_checkpoint, "--out", out, "--no-verify", "--layers", "1")[0] == 0
    assert run_convert(capsys, tiny_checkpoint, "--out", out, "--no-verify", "--force")[0] == 0
    assert json.loads((out / "conversion.json").read_text())["ladder_layers"] == [2, 3]


def test_copy_mode_imports_neither_torch_nor_transformers(tiny_checkpoint, tmp_path):
    script = (
        f"import sys; from ladder.cli import main; code = main(['convert', {str(tiny_checkpoint)!r}, '--out', "
        f"{str(tmp_path / 'out')!r}, '--no-verify']); "
        "heavy = sorted(m for m in ('torch', 'transformers', 'lm_eval') if m in sys.modules); "
        "print(code, heavy)"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip().splitlines()[-1] == "0 []", result.stdout + result.stderr
    manifest = json.loads((tmp_path / "out" / "conversion.json").read_text())
    assert manifest["weights"] == "copied"
    assert sha256_file(tmp_path / "out" / "model.safetensors") == sha256_file(tiny_checkpoint / "model.safetensors")


def test_link_mode_hard_links_and_the_result_verifies(sharded_source, tmp_path, capsys):
    source = copy_of(sharded_source, tmp_path / "source")
    out = tmp_path / "out"
    code, stdout, _ = run_convert(capsys, source, "--out", out, "--layers", "2", "--weights", "link")
    assert code == 0 and "hard-linked" in stdout and "max |Δ| of hidden states before layer 2: 0" in stdout
    for shard in source.glob("*.safetensors"):
        assert os.path.samefile(shard, out / shard.name)
    manifest = json.loads((out / "conversion.json").read_text())
    assert manifest["weights"] == "hard-linked"
    # Replacing the output (--force) removes only its own names: the source's files stay.
    assert run_convert(capsys, source, "--out", out, "--no-verify", "--force", "--weights", "copy")[0] == 0
    assert all(not os.path.samefile(s, out / s.name) for s in source.glob("*.safetensors"))
    assert snapshot(source) == snapshot(sharded_source)


def test_link_mode_refuses_what_it_cannot_link(tiny_checkpoint, tmp_path, capsys):
    code, _, stderr = run_convert(
        capsys, tiny_checkpoint, "--out", tmp_path / "cast", "--dtype", "bfloat16", "--weights", "link"
    )
    assert code == 2 and "the weights are rewritten here" in stderr and not (tmp_path / "cast").exists()
    other = Path("/dev/shm")
    if not other.is_dir() or other.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("no second filesystem (/dev/shm) to link across")
    out = other / f"ladder-test-{os.getpid()}"
    code, _, stderr = run_convert(capsys, tiny_checkpoint, "--out", out, "--weights", "link")
    assert code == 2 and "hard links cannot cross filesystems" in stderr and not out.exists()


# --- The embedded SmolLM2 (`make convert` with no arguments) -------------------------------------


def test_default_conversion_of_the_embedded_smollm2(tmp_path, monkeypatch, capsys, gguf_parses):
    makefile = (REPOSITORY / "Makefile").read_text()
    default = re.search(r"^DEFAULT_LADDER := (\S+)$", makefile, re.MULTILINE).group(1)
    assert str(default_output_dir(embedded_model_path(), 15)) == default
    monkeypatch.chdir(tmp_path)
    counting_reader = gguf.GGUFReader
    code, stdout, _ = run_convert(capsys)
    assert code == 0
    # Read for its checks, its tokenizer, config and weights, and its licence: parsed once.
    assert len(gguf_parses) == 1 and gguf.GGUFReader is counting_reader
    out = tmp_path / default
    assert "ladder layers  15 of 30: 15-29" in stdout and "lm_head.weight (tied" in stdout
    assert "max |Δ| of hidden states before layer 15: 0 (must be 0)" in stdout
    damage = json.loads((out / "conversion.json").read_text())["damage"]
    # Half the layers rewired without retraining: clearly damaged, far from random (1/49152).
    assert 0.3 < damage["top1_agreement"] < 1 and 0 < damage["mean_kl"] < 3

    script = f"""
import sys
from transformers import AutoModelForCausalLM, AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained({str(out)!r}, trust_remote_code=True)
model = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True).eval()
assert "ladder" not in sys.modules
chat = tokenizer.apply_chat_template([{{"role": "user", "content": "Write one sentence about the sea."}}],
                                     add_generation_prompt=True, return_tensors="pt", return_dict=True)
output = model.generate(**chat, max_new_tokens=16, do_sample=False)
print(tokenizer.decode(output[0, chat["input_ids"].shape[1]:], skip_special_tokens=True))
"""
    environment = {**os.environ, "HF_HOME": str(tmp_path / "hf_home")}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    words = re.findall(r"[A-Za-z]+", result.stdout)
    assert len(words) >= 3, result.stdout


def test_conversion_differences_names_what_a_new_request_changes(tmp_path):
    """What makes an existing conversion stale (the demo's check): another source, other layers,
    or another `auto:N` request; the layers an `auto:N` search chose stand for that request."""
    from ladder.convert.convert import conversion_differences

    source, other, out = tmp_path / "source", tmp_path / "other", tmp_path / "out"
    for directory in (source, other, out):
        directory.mkdir()
    for directory in (source, other):
        (directory / "config.json").write_text("{}")
    manifest = {"source": str(source.resolve()), "num_hidden_layers": 30, "ladder_layers": [20, 21, 22, 23]}
    (out / "conversion.json").write_text(json.dumps(manifest))
    assert conversion_differences(out, source, "20-23") == []
    assert conversion_differences(out, source, 4) == ["ladder_layers"]  # the upper 4 are 26-29
    assert conversion_differences(out, other, "20-23") == ["source"]
    assert conversion_differences(out, source, "auto:4") == ["ladder_layers"]  # not searched
    manifest["layer_search"] = {"spec": "auto:4", "chosen": [20, 21, 22, 23]}
    (out / "conversion.json").write_text(json.dumps(manifest))
    assert conversion_differences(out, source, "auto:4") == []
    assert conversion_differences(out, source, "auto:4:any") == ["ladder_layers"]
    assert conversion_differences(out, source, "auto:5") == ["ladder_layers"]
    assert conversion_differences(tmp_path / "nothing", source, 4) == ["conversion.json (missing)"]
