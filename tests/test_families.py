"""Every supported family (Llama, Mistral, Qwen2, Qwen3) through the ladder model and the stages, on
tiny random checkpoints made by transformers' own classes (tiny.family_config): the ladder model
with no ladder layers is the family's model, with ladder layers it is the wiring written plainly,
the KV cache changes no token; `ladder convert` writes the family's ladder config, which loads with
and without this package; an unsupported family is refused; adapt (with `auto:N`), sample and eval
run on a Qwen3. Mistral and Qwen2 slide their attention over a window shorter than the sequences."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from eval_runs import ladder_eval
from transformers import AutoModelForCausalLM, Phi3Config

from adapt_runs import write_recipe
from checkpoints import run_convert
from ladder import to_ladder
from ladder.adapt.recipe import load_recipe
from ladder.adapt.train import train
from ladder.cli import main as ladder_main
from ladder.model.auto import LADDER_CLASSES
from tiny import NUM_LAYERS, random_ids, save_tiny_checkpoint, save_word_tokenizer, tiny_model

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
CLASS_NAMES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}
# Windows shorter than the 12-token sequences: Mistral's attention slides on every layer, Qwen2's on
# the layers from max_window_layers up (its layer_types), Llama's and Qwen3's never.
WINDOW = 4
SLIDING = {
    "llama": {},
    "mistral": {"sliding_window": WINDOW},
    "qwen2": {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 2},
    "qwen3": {},
}
LADDER_LAYERS = [1, 3, 4]  # a ladder layer after a standard one, then a block of two
REPOSITORY = Path(__file__).resolve().parents[1]


def family_model(family: str) -> torch.nn.Module:
    return tiny_model(family, **SLIDING[family])


def slides(family: str, layer: int) -> bool:
    return family == "mistral" or (family == "qwen2" and layer >= SLIDING["qwen2"]["max_window_layers"])


@torch.no_grad()
def naive_ladder_logits(model: torch.nn.Module, family: str, ladder_layers: list[int], ids: torch.Tensor):
    """The wiring (shared/docs/ladder.md) written plainly over the family model's own modules, each
    layer's mask built here: causal, and within the window where the family's layer slides."""
    inner, length = model.model, ids.shape[1]
    positions = torch.arange(length)[None]
    query, key = positions[0][:, None], positions[0][None]
    embeddings = inner.embed_tokens(ids)
    rotary = inner.rotary_emb(embeddings, positions)
    attn_stream = mlp_stream = embeddings
    for index, layer in enumerate(inner.layers):
        allowed = (key <= query) & ((query - key < WINDOW) | (not slides(family, index)))
        mask = torch.zeros(length, length).masked_fill(~allowed, float("-inf"))[None, None]
        is_ladder = index in ladder_layers
        attention = layer.self_attn(
            hidden_states=layer.input_layernorm(attn_stream if is_ladder else mlp_stream),
            attention_mask=mask,
            position_ids=positions,
            position_embeddings=rotary,
        )[0]
        new_attn_stream = mlp_stream + attention
        mlp = layer.mlp(layer.post_attention_layernorm(mlp_stream if is_ladder else new_attn_stream))
        attn_stream, mlp_stream = new_attn_stream, new_attn_stream + mlp
    return model.lm_head(inner.norm(mlp_stream))


# --- the model ----------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_no_ladder_layers_is_the_family_model(family):
    base = family_model(family)
    model = to_ladder(base, [])
    assert type(model) is LADDER_CLASSES[family][2] and model.config.model_type == f"{family}Ladder"
    ids = random_ids()
    with torch.no_grad():
        assert (model(ids).logits - base(ids).logits).abs().max() == 0


def test_a_mistral_slides_on_every_layer_whatever_layer_types_says():
    """transformers' Mistral ignores `layer_types` (it warns) and slides wherever sliding_window is
    set; so do the ladder model and the TP runtime (ladder.model.config_rules.attention_type)."""
    base = tiny_model("mistral", sliding_window=WINDOW, layer_types=["full_attention"] * NUM_LAYERS)
    model = to_ladder(base, [])
    ids = random_ids()
    with torch.no_grad():
        assert (model(ids).logits - base(ids).logits).abs().max() == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_ladder_layers_are_the_wiring_and_the_cache_changes_no_token(family):
    base = family_model(family)
    model = to_ladder(base, LADDER_LAYERS)
    ids = random_ids()
    with torch.no_grad():
        logits = model(ids).logits
        torch.testing.assert_close(logits, naive_ladder_logits(base, family, LADDER_LAYERS, ids), rtol=0, atol=2e-5)
        assert (logits - base(ids).logits).abs().max() > 1e-3  # the rewiring shows
        # Greedy generation well past the window: with the cache, then recomputing every step.
        mask = torch.ones_like(ids)
        cached = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        uncached = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, use_cache=False)
    assert cached.shape == (2, 20) and torch.equal(cached, uncached)


@pytest.mark.parametrize("family", FAMILIES)
def test_hidden_states_are_the_mlp_streams(family):
    model = to_ladder(family_model(family), LADDER_LAYERS)
    with torch.no_grad():
        output = model(random_ids(), output_hidden_states=True)
        states = output.hidden_states  # the embeddings, each layer's mlp_stream, the last one final-normed
        assert len(states) == model.config.num_hidden_layers + 1
        assert torch.equal(model.lm_head(states[-1]), output.logits)


# --- convert ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def family_sources(tmp_path_factory) -> dict[str, Path]:
    """A saved tiny checkpoint of each family, with a word-level tokenizer."""
    root = tmp_path_factory.mktemp("families")
    tokenizer = save_word_tokenizer(root / "tokenizer")
    return {
        family: save_tiny_checkpoint(root / family, tokenizer, family, num_hidden_layers=4, **SLIDING[family])
        for family in FAMILIES
    }


@pytest.fixture(scope="module")
def converted(family_sources, tmp_path_factory) -> dict[str, Path]:
    """Each family converted by the `ladder convert` command line (verified), upper 2 of 4 layers ladder."""
    root = tmp_path_factory.mktemp("converted")
    outputs = {}
    for family, source in family_sources.items():
        outputs[family] = root / family
        code = ladder_main(["convert", str(source), "--out", str(outputs[family]), "--layers", "2"])
        assert code == 0, family
    return outputs


@pytest.mark.parametrize("family", FAMILIES)
def test_convert_writes_the_family_ladder_config_and_it_loads(family, family_sources, converted):
    out = converted[family]
    config = json.loads((out / "config.json").read_text())
    name = CLASS_NAMES[family]
    assert config["model_type"] == f"{family}Ladder" and config["ladder_layers"] == [2, 3]
    assert config["architectures"] == [f"Ladder{name}ForCausalLM"]
    assert config["auto_map"] == {
        "AutoConfig": f"configuration_ladder.Ladder{name}Config",
        "AutoModelForCausalLM": f"modeling_ladder.Ladder{name}ForCausalLM",
    }
    assert config.get("sliding_window") == SLIDING[family].get("sliding_window")
    manifest = json.loads((out / "conversion.json").read_text())
    assert manifest["damage"]["hidden_max_abs_diff"] == 0  # verification ran, with the family's masks
    card = (out / "README.md").read_text()
    assert f"- {family}\n" in card and f"a {name} model" in card

    model = AutoModelForCausalLM.from_pretrained(out).eval()  # this package's class (ladder.model.auto)
    assert type(model) is LADDER_CLASSES[family][2]
    original = AutoModelForCausalLM.from_pretrained(family_sources[family]).eval()
    ids = random_ids(vocab_size=model.config.vocab_size)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, to_ladder(original, [2, 3])(ids).logits)


REMOTE_WORKER = """
import importlib.util, json, sys, torch, transformers
from transformers import AutoModelForCausalLM
assert importlib.util.find_spec("ladder") is None, "ladder is importable here"
ids_path, output, *checkpoints = sys.argv[1:]
ids, results = torch.load(ids_path), {"transformers": transformers.__version__}
for checkpoint in checkpoints:
    model = AutoModelForCausalLM.from_pretrained(checkpoint, trust_remote_code=True).eval()
    with torch.no_grad():
        generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
        results[checkpoint] = (type(model).__module__, type(model).__name__, model(ids).logits, generated)
torch.save(results, output)
"""


# The oldest transformers the families' modeling file claims (vLLM's CPU build pins 5.16.1) and the newest.
@pytest.mark.envs
@pytest.mark.parametrize("version", ["5.16.1", "5.25.0"])
def test_converted_families_load_as_remote_code_where_ladder_is_not_importable(version, converted, tmp_path):
    python = REPOSITORY / ".venv-compat" / f"transformers-{version}" / "bin" / "python"
    if not python.is_file():
        pytest.skip(f"no transformers {version} environment: run `make compat`")
    ids = random_ids(vocab_size=30)
    torch.save(ids, tmp_path / "ids.pt")
    (tmp_path / "worker.py").write_text(REMOTE_WORKER)
    environment = {key: value for key, value in os.environ.items() if not key.startswith("PYTHON")}
    environment.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    checkpoints = [str(converted[family]) for family in FAMILIES]
    command = [str(python), "worker.py", "ids.pt", "out.pt", *checkpoints]
    completed = subprocess.run(command, cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    results = torch.load(tmp_path / "out.pt")
    assert results["transformers"] == version
    for family, checkpoint in zip(FAMILIES, checkpoints, strict=True):
        module, name, logits, generated = results[checkpoint]
        assert module.startswith("transformers_modules.") and name == f"Ladder{CLASS_NAMES[family]}ForCausalLM"
        model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
        with torch.no_grad():
            ours = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
            torch.testing.assert_close(logits, model(ids).logits, rtol=0, atol=1e-5, msg=f"{family} on {version}")
        assert torch.equal(generated, ours), f"{family} on {version}: greedy tokens differ"


def test_an_unsupported_family_is_refused_in_one_line(tmp_path, capsys):
    source = tmp_path / "phi3"
    Phi3Config(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=64).save_pretrained(source)
    code, stdout, stderr = run_convert(capsys, source, "--out", tmp_path / "out")
    assert code == 2 and stdout == ""
    assert stderr == (
        f"ladder convert: error: {source / 'config.json'} has model_type 'phi3'; supported families: llama, mistral, "
        "qwen2, qwen3 (and their ladder forms llamaLadder, mistralLadder, qwen2Ladder, qwen3Ladder)\n"
    )
    assert not (tmp_path / "out").exists()


# --- adapt (with auto:N), sample and eval on a Qwen3 --------------------------------------------


def test_a_qwen3_adapts_with_auto_layers_samples_and_evaluates(
    tmp_path, smollm2_tokenizer_dir, corpus, monkeypatch, capsys
):
    source = save_tiny_checkpoint(tmp_path / "qwen3", smollm2_tokenizer_dir, "qwen3", num_hidden_layers=4)
    data = {"data.seq_len": 32, "model.ladder_layers": "auto:2"}
    final = train(load_recipe(write_recipe(tmp_path, source, corpus, budget=2 * 4 * 32, **data)))
    model = AutoModelForCausalLM.from_pretrained(final)
    assert type(model) is LADDER_CLASSES["qwen3"][2] and len(model.config.ladder_layers) == 2
    assert model.model.layers[0].self_attn.q_norm.weight.shape == (16,)  # Qwen3's own attention, trained

    samples = tmp_path / "samples.jsonl"
    arguments = ["--tokens", "40", "--length", "20", "--batch-size", "2", "--out", str(samples)]
    assert ladder_main(["sample", str(final), *arguments]) == 0
    assert len(samples.read_text().splitlines()) == 2

    monkeypatch.setenv("LADDER_CACHE", str(tmp_path / "cache"))
    assert ladder_eval(str(final), "--tasks", "ladder_piqa", "--limit", "2", "--out", str(tmp_path / "eval")) == 0
    rows = json.loads((tmp_path / "eval" / "report.json").read_text())["rows"]
    assert {(row["task"], row["metric"], row["n"]) for row in rows} >= {("ladder_piqa", "acc", 2)}
