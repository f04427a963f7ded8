"""Lay out a conversion, writing nothing: open and check the source, choose the ladder layers and
decide the output (`Conversion`), which `ladder.convert.execute` writes.

Nothing here imports torch or transformers for a safetensors source (they take longer to import
than a small checkpoint takes to copy): shapes come from config.json's numbers and the config is
written as save_pretrained would write it (a test checks both).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING

import psutil  # a dependency of accelerate

from ladder.errors import UsageError
from ladder.io.files import resolves_inside
from ladder.io.loading import DTYPE_NAMES, input_root, load_model, model_name, read_config_dict
from ladder.io.tensors import (
    INDEX_NAME,
    OutputShard,
    Shard,
    ShardedTensorIndex,
    TensorSpec,
    cut_into_shards,
    shard_filenames,
)
from ladder.io.tokenizer_files import check_tokenizer_files
from ladder.layers import CONFIG_BOOKKEEPING, AutoLayers, check_model_type
from ladder.log import log
from ladder.model.config_rules import LADDER_MODEL_TYPES, ladder_architecture, with_legacy_rope

from .checks import LAYER_TENSOR, check_config, check_weights, config_size

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from ladder.layer_search import LayerSearch

    from .verify import Damage

DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # what save_pretrained uses ("5GB")
# Weights in other formats (TF, Flax, ONNX, Meta's consolidated.pth): stale once rewired, not copied.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx")
# Written fresh rather than copied; the source's own model card is kept as README.source.md.
WRITTEN_FILES = ("config.json", "conversion.json", "README.md", INDEX_NAME, "pytorch_model.bin.index.json")
# llama.cpp file names end in the quantization type: SmolLM2-135M-Instruct.Q4_1.gguf.
GGUF_TYPE_SUFFIX = re.compile(r"[.-](?:I?Q\d\w*|B?F\d+)$", re.IGNORECASE)
# How unchanged weight files reach the output. "link" (hard links) is never chosen for the user: the
# output's files then are the source's, and editing one in place edits the other.
WEIGHT_MODES = ("copy", "link")


@dataclass
class Source:
    """A checkpoint opened for conversion and checked: safetensors headers only, or a GGUF file
    dequantized whole."""

    path: Path
    format: str  # "safetensors" or "gguf"
    config: dict  # as config.json holds it
    tensors: dict[str, TensorSpec]  # in reading order
    shards: list[Shard] = field(default_factory=list)  # safetensors: each file's header
    other_files: list[Path] = field(default_factory=list)  # tokenizer, generation config, licence: copied
    card: Path | None = None  # its README.md, copied as README.source.md
    not_copied: list[str] = field(default_factory=list)
    dropped: dict[str, str] = field(default_factory=dict)  # tensor name -> why it is not kept
    model: PreTrainedModel | None = None  # gguf: the dequantized model, and its tokenizer
    tokenizer: PreTrainedTokenizerBase | None = None


@dataclass
class ConversionSummary:
    """What was done: `conversion.json` records it, the CLI prints it."""

    source: str
    source_format: str
    output: str
    num_hidden_layers: int
    ladder_layers: list[int]
    dtype: str
    weights: str  # "copied", "hard-linked" (files as they are) or "rewritten" (tensors cast or resharded)
    tensors: int
    weight_bytes: int
    shards: list[str]
    dropped: dict[str, str]  # tensor name -> why
    not_copied: list[str]
    seconds: float = 0.0
    damage: Damage | None = None
    verify_skipped: str | None = None  # why verification is skipped; None: it runs
    layer_search: LayerSearch | None = None  # `--layers auto:N`: every candidate's measured damage and the choice


@dataclass
class Conversion:
    source: Source
    out: Path
    layout: list[OutputShard]  # the kept tensors by file
    config: dict  # the ladder config.json
    summary: ConversionSummary


def say(progress: bool, message: str) -> None:
    if progress:
        log.info(message)


def default_output_dir(source: Path, num_ladder_layers: int) -> Path:
    """runs/convert/<source name>-ladder<N> (without a GGUF file's quantization suffix)."""
    name = GGUF_TYPE_SUFFIX.sub("", source.stem) if source.suffix == ".gguf" else model_name(source)
    return Path("runs") / "convert" / f"{name}-ladder{num_ladder_layers}"


def _output_layout(source: Source, kept: list[TensorSpec], max_shard_size: int | None) -> list[OutputShard]:
    """The source's grouping of tensors into files unless a shard size is asked."""
    if source.format != "safetensors" or max_shard_size is not None:
        return cut_into_shards(kept, max_shard_size or DEFAULT_MAX_SHARD_SIZE)
    names = {spec.name: spec for spec in kept}
    groups = [
        kept_in_shard
        for shard in source.shards
        if (kept_in_shard := tuple(names[s.name] for s in shard.tensors if s.name in names))
    ]
    return [OutputShard(filename, group) for filename, group in zip(shard_filenames(len(groups)), groups)]


def ladder_config_dict(config: dict, layers: list[int], dtype: str) -> dict:
    """The ladder model's config.json from the source's, as save_pretrained of the family's ladder
    config writes it up to keys at their defaults (a test compares)."""
    family = check_model_type(config.get("model_type"), "config.json")
    architecture = ladder_architecture(family)
    ladder = {key: value for key, value in config.items() if key not in CONFIG_BOOKKEEPING and key != "torch_dtype"}
    if "torch_dtype" in config:  # the older name
        ladder.setdefault("dtype", config["torch_dtype"])
    if dtype in DTYPE_NAMES:
        ladder["dtype"] = dtype
    ladder.update(
        model_type=LADDER_MODEL_TYPES[family],
        ladder_layers=layers,
        architectures=[architecture],
        # the classes for trust_remote_code=True
        auto_map={
            "AutoConfig": f"configuration_ladder.{architecture.removesuffix('ForCausalLM')}Config",
            "AutoModelForCausalLM": f"modeling_ladder.{architecture}",
        },
        transformers_version=version("transformers"),
    )
    return dict(sorted(with_legacy_rope(ladder).items()))


def _fits_in_memory(tensors: list[TensorSpec]) -> str | None:
    """Why verification would not fit in memory, or None: it holds one module of each model at a
    time, in float32."""
    module_sizes = collections.Counter()
    for spec in tensors:
        layer = LAYER_TENSOR.match(spec.name)
        module_sizes[layer.group(0) if layer else spec.name] += math.prod(spec.shape)
    needed = 2 * 4 * max(module_sizes.values())
    available = psutil.virtual_memory().available
    if needed < 0.8 * available:
        return None
    return (
        f"skipped: one module of each model needs about {needed / 1e9:.1f} GB in float32, "
        f"{available / 1e9:.1f} GB is available (--verify runs it anyway)"
    )


def search_layers(source: Source, auto: AutoLayers, calibration: list[Path] | None, progress: bool) -> LayerSearch:
    """Run the `auto:N` search on the source model, loaded whole in float32."""
    from ladder.layer_search import calibration_from_files, choose_ladder_layers

    model, tokenizer = (source.model, source.tokenizer) if source.model is not None else load_model(source.path)
    say(progress, f"{auto}: measuring the damage of each candidate layer set on calibration text ...")
    search = choose_ladder_layers(model, calibration_from_files(tokenizer, calibration), auto)
    say(progress, search.summary())
    return search


def read_source(path: Path) -> tuple[Source | None, int]:
    """A directory's config.json, checked, then its weight headers against it; a GGUF file's
    metadata, checked (None: `open_source` dequantizes it); with the layer count. Nothing that grows
    with the config's numbers is built before this."""
    if path.suffix == ".gguf":
        from .gguf import inspect_llama_gguf

        return None, inspect_llama_gguf(path)
    config = read_config_dict(path)
    check_config(config, str(path / "config.json"))
    check_tokenizer_files(path, config_size(config, "vocab_size"))  # convert copies them
    if (index := ShardedTensorIndex.from_directory(path)) is None:
        raise UsageError(
            f"{path} has no safetensors weights (model.safetensors or {INDEX_NAME}); save the "
            "model with save_pretrained, which writes them"
        )
    source = Source(path, "safetensors", config, index.tensors, list(index.shards))
    root = input_root(path)
    for entry in sorted(path.iterdir()):
        if entry.name.startswith(".") or entry in index.files:
            continue
        if entry.is_dir():
            source.not_copied.append(entry.name + "/")
        elif entry.name.endswith(WEIGHT_SUFFIXES) or entry.suffix == ".py":
            source.not_copied.append(entry.name)
        elif (entry.name in WRITTEN_FILES and entry.name != "README.md") or not entry.is_file():
            continue
        elif not resolves_inside(entry, root):  # a link to any file on the machine: skipped, one warning line
            continue
        elif entry.name == "README.md":
            source.card = entry
        else:
            source.other_files.append(entry)
    source.dropped = check_weights(source.tensors, config)
    return source, config_size(config, "num_hidden_layers")


def open_source(path: Path, dtype: str | None, progress: bool) -> Source:
    """A GGUF file dequantized whole, checked as a directory's headers are."""
    say(progress, f"dequantizing {path.name} ...")
    model, tokenizer = load_model(path, dtype or "float32")
    tensors = {name: TensorSpec(name, t.dtype, tuple(t.shape)) for name, t in model.state_dict().items()}
    config = model.config.to_dict()
    check_config(config, str(path))
    dropped = check_weights(tensors, config)
    return Source(path, "gguf", config, tensors, dropped=dropped, model=model, tokenizer=tokenizer)


def lay_out(
    source: Source,
    out: Path,
    layers: list[int],
    search: LayerSearch | None,
    dtype: str | None,
    max_shard_size: int | None,
    weights: str,
    verify: bool | None,
) -> Conversion:
    """Which tensors are kept, in which files, whether the source's files go over as they are, the
    ladder config, and whether verification runs."""
    kept = [
        dataclasses.replace(spec, dtype=dtype) if dtype is not None and spec.is_floating_point else spec
        for spec in source.tensors.values()
        if spec.name not in source.dropped
    ]
    copy_as_is = (
        source.format == "safetensors"
        and not source.dropped
        and max_shard_size is None
        and all(spec.dtype == source.tensors[spec.name].dtype for spec in kept)
    )
    if weights == "link":
        _check_link_possible(copy_as_is, source.path, out)
    layout = (
        [OutputShard(s.path.name, s.tensors) for s in source.shards]
        if copy_as_is
        else _output_layout(source, kept, max_shard_size)
    )
    dtypes = sorted({spec.dtype for spec in kept if spec.is_floating_point})
    summary = ConversionSummary(
        source=str(source.path.resolve()),
        source_format=source.format,
        output=str(out.resolve()),
        num_hidden_layers=config_size(source.config, "num_hidden_layers"),
        ladder_layers=layers,
        dtype=dtypes[0] if len(dtypes) == 1 else "mixed (" + ", ".join(dtypes) + ")",
        weights=("hard-linked" if weights == "link" else "copied") if copy_as_is else "rewritten",
        tensors=len(kept),
        weight_bytes=sum(spec.nbytes for spec in kept),
        shards=[shard.filename for shard in layout],
        dropped=source.dropped,
        not_copied=source.not_copied,
        layer_search=search,
        verify_skipped=_fits_in_memory(kept) if verify is None else None if verify else "skipped: --no-verify",
    )
    return Conversion(source, out, layout, ladder_config_dict(source.config, layers, summary.dtype), summary)


def _check_link_possible(copy_as_is: bool, source: Path, out: Path) -> None:
    """Links need the source's files as they are, and one filesystem (hard links cannot cross one)."""
    if not copy_as_is:
        raise UsageError(
            "--weights link: the weights are rewritten here (a dtype cast, resharding, a "
            "dropped tensor or a GGUF source), so there are no files to link"
        )
    existing = out.absolute()
    while not existing.exists():
        existing = existing.parent
    if existing.stat().st_dev != source.stat().st_dev:
        raise UsageError(
            f"--weights link: the output {out} is on another filesystem than {source}, and hard "
            "links cannot cross filesystems; use --weights copy"
        )
