"""The TP runtime on every family (issue 45): tiny random Llama, Mistral, Qwen2 and Qwen3 checkpoints
made by transformers' own classes, each with its family's own pieces switched on (biases, Qwen3's
per-head q/k norms and a head_dim of its own, sliding windows), standard and in ladder form. One
process equals transformers (the family's model, and the ladder model), and TP=2 over gloo (one
launch for every family) equals one process."""

import pytest
import torch
from test_tp import BATCH, PROMPT, reference_outputs, sharded_outputs, tp2_ranks
from transformers import AutoModelForCausalLM

from ladder import to_ladder
from ladder.convert.checks import expected_shapes
from ladder.errors import UsageError
from ladder.tp.runtime import load_shard
from ladder.tp.shard import ShardShape
from tiny import random_ids, tiny_model

LADDER_LAYERS = [0, 2, 3]
FAMILIES = {
    # Llama with every bias: o_proj's and down_proj's are row-parallel, added once over the ranks.
    "llama": dict(attention_bias=True, mlp_bias=True),
    # A window of 3 positions on every layer, shorter than the prompt.
    "mistral": dict(sliding_window=3),
    # Biases on q/k/v; the window only on layers 2 and 3 (max_window_layers).
    "qwen2": dict(use_sliding_window=True, sliding_window=3, max_window_layers=2),
    # Per-head q/k norms, attention biases, head_dim 24 (not hidden/heads), the window where layer_types says.
    "qwen3": dict(
        attention_bias=True,
        head_dim=24,
        use_sliding_window=True,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    ),
}
CHECKPOINTS = [f"{family}-{form}" for family in FAMILIES for form in ("standard", "ladder")]
IDS = random_ids(BATCH, PROMPT)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    """Each family's tiny checkpoint and its ladder form (as `ladder convert` writes it)."""
    root = tmp_path_factory.mktemp("tp-families")
    for family, features in FAMILIES.items():
        model = tiny_model(family, num_hidden_layers=4, **features)
        model.save_pretrained(root / f"{family}-standard")
        to_ladder(model, LADDER_LAYERS).save_pretrained(root / f"{family}-ladder")
    return {name: root / name for name in CHECKPOINTS}


@pytest.fixture(scope="module")
def one_process(checkpoints) -> dict:
    """Each checkpoint's logits and greedy tokens from the runtime in this process (TP=1)."""
    return {name: sharded_outputs(load_shard(path), IDS) for name, path in checkpoints.items()}


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_one_process_equals_transformers(checkpoints, one_process, name):
    """Logits at every position (a prefill, then token by token through the KV cache) and greedy
    tokens equal the family's transformers model, or for the ladder form the ladder model."""
    logits, tokens = one_process[name]
    reference_logits, reference_tokens, _ = reference_outputs(checkpoints[name], IDS)
    torch.testing.assert_close(logits, reference_logits, atol=1e-5, rtol=0)
    assert torch.equal(tokens, reference_tokens)


def test_the_ladder_form_reads_its_ladder_layers(checkpoints):
    for family in FAMILIES:
        assert load_shard(checkpoints[f"{family}-ladder"]).ladder_layers == LADDER_LAYERS
        assert load_shard(checkpoints[f"{family}-standard"]).ladder_layers == []


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_s_pieces_change_its_function(checkpoints, family):
    """Otherwise the comparisons above could not tell a shard without the family's biases, norms or
    window from one with them: the same weights through a Llama without them give other logits."""
    model = AutoModelForCausalLM.from_pretrained(checkpoints[f"{family}-standard"])
    plain = tiny_model("llama", num_hidden_layers=4, head_dim=model.config.head_dim)
    plain.load_state_dict(model.state_dict(), strict=False)
    with torch.no_grad():
        assert (model(IDS).logits - plain(IDS).logits).abs().max() > 1e-2


def test_tp2_over_gloo_equals_one_process(checkpoints, one_process, tmp_path):
    """Every family, standard and ladder, sharded over 2 ranks in one launch: column-parallel biases
    split with their heads, row-parallel ones added once, per-head norms whole on each rank."""
    ranks = tp2_ranks(checkpoints, IDS, tmp_path)
    for name, (logits, tokens) in one_process.items():
        for rank in ranks:
            torch.testing.assert_close(rank[name]["logits"], logits, atol=1e-5, rtol=0, msg=f"{name} differs")
            assert torch.equal(rank[name]["tokens"], tokens), name


def test_an_activation_it_does_not_run_is_refused_in_one_line(tmp_path):
    tiny_model("qwen3", num_hidden_layers=2, hidden_act="gelu").save_pretrained(tmp_path)
    with pytest.raises(UsageError, match="runs llama, mistral, qwen2, qwen3 models with hidden_act silu") as refused:
        load_shard(tmp_path)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_shard_and_convert_expect_the_biases_the_family_model_has(family):
    """Asked for every bias (`attention_bias`, `mlp_bias`), each family's transformers model keeps only
    its own (Mistral none, Qwen2 q/k/v alone, Qwen3 no MLP bias): the shard and convert's tensor table
    expect exactly those (ladder.model.config_rules.biased_projections)."""
    model = tiny_model(family, attention_bias=True, mlp_bias=True)
    biases = {name for name, _ in model.named_parameters() if name.endswith(".bias")}
    assert {name for name in expected_shapes(model.config.to_dict()) if name.endswith(".bias")} == biases
    own = {name.split(".")[-2] for name in biases if name.startswith("model.layers.0.")}
    assert ShardShape.of(model.config).biased == own
