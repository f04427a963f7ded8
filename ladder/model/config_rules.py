"""Rules of a ladder config.json: the families, what `ladder_layers` means, RoPE for every reader.
Plain Python with no imports: it travels inside checkpoints beside configuration_ladder.py, and
the command line uses it without loading transformers."""

# The families a ladder model is made from (a config's model_type) and the model_type of each one's
# ladder form, `llamaLadder` as the published ladder checkpoints have it. The one home of this table.
LADDER_MODEL_TYPES = {family: f"{family}Ladder" for family in ("llama", "mistral", "qwen2", "qwen3")}
# Each family's class-name stem in transformers and vLLM: Qwen3ForCausalLM, LadderQwen3ForCausalLM.
CLASS_NAMES = {family: family.capitalize() for family in LADDER_MODEL_TYPES}


def family_of(model_type: object) -> str | None:
    for family, ladder_type in LADDER_MODEL_TYPES.items():
        if model_type in (family, ladder_type):
            return family
    return None


def ladder_architecture(family: str) -> str:
    return f"Ladder{CLASS_NAMES[family]}ForCausalLM"


def biased_projections(family: str, attention_bias: object = False, mlp_bias: object = False) -> frozenset[str]:
    """The projections that carry a bias in the family's transformers model: Qwen2's q/k/v always and
    nothing else, Mistral's none, Llama's and Qwen3's attention per `attention_bias`, Llama's MLP per
    `mlp_bias`."""
    if family == "qwen2":
        return frozenset({"q_proj", "k_proj", "v_proj"})
    if family == "mistral":
        return frozenset()
    attention = {"q_proj", "k_proj", "v_proj", "o_proj"} if attention_bias else set()
    mlp = {"gate_proj", "up_proj", "down_proj"} if family == "llama" and mlp_bias else set()
    return frozenset(attention | mlp)


def attention_type(config, layer: int) -> str:
    """A layer's attention, as the family's transformers model has it: Qwen2's and Qwen3's
    `layer_types` name it per layer; Mistral slides on every layer when `sliding_window` is set
    (it ignores `layer_types`); Llama never slides."""
    family = family_of(config.model_type)
    if family in ("qwen2", "qwen3"):
        return config.layer_types[layer]
    return "sliding_attention" if family == "mistral" and getattr(config, "sliding_window", None) else "full_attention"


def resolve_ladder_layers(ladder_layers: object, num_hidden_layers: int) -> list[int]:
    """`ladder_layers` as sorted distinct indices: an int N is the upper N layers (as the published
    configs have it), a list names them, None is none."""
    if ladder_layers is None:
        return []
    if isinstance(ladder_layers, int) and not isinstance(ladder_layers, bool):
        if not 0 <= ladder_layers <= num_hidden_layers:
            raise ValueError(f"ladder_layers={ladder_layers}: the upper N layers needs 0 <= N <= {num_hidden_layers}")
        return list(range(num_hidden_layers - ladder_layers, num_hidden_layers))
    if not isinstance(ladder_layers, (list, tuple)):
        raise ValueError(f"ladder_layers must be an int or a list of layer indices, got {ladder_layers!r}")
    for index in ladder_layers:
        if not isinstance(index, int) or isinstance(index, bool):
            raise ValueError(f"ladder_layers entries must be integers, got {index!r}")
        if not 0 <= index < num_hidden_layers:
            raise ValueError(f"ladder_layers entry {index} is out of range for {num_hidden_layers} layers")
    if len(set(ladder_layers)) != len(ladder_layers):
        duplicates = sorted({i for i in ladder_layers if list(ladder_layers).count(i) > 1})
        raise ValueError(f"ladder_layers has duplicate entries: {duplicates}")
    return sorted(ladder_layers)


def with_legacy_rope(values: dict) -> dict:
    """`values` with RoPE also written the transformers 4.x way (`rope_theta`, `rope_scaling`): a 4.x
    reader ignores `rope_parameters` and would silently use rope_theta 10000."""
    values = dict(values)
    rope = dict(values.get("rope_parameters") or {})
    if "rope_theta" in rope:  # a per-layer-type mapping has no 4.x form: Llama never has one
        values["rope_theta"] = rope.pop("rope_theta")
        values["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    return values


# The names a config.json of a supported family may give that every transformers release a ladder checkpoint runs on
# (4.47 to 5.x, docs/portability.md) knows: transformers fails on any other with a KeyError deep in
# building the model. A test checks both lists against the installed transformers.
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
HIDDEN_ACTS = (
    "gelu", "gelu_10", "gelu_accurate", "gelu_fast", "gelu_new", "gelu_python", "gelu_pytorch_tanh", "laplace",
    "leaky_relu", "linear", "mish", "quick_gelu", "relu", "relu2", "relu6", "sigmoid", "silu", "swish", "tanh",
)  # fmt: skip


def check_values(values: dict) -> None:
    """Refuse (ValueError naming the key) an activation or RoPE type no transformers release builds,
    or a context of fewer than two positions (the least a model can be scored on)."""
    act = values.get("hidden_act", "silu")
    if act not in HIDDEN_ACTS:
        raise ValueError(
            f"hidden_act {str(act)[:80]!r} is not an activation transformers knows: {', '.join(HIDDEN_ACTS)}"
        )
    for key in ("rope_parameters", "rope_scaling"):
        rope = values.get(key)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            raise ValueError(f"{key} must be a mapping, not {type(rope).__name__}")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"{key}: rope_type {str(rope_type)[:80]!r} is not one of {', '.join(ROPE_TYPES)}")
    positions = values.get("max_position_embeddings", 2048)
    if not isinstance(positions, int) or isinstance(positions, bool) or positions < 2:
        raise ValueError(f"max_position_embeddings must be a whole number of at least 2, not {str(positions)[:80]}")
