"""convert/: the real CLI on tiny checkpoints (copies of the `tiny_checkpoint` fixture, made sharded,
tied, pickled, broken), every bad input, SIGKILL and a full disk, and the embedded SmolLM2 once."""

import errno
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

import ladder
from benchmarks.common import write_synthetic_checkpoint
from checkpoints import copy_of, edit_config, edit_tensors, private_mount_namespace, run_convert, snapshot, write_gguf
from ladder import LadderLlamaForCausalLM, to_ladder
from ladder.convert import execute as convert_execute
from ladder.convert.checks import expected_shapes
from ladder.convert.execute import MODELING_FILES
from ladder.convert.plan import default_output_dir, ladder_config_dict
from ladder.convert.verify import Damage, damage_problems, measure_damage, prompt_ids
from ladder.io import tensors as tensor_io
from ladder.io.files import sha256_file
from ladder.io.loading import embedded_model_path
from tiny import random_ids

REPOSITORY = Path(__file__).resolve().parents[1]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def all_tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def resaved(checkpoint: Path, destination: Path, **save_options) -> Path:
    """The tiny checkpoint saved again by transformers (e.g. sharded), with its tokenizer."""
    LlamaForCausalLM.from_pretrained(checkpoint).save_pretrained(destination, **save_options)
    for name in TOKENIZER_FILES:
        shutil.copy(checkpoint / name, destination / name)
    return destination


def expected_logits(checkpoint: Path, ladder_layers: list[int], ids: torch.Tensor) -> torch.Tensor:
    original = LlamaForCausalLM.from_pretrained(checkpoint).eval()
    with torch.no_grad():
        return to_ladder(original, ladder_layers)(ids).logits


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
        "modeling_ladder_llama.py",
        "configuration_ladder_llama.py",
        "generation_config.json",
        "README.md",
        *TOKENIZER_FILES,
    ):
        assert (out / name).is_file(), name
    # Copied as is: the same bytes, so the same tensors and dtypes.
    assert sha256_file(out / "model.safetensors") == sha256_file(source / "model.safetensors")
    manifest = json.loads((out / "conversion.json").read_text())
    assert manifest["source_sha256"] == {"model.safetensors": sha256_file(source / "model.safetensors")}
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
    manifest = json.loads((tmp_path / "same" / "conversion.json").read_text())
    assert manifest["source_sha256"] == {name: before[name] for name in source_shards}

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


def test_pickle_weights_need_allow_pickle(tiny_checkpoint, tmp_path, capsys):
    source = copy_of(tiny_checkpoint, tmp_path / "pickled")
    tensors = load_file(source / "model.safetensors")
    torch.save(tensors, source / "pytorch_model.bin")
    (source / "model.safetensors").unlink()
    before = snapshot(source)

    code, _, stderr = run_convert(capsys, source, "--out", tmp_path / "out")
    assert code == 2 and "--allow-pickle" in stderr and not (tmp_path / "out").exists()
    code, stdout, _ = run_convert(capsys, source, "--out", tmp_path / "out", "--allow-pickle")
    assert code == 0 and "(pickle)" in stdout
    written = load_file(tmp_path / "out" / "model.safetensors")
    assert written.keys() == tensors.keys() and all(torch.equal(written[k], tensors[k]) for k in tensors)
    assert snapshot(source) == before


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
    "not-llama": (
        lambda src, work: edit_config(src, model_type="mistral") or src,
        [],
        "model_type 'mistral'; supported: 'llama' or 'llamaLadder'",
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
    "truncated": (lambda src, work: _truncate(src / "model.safetensors", 1_000_000) or src, [], "truncated"),
    "corrupt-header": (
        lambda src, work: _overwrite_start(src / "model.safetensors", b"\x10" + b"\0" * 7 + b"not json" * 2) or src,
        [],
        "the header is not JSON",
    ),
    "unexpected-tensor": (
        lambda src, work: edit_tensors(src, lambda t: t.update(extra=torch.zeros(2))) or src,
        [],
        "tensor extra is not part of a Llama with this config",
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
    write_synthetic_checkpoint(source, config, max_shard_size=20 * 2**20)  # ~190 MB in 10 shards
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


# --- Pieces --------------------------------------------------------------------------------------


def test_weight_files_copy_side_by_side_and_the_first_error_stops_the_others(tmp_path):
    # Files are copied (and hashed) at once on worker threads; when one fails, the others stop at
    # their next chunk instead of running to the end, and the error is the caller's.
    shards = [tensor_io.Shard(tmp_path / f"{index}", 0, ()) for index in range(3)]
    chunks_done = []

    def work(shard, progress):
        if shard.path.name == "1":
            time.sleep(0.05)
            raise OSError(errno.ENOSPC, "No space left on device")
        for chunk in range(10_000):
            progress(1)
            chunks_done.append(chunk)
            time.sleep(0.001)
        return "finished"

    bar = tqdm(file=io.StringIO())  # counts, prints nowhere
    with pytest.raises(OSError, match="No space left"):
        convert_execute._each_file(work, shards, bar)
    assert len(chunks_done) < 1_000 and bar.n == len(chunks_done)
    names = convert_execute._each_file(lambda shard, progress: shard.path.name, shards, bar)
    assert names == {name: name for name in ("0", "1", "2")}


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"attention_bias": True, "mlp_bias": True},
        {"head_dim": 32, "num_key_value_heads": 1},
        {"tie_word_embeddings": True, "num_key_value_heads": None},
    ],
)
def test_shapes_from_the_config_match_a_model_built_from_it(overrides):
    config = LlamaConfig(
        **{
            "vocab_size": 300,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            **overrides,
        }
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    assert expected_shapes(json.loads(config.to_json_string())) == {**expected, "lm_head.weight": (300, 64)}


def test_light_config_loads_as_what_save_pretrained_writes(tmp_path):
    """convert writes config.json and the modeling files without transformers: they must load to
    the config that `ladder_config(...).save_pretrained` (with custom_object_save) would give."""
    from transformers import AutoConfig
    from transformers.dynamic_module_utils import custom_object_save

    source = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=131072,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 5e5,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    source.save_pretrained(tmp_path / "source")
    heavy = ladder.ladder_config(source, [1, 3])
    heavy.architectures, heavy.dtype = ["LadderLlamaForCausalLM"], "bfloat16"
    with torch.device("meta"):
        skeleton = LadderLlamaForCausalLM(heavy)
    written = (
        custom_object_save(skeleton, tmp_path / "heavy", config=heavy) if (tmp_path / "heavy").mkdir() is None else []
    )
    heavy.save_pretrained(tmp_path / "heavy")
    light = ladder_config_dict(json.loads((tmp_path / "source" / "config.json").read_text()), [1, 3], "bfloat16")
    (tmp_path / "light").mkdir()
    convert_execute._write_config(tmp_path / "light", light)

    assert sorted(Path(p).name for p in written) == sorted(MODELING_FILES)
    for name in MODELING_FILES:
        assert (tmp_path / "light" / name).read_bytes() == (tmp_path / "heavy" / name).read_bytes()
    assert json.loads((tmp_path / "light" / "config.json").read_text())["auto_map"] == heavy.auto_map
    loaded = [
        {k: v for k, v in AutoConfig.from_pretrained(tmp_path / kind).to_dict().items() if k != "_name_or_path"}
        for kind in ("heavy", "light")
    ]
    assert loaded[0] == loaded[1] and loaded[1]["ladder_layers"] == [1, 3]


def test_copy_mode_imports_neither_torch_nor_transformers(tiny_checkpoint, tmp_path):
    script = (
        f"import sys; from ladder.cli import main; code = main(['convert', {str(tiny_checkpoint)!r}, '--out', "
        f"{str(tmp_path / 'out')!r}, '--no-verify']); "
        "heavy = sorted(m for m in ('torch', 'transformers', 'lm_eval', 'numpy') if m in sys.modules); "
        "print(code, heavy)"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip().splitlines()[-1] == "0 []", result.stdout + result.stderr
    manifest = json.loads((tmp_path / "out" / "conversion.json").read_text())
    assert manifest["weights"] == "copied"  # ext4 and tmpfs have no reflinks
    assert manifest["source_sha256"] == {"model.safetensors": sha256_file(tiny_checkpoint / "model.safetensors")}


def test_link_mode_hard_links_and_the_result_verifies(sharded_source, tmp_path, capsys):
    source = copy_of(sharded_source, tmp_path / "source")
    out = tmp_path / "out"
    code, stdout, _ = run_convert(capsys, source, "--out", out, "--layers", "2", "--weights", "link")
    assert code == 0 and "hard-linked" in stdout and "max |Δ| of hidden states before layer 2: 0" in stdout
    for shard in source.glob("*.safetensors"):
        assert os.path.samefile(shard, out / shard.name)
    manifest = json.loads((out / "conversion.json").read_text())
    assert manifest["weights"] == "hard-linked" and manifest["source_sha256"] is None
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


@pytest.mark.parametrize("extra", [[], ["--dtype", "bfloat16"]], ids=["as-is", "bf16"])
def test_layerwise_verification_measures_what_the_whole_models_measure(tiny_checkpoint, tmp_path, capsys, extra):
    # convert verifies one module at a time (bounded memory); the figures must be those of the two
    # whole models run through transformers, and a cast output is compared in its own rounding.
    out = tmp_path / "out"
    assert run_convert(capsys, tiny_checkpoint, "--out", out, "--layers", "2", *extra)[0] == 0
    recorded = json.loads((out / "conversion.json").read_text())["damage"]
    dtype = torch.bfloat16 if extra else torch.float32
    original = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=dtype).float().eval()
    ladder_model = AutoModelForCausalLM.from_pretrained(out).float().eval()
    whole = measure_damage(original, ladder_model, prompt_ids(AutoTokenizer.from_pretrained(out), 49152))
    assert whole.hidden_max_abs_diff == 0 and whole.mean_kl > 0 and whole.first_ladder_layer == 2
    for key, value in whole.__dict__.items():
        assert recorded[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_damage_problems_catch_differences_where_the_wiring_is_unchanged():
    clean = Damage(5, 100, 2, 0.0, 0.4, 0.8, 0.1)
    assert damage_problems(clean) == []
    assert "hidden states" in damage_problems(Damage(5, 100, 2, 1e-6, 0.4, 0.8, 0.1))[0]
    assert "logits" in damage_problems(Damage(5, 100, None, 0.0, 1e-7, 1.0, 0.0))[0]


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
