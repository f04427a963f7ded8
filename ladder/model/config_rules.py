"""Rules of a ladder config.json: what `ladder_layers` means (`resolve_ladder_layers`), and RoPE
written for every reader (`with_legacy_rope`). Plain Python with no imports: it travels inside
checkpoints beside configuration_ladder_llama.py (a relative import, which transformers copies
with it), and the command line and convert's copy path use it without loading transformers."""


def resolve_ladder_layers(ladder_layers: object, num_hidden_layers: int) -> list[int]:
    """Normalise `ladder_layers` to a sorted list of distinct layer indices.

    An int N means the upper N layers, `range(L - N, L)`, as in the published configs;
    a list names the layers; `None` means no ladder layer.
    """
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
    """`values` (a config dict) with RoPE also written the transformers 4.x way, `rope_theta` and
    `rope_scaling`, as the published ladder configs have it. A 4.x reader (the official ladder code
    targets 4.47) ignores transformers 5's `rope_parameters` and would silently use rope_theta
    10000; transformers 5 reads the legacy keys to the same `rope_parameters`."""
    values = dict(values)
    rope = dict(values.get("rope_parameters") or {})
    if "rope_theta" in rope:  # a per-layer-type mapping has no 4.x form: Llama never has one
        values["rope_theta"] = rope.pop("rope_theta")
        values["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    return values


# The names a Llama config.json may give that every transformers release a ladder checkpoint runs on
# (4.47 to 5.x, docs/portability.md) knows: transformers fails on any other with a KeyError deep in
# building the model. A test checks both lists against the installed transformers.
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
HIDDEN_ACTS = (
    "gelu", "gelu_10", "gelu_accurate", "gelu_fast", "gelu_new", "gelu_python", "gelu_pytorch_tanh", "laplace",
    "leaky_relu", "linear", "mish", "quick_gelu", "relu", "relu2", "relu6", "sigmoid", "silu", "swish", "tanh",
)  # fmt: skip


def check_llama_values(values: dict) -> None:
    """Refuse (ValueError naming the key) a config whose activation or RoPE type no transformers
    release builds, or whose context holds fewer than two positions (one token and the next, the
    least that a model can be scored or trained on)."""
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
