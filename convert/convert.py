"""Convert a Llama checkpoint into a ladder checkpoint: `convert_checkpoint`, the one library
function the CLI calls.

Conversion changes no weight, only the wiring (`ladder_layers` in config.json). Where no dtype
change and no resharding is asked, the source's safetensors files go over as they are: copied
side by side (each byte read once, written with direct I/O and hashed on another thread),
reflinked where the filesystem allows, or hard-linked on request (`weights`); otherwise the tensors stream through
`ladder.io.tensors` one 64 MiB block at a time, hashed as they are read. Either way every source tensor is
checked against the shapes the config implies and is used or dropped on purpose, the manifest
records the sha256 of every source weight file (not for hard links, which would cost a read of
every byte), and the output directory appears only once it is complete.

Nothing on the copy path imports torch or transformers (they take seconds to import, longer than
copying a small checkpoint): shapes are computed from config.json's numbers, config.json and the
modeling files are written as save_pretrained would write them (a test checks both), and the
steps that need tensors (casting, pickle, GGUF, verification) import them when they run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import pickle
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING

import psutil  # a dependency of accelerate
from tqdm import tqdm

import ladder
import ladder.model
from ladder.errors import UsageError, first_line
from ladder.io.files import StreamingSha256, atomic_directory, sha256_file
from ladder.io.loading import (
    DTYPE_NAMES,
    gguf_parsed_once,
    load_model,
    model_name,
    read_config_dict,
    resolve_model_path,
)
from ladder.io.model_card import SourceFacts, loading_section, origin_line, render_card, source_facts
from ladder.io.tensors import (
    INDEX_NAME,
    UNSUPPORTED_LINK_ERRNOS,
    LazyTensorLoader,
    OutputShard,
    Shard,
    ShardedTensorIndex,
    ShardedWriter,
    TensorSpec,
    check_weight_map,
    copy_file,
    link_file,
    plan_shards,
    read_chunks,
    shard_filenames,
    split_rows,
    weight_files,
    write_index,
)
from ladder.layers import (
    CONFIG_BOOKKEEPING,
    LADDER_MODEL_TYPE,
    AutoLayers,
    check_llama_model_type,
    format_layers,
    parse_auto_layers,
    parse_ladder_layers,
)
from ladder.model.config_rules import with_legacy_rope

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from ladder.layer_search import LayerSearch

    from .verify import Damage

DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # what save_pretrained uses ("5GB")
PICKLE_INDEX_NAME = "pytorch_model.bin.index.json"
# Weights in other formats or layouts (TF, Flax, ONNX, Meta's consolidated.pth): stale once the
# wiring changes, so they are not copied.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx")
# Written fresh rather than copied; the source's own model card is kept as README.source.md.
WRITTEN_FILES = ("config.json", "conversion.json", "README.md", INDEX_NAME, PICKLE_INDEX_NAME)
# llama.cpp file names end in the quantization type: SmolLM2-135M-Instruct.Q4_1.gguf.
GGUF_TYPE_SUFFIX = re.compile(r"[.-](?:I?Q\d\w*|B?F\d+)$", re.IGNORECASE)
# How unchanged weight files reach the output. "auto": a reflink where the filesystem allows (as
# safe as a copy, and instant), else a copy. "link" (hard links) is never chosen for the user: the
# output's files then are the source's, and editing one in place edits the other.
WEIGHT_MODES = ("auto", "copy", "reflink", "link")
# What save_pretrained writes beside config.json so that the checkpoint loads with
# trust_remote_code=True: the files `auto_map` names and their relative imports.
AUTO_MAP = {
    "AutoConfig": "configuration_ladder_llama.LadderLlamaConfig",
    "AutoModelForCausalLM": "modeling_ladder_llama.LadderLlamaForCausalLM",
}
MODELING_FILES = ("configuration_ladder_llama.py", "modeling_ladder_llama.py", "config_rules.py")
# LlamaConfig's defaults for the numbers the tensor shapes depend on (a config.json may omit them).
LLAMA_SHAPE_DEFAULTS = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
}


@dataclass
class Source:
    """A checkpoint opened for conversion. Of safetensors and pickle weights only the headers
    are read so far; a GGUF file is dequantized whole by transformers (GGUF models are small)."""

    path: Path
    format: str  # "safetensors", "pickle" or "gguf"
    config: dict  # as config.json holds it
    tensors: dict[str, TensorSpec]  # in reading order
    weight_files: list[Path]
    shards: list[Shard] = field(default_factory=list)  # safetensors: each file's header
    other_files: list[Path] = field(default_factory=list)  # tokenizer, generation config, licence: copied
    not_copied: list[str] = field(default_factory=list)
    model: PreTrainedModel | None = None  # gguf: the dequantized model, and its tokenizer
    tokenizer: PreTrainedTokenizerBase | None = None


@dataclass
class ConversionSummary:
    """What was done; `conversion.json` records it (plus tool and time), the CLI prints it."""

    source: str
    source_format: str
    output: str
    num_hidden_layers: int
    ladder_layers: list[int]
    dtype: str
    weights: str  # "copied", "reflinked", "hard-linked" (files as they are) or "rewritten" (tensors streamed)
    tensors: int
    weight_bytes: int
    shards: list[str]
    dropped: dict[str, str]  # tensor name -> why
    not_copied: list[str]
    source_sha256: dict[str, str] | None  # weight file name -> hash; None for hard links (not read)
    seconds: float = 0.0
    damage: Damage | None = None
    verify_skipped: str | None = None
    layer_search: LayerSearch | None = None  # `--layers auto:N`: every candidate's measured damage and the choice


def _say(progress: bool, message: str) -> None:
    if progress:
        print(message, file=sys.stderr, flush=True)


def default_output_dir(source: Path, num_ladder_layers: int) -> Path:
    """runs/convert/<source name>-ladder<N>, the name a GGUF file's quantization suffix removed (a
    Hub snapshot's name is its repository's)."""
    name = GGUF_TYPE_SUFFIX.sub("", source.stem) if source.suffix == ".gguf" else model_name(source)
    return Path("runs") / "convert" / f"{name}-ladder{num_ladder_layers}"


def _check_output_location(source: Path, out: Path) -> None:
    source, out = source.resolve(), out.resolve()
    if out == source or source in out.parents:
        raise UsageError(f"output {out} is inside the source {source}; choose a directory outside it")
    if out in source.parents:
        raise UsageError(f"output {out} contains the source {source}; replacing it would delete the source")


def _read_config(directory: Path) -> dict:
    config = read_config_dict(directory)
    check_llama_model_type(config.get("model_type"), str(directory / "config.json"))
    return config


def config_size(config: dict, key: str) -> int:
    """A positive integer of a Llama config (LlamaConfig's default when absent), or a UsageError."""
    value = config.get(key, LLAMA_SHAPE_DEFAULTS.get(key))
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UsageError(f"config.json: {key} must be a positive integer, not {value!r}")
    return value


def expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor a Llama with this config holds (lm_head included even when
    tied), from the config's numbers alone: what `LlamaForCausalLM(config).state_dict()` lists,
    without building a model (a test checks that they agree)."""
    hidden, intermediate, vocab = (
        config_size(config, key) for key in ("hidden_size", "intermediate_size", "vocab_size")
    )
    heads = config_size(config, "num_attention_heads")
    kv_heads = config_size(config, "num_key_value_heads") if config.get("num_key_value_heads") is not None else heads
    head_dim = config_size(config, "head_dim") if config.get("head_dim") is not None else hidden // heads
    projections = {
        "self_attn.q_proj": (heads * head_dim, hidden),
        "self_attn.k_proj": (kv_heads * head_dim, hidden),
        "self_attn.v_proj": (kv_heads * head_dim, hidden),
        "self_attn.o_proj": (hidden, heads * head_dim),
        "mlp.gate_proj": (intermediate, hidden),
        "mlp.up_proj": (intermediate, hidden),
        "mlp.down_proj": (hidden, intermediate),
    }
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for layer in range(config_size(config, "num_hidden_layers")):
        prefix = f"model.layers.{layer}."
        for name, shape in projections.items():
            shapes[f"{prefix}{name}.weight"] = shape
            if config.get("attention_bias" if name.startswith("self_attn") else "mlp_bias"):
                shapes[f"{prefix}{name}.bias"] = shape[:1]
        shapes[f"{prefix}input_layernorm.weight"] = shapes[f"{prefix}post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def _load_pickle(path: Path) -> dict[str, torch.Tensor]:
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as error:
        raise UsageError(f"cannot read {path} with torch.load(weights_only=True): {first_line(error)}") from None
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise UsageError(f"{path} does not hold a state dict of tensors")
    return state


def _open_directory(directory: Path, config: dict, allow_pickle: bool) -> Source:
    if index := ShardedTensorIndex.from_directory(directory):
        source = Source(directory, "safetensors", config, index.tensors, index.files, list(index.shards))
    elif found := weight_files(directory, PICKLE_INDEX_NAME, "pytorch_model.bin"):
        files, weight_map = found
        if not allow_pickle:
            raise UsageError(
                f"{directory} holds pickle weights ({files[0].name}), which can run code when loaded; "
                "pass --allow-pickle to read them with torch.load(weights_only=True)"
            )
        tensors, holder = {}, {}
        for path in files:
            for name, tensor in _load_pickle(path).items():
                tensors[name] = TensorSpec(name, tensor.dtype, tuple(tensor.shape))
                holder[name] = path.name
        check_weight_map(weight_map, holder, PICKLE_INDEX_NAME)
        source = Source(directory, "pickle", config, tensors, files)
    else:
        raise UsageError(f"{directory} has no weights: expected model.safetensors, {INDEX_NAME} or pytorch_model.bin")
    for path in sorted(directory.iterdir()):
        if path.name.startswith(".") or path in source.weight_files or path.name in WRITTEN_FILES:
            continue
        if path.is_dir():
            source.not_copied.append(path.name + "/")
        elif path.name.endswith(WEIGHT_SUFFIXES) or path.suffix == ".py":
            source.not_copied.append(path.name)
        else:
            source.other_files.append(path)
    return source


def _load_gguf(path: Path, dtype: str) -> Source:
    model, tokenizer = load_model(path, dtype)
    tensors = {name: TensorSpec(name, t.dtype, tuple(t.shape)) for name, t in model.state_dict().items()}
    return Source(path, "gguf", model.config.to_dict(), tensors, [path], model=model, tokenizer=tokenizer)


def check_tensors(source: dict[str, TensorSpec], config: dict) -> dict[str, str]:
    """Match the source's tensors with what a Llama of `config` holds (`expected_shapes`): every
    shape must agree, and a tensor it does not hold is dropped only for a known reason. Returns
    the dropped tensors, each with its reason."""
    expected = expected_shapes(config)
    dropped = {}
    if config.get("tie_word_embeddings", False):
        expected.pop("lm_head.weight")
        if "lm_head.weight" in source:
            dropped["lm_head.weight"] = "tied to model.embed_tokens.weight"
    for name in source:
        if name.endswith("rotary_emb.inv_freq"):
            dropped[name] = "recomputed from the config"
    if unknown := [name for name in source if name not in expected and name not in dropped]:
        raise UsageError(
            f"tensor {', '.join(unknown[:3])} is not part of a Llama with this config "
            f"({len(unknown)} such tensor{'s' if len(unknown) > 1 else ''})"
        )
    if missing := [name for name in expected if name not in source]:
        raise UsageError(f"the checkpoint lacks {len(missing)} tensor(s) its config needs: {', '.join(missing[:3])}")
    for name, shape in expected.items():
        if source[name].shape != shape:
            raise UsageError(f"tensor {name} has shape {list(source[name].shape)}; the config needs {list(shape)}")
    return dropped


def _output_layout(source: Source, kept: list[TensorSpec], max_shard_size: int | None) -> list[OutputShard]:
    """Which output file holds which tensor: the source's grouping unless a shard size is asked."""
    if source.format != "safetensors" or max_shard_size is not None:
        return plan_shards(kept, max_shard_size or DEFAULT_MAX_SHARD_SIZE)
    names = {spec.name: spec for spec in kept}
    groups = [
        kept_in_shard
        for shard in source.shards
        if (kept_in_shard := tuple(names[s.name] for s in shard.tensors if s.name in names))
    ]
    return [OutputShard(filename, group) for filename, group in zip(shard_filenames(len(groups)), groups)]


def _hashed_chunks(shard: Shard, bar: tqdm, hashes: dict[str, str]) -> Iterator[tuple[TensorSpec, torch.Tensor]]:
    """`read_chunks` of one shard, each block hashed on a worker thread while the caller writes it
    (the file is read once); the hash lands in `hashes` when the shard is done."""
    digest, pending = StreamingSha256(), []

    def on_read(data: memoryview) -> None:
        pending.append(digest.update(data))
        bar.update(len(data))

    try:
        for item in read_chunks(shard, on_read):
            yield item
            for hashed in pending:  # read_chunks reads the next block into the same buffer
                hashed.result()
            pending.clear()
        hashes[shard.path.name] = digest.hexdigest()
    finally:
        digest.close()


def _source_blocks(source: Source, bar: tqdm, hashes: dict[str, str]) -> Iterator[tuple[TensorSpec, torch.Tensor]]:
    """Every source tensor in reading order, in row blocks; each weight file's sha256 into `hashes`."""
    if source.format == "safetensors":
        for shard in source.shards:
            yield from _hashed_chunks(shard, bar, hashes)
        return
    for path in source.weight_files:
        # Pickle and GGUF files are read by torch and transformers: hashed apart (a second read).
        hashes[path.name] = sha256_file(path)
        state = _load_pickle(path) if source.format == "pickle" else source.model.state_dict()
        for name, tensor in state.items():
            yield from split_rows(source.tensors[name], tensor)
        bar.update(path.stat().st_size)


def _rewrite_weights(source: Source, layout: list[OutputShard], directory: Path, bar: tqdm) -> dict[str, str]:
    """Stream the kept tensors into the planned shards (which cast them to their output dtype);
    returns the sha256 of each source weight file."""
    writer = ShardedWriter(directory, layout)
    kept = {spec.name for shard in layout for spec in shard.tensors}
    hashes: dict[str, str] = {}
    for spec, block in _source_blocks(source, bar, hashes):
        if spec.name in kept:
            writer.write(spec.name, block)
    writer.close()
    return hashes


def _check_link_possible(source: Path, out: Path) -> None:
    """Hard links cannot cross filesystems: refuse before anything is written."""
    existing = out.absolute()
    while not existing.exists():
        existing = existing.parent
    if existing.stat().st_dev != source.stat().st_dev:
        raise UsageError(
            f"--weights link: the output {out} is on another filesystem than {source}, and hard "
            "links cannot cross filesystems; use --weights copy"
        )


def _place_weights(shards: list[Shard], directory: Path, weights: str, bar: tqdm) -> tuple[str, dict[str, str] | None]:
    """Put the unchanged weight files into `directory` (hard links, reflinks, or copies hashed on
    the way), and their index. Returns what was done ("copied", "reflinked", "hard-linked") and
    the sha256 of each source file (None for hard links: computing it would read every byte)."""
    how = weights
    if how in ("auto", "reflink"):
        try:
            for shard in shards:
                link_file(shard.path, directory / shard.path.name, "reflink")
            how = "reflink"
        except OSError as error:
            if error.errno not in UNSUPPORTED_LINK_ERRNOS:
                raise
            if how == "reflink":
                raise UsageError(
                    f"--weights reflink: cannot reflink {shard.path} into {directory.parent} "
                    f"({os.strerror(error.errno)}; btrfs and XFS can); use --weights copy"
                ) from None
            how = "copy"  # this filesystem has no reflinks; a copy replaces what was linked
    hashes = None

    def copy(shard: Shard, progress: Callable[[int], None]) -> str:
        return copy_file(shard.path, directory / shard.path.name, progress)

    def hash_only(shard: Shard, progress: Callable[[int], None]) -> str:  # reflinked: only read
        return sha256_file(shard.path, on_chunk=progress)

    if how in ("copy", "reflink"):
        hashes = _each_file(copy if how == "copy" else hash_only, shards, bar)
    else:
        for shard in shards:
            link_file(shard.path, directory / shard.path.name, "link")
            bar.update(shard.path.stat().st_size)
    if any(shard.path.name != "model.safetensors" for shard in shards):
        write_index(directory, [OutputShard(shard.path.name, shard.tensors) for shard in shards])
    return {"copy": "copied", "reflink": "reflinked", "link": "hard-linked"}[how], hashes


class _Stopped(Exception):
    """Raised in a worker's progress report to stop it, once another worker has failed."""


def _each_file(work: Callable[[Shard, Callable[[int], None]], str], shards: list[Shard], bar: tqdm) -> dict[str, str]:
    """`work(shard, progress)` for every shard at once, on worker threads: {file name: its result,
    a sha256}. One file's SHA-256 is sequential, about 1.3 GB/s on a core, and the rest of a copy
    is the disk's, so files hashed side by side use every core (more files than cores, as the
    executor's default allows, balance shards of unequal size). The first error stops the other
    workers at their next chunk and is raised; so is Ctrl-C."""
    stop, lock = threading.Event(), threading.Lock()

    def progress(nbytes: int) -> None:
        if stop.is_set():
            raise _Stopped
        with lock:
            bar.update(nbytes)

    with ThreadPoolExecutor(thread_name_prefix="weights") as pool:
        futures = {shard.path.name: pool.submit(work, shard, progress) for shard in shards}
        try:
            done, _ = wait(futures.values(), return_when=FIRST_EXCEPTION)
            for future in done:
                future.result()  # raises a worker's error
            return {name: future.result() for name, future in futures.items()}
        except BaseException:
            stop.set()
            raise


def _flush_to_disk(directory: Path) -> None:
    """fsync every file once at the end (not each as it is written, which would make the writes
    wait for the disk one file at a time), before the directory is renamed into place."""
    for path in directory.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())


def ladder_config_dict(config: dict, layers: list[int], dtype: str) -> dict:
    """The ladder model's config.json from the source's: its architecture, the ladder layers,
    `auto_map` and the dtype; what save_pretrained of a `LadderLlamaConfig` writes, up to keys at
    their defaults (a test loads both and compares)."""
    ladder = {key: value for key, value in config.items() if key not in CONFIG_BOOKKEEPING and key != "torch_dtype"}
    if "torch_dtype" in config:  # the older name
        ladder.setdefault("dtype", config["torch_dtype"])
    if dtype in DTYPE_NAMES:
        ladder["dtype"] = dtype
    ladder.update(
        model_type=LADDER_MODEL_TYPE,
        ladder_layers=layers,
        architectures=["LadderLlamaForCausalLM"],
        auto_map=AUTO_MAP,
        transformers_version=version("transformers"),
    )
    return dict(sorted(with_legacy_rope(ladder).items()))


def _write_config(directory: Path, config: dict) -> None:
    """config.json and the modeling files its `auto_map` names, so that the checkpoint also loads
    with trust_remote_code=True where `ladder` is not installed."""
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in MODELING_FILES:
        shutil.copyfile(Path(ladder.model.__file__).parent / name, directory / name)


def _dtype_name(tensors: list[TensorSpec]) -> str:
    names = sorted({spec.dtype for spec in tensors if spec.is_floating_point})
    return names[0] if len(names) == 1 else "mixed (" + ", ".join(names) + ")"


def _fits_in_memory(tensors: list[TensorSpec]) -> str | None:
    """Why verification would not fit in memory, or None when it does. It runs layer by layer, so it
    holds one module of each model at a time in float32 (a decoder layer, or the embedding or LM head)."""
    module_sizes: dict[str, int] = {}
    for spec in tensors:
        layer = re.match(r"model\.layers\.\d+\.", spec.name)
        module = layer.group(0) if layer else spec.name
        module_sizes[module] = module_sizes.get(module, 0) + math.prod(spec.shape)
    needed = 2 * 4 * max(module_sizes.values())
    available = psutil.virtual_memory().available
    if needed < 0.8 * available:
        return None
    return (
        f"skipped: one module of each model needs about {needed / 1e9:.1f} GB in float32, "
        f"{available / 1e9:.1f} GB is available (--verify runs it anyway)"
    )


def _safetensors_reader(directory: Path) -> Callable[[str], torch.Tensor]:
    """A function from tensor name to a copy of that tensor, opening its file for each read: a file
    kept open stays memory-mapped, and every page read once would count in the process's memory
    until it closes (a whole checkpoint, by the end of a verification)."""
    index = ShardedTensorIndex.from_directory(directory)

    def read(name: str) -> torch.Tensor:
        with LazyTensorLoader(index) as loader:
            return loader.read(name)

    return read


@contextlib.contextmanager
def _source_reader(source: Source) -> Iterator[Callable[[str], torch.Tensor]]:
    """A function from tensor name to the source's tensor that reads only what is asked (one
    safetensors tensor at a time; for pickle weights one memory-mapped file at a time)."""
    if source.model is not None:  # gguf: dequantized in memory already
        yield source.model.state_dict().__getitem__
    elif source.format == "safetensors":
        yield _safetensors_reader(source.path)
    else:
        holder = {name: path for path in source.weight_files for name in _load_pickle(path)}
        opened: dict[Path, dict[str, torch.Tensor]] = {}

        def read(name: str) -> torch.Tensor:
            if holder[name] not in opened:
                opened.clear()
                opened[holder[name]] = _load_pickle(holder[name])
            return opened[holder[name]][name]

        yield read


def _verify(source: Source, converted: Path, kept: list[TensorSpec]) -> Damage:
    """Compare the written checkpoint with the original in float32, both rounded to the written
    dtype (same weights, so only the wiring differs): the configs load as transformers loads them,
    the weights one module at a time (`measure_damage_layerwise`), so that memory stays bounded."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    import ladder.model.auto  # noqa: F401  (registers the ladder model with the Auto classes)

    from .verify import measure_damage_layerwise, prompt_ids

    config = AutoConfig.from_pretrained(converted)
    source_config = source.model.config if source.model is not None else AutoConfig.from_pretrained(source.path)
    with torch.device("meta"):
        ladder_model = AutoModelForCausalLM.from_config(config).eval()
        original = AutoModelForCausalLM.from_config(source_config).eval()
    dtypes = {spec.name: getattr(torch, spec.dtype) for spec in kept}
    if "lm_head.weight" not in dtypes:  # tied, or dropped as tied
        dtypes["lm_head.weight"] = dtypes["model.embed_tokens.weight"]
    try:
        tokenizer = AutoTokenizer.from_pretrained(converted)
    except (OSError, ValueError, TypeError):
        tokenizer = None
    prompts = prompt_ids(tokenizer, config.vocab_size)
    with _source_reader(source) as read:
        return measure_damage_layerwise(original, ladder_model, read, _safetensors_reader(converted), dtypes, prompts)


def _search_layers(source: Source, auto: AutoLayers, calibration: list[Path] | None, progress: bool) -> LayerSearch:
    """Run the `auto:N` search on the source model (loaded whole, in float32, unless it is a GGUF
    file, which is loaded already) with calibration text from training data."""
    from ladder.layer_search import calibration_from_files, choose_ladder_layers

    if source.model is not None:
        model, tokenizer = source.model, source.tokenizer
    else:
        model, tokenizer = load_model(source.path)
    _say(progress, f"{auto}: measuring the damage of each candidate layer set on calibration text ...")
    search = choose_ladder_layers(model, calibration_from_files(tokenizer, calibration), auto)
    _say(progress, search.summary())
    return search


def _model_card(summary: ConversionSummary, source: SourceFacts, kept_source_card: bool) -> str:
    """README.md: Hub front matter from the source (base model, licence) over what was rewired and
    the damage measured before any retraining."""
    lines = [
        origin_line(source),
        "",
        f"{len(summary.ladder_layers)} of its {summary.num_hidden_layers} layers are rewired "
        f"({format_layers(summary.ladder_layers)}); no weight was changed ({summary.dtype}). In a ladder layer each "
        "module reads the residual stream from before the previous module's output was added, so under tensor "
        "parallelism one module's all-reduce overlaps the next module's compute. Until it is retrained "
        "(`ladder adapt`) the model is less accurate than the original.",
        "",
        loading_section(),
        "",
        "## Conversion damage, before retraining",
        "",
    ]
    damage = summary.damage
    if damage is None:
        lines.append(f"Not measured ({summary.verify_skipped}).")
    else:
        lines += [
            f"On {damage.prompts} fixed prompts ({damage.tokens} tokens), against the original:",
            "",
            "| measure | value |",
            "|---|---|",
            f"| max abs. difference of hidden states before the first ladder layer | {damage.hidden_max_abs_diff:g} |",
            f"| next-token top-1 agreement | {damage.top1_agreement:.1%} |",
            f"| mean KL(original \\|\\| ladder), nats | {damage.mean_kl:.4f} |",
        ]
    lines += ["", "`conversion.json` records the source, the sha256 of its weight files, and these figures."]
    if kept_source_card:
        lines.append("The source's own model card is kept as `README.source.md`.")
    if source.license:
        lines.append(
            f"The licence is the source's ({source.license_name or source.license}); its licence files, "
            "if it had any, are copied beside the weights."
        )
    return render_card(source, Path(summary.output).name, "\n".join(lines))


def conversion_differences(
    out: str | Path, source: str | Path | None, ladder_layers: str | int | list[int] | None = None
) -> list[str]:
    """The settings that `out`'s conversion.json records differently from these (`source` and
    `ladder_layers` as `convert_checkpoint` takes them): what makes an existing conversion stale.
    Lists `conversion.json` itself when `out` has none (nothing says how it was made)."""
    manifest = Path(out) / "conversion.json"
    if not manifest.is_file():
        return ["conversion.json (missing)"]
    recorded = json.loads(manifest.read_text())
    num_hidden_layers = recorded["num_hidden_layers"]
    differences = [] if recorded.get("source") == str(resolve_model_path(source).resolve()) else ["source"]
    if (auto := parse_auto_layers(ladder_layers, num_hidden_layers, "ladder_layers")) is not None:
        # Searched on convert's default calibration text; the search recorded its spec and choice.
        same_layers = (recorded.get("layer_search") or {}).get("spec") == str(auto)
    else:
        same_layers = recorded.get("ladder_layers") == parse_ladder_layers(
            num_hidden_layers // 2 if ladder_layers is None else ladder_layers, num_hidden_layers, "ladder_layers"
        )
    return differences + ([] if same_layers else ["ladder_layers"])


def convert_checkpoint(
    source: str | Path | None,
    out: str | Path | None = None,
    ladder_layers: str | int | list[int] | None = None,
    dtype: torch.dtype | str | None = None,
    max_shard_size: int | None = None,
    force: bool = False,
    verify: bool | None = None,
    allow_pickle: bool = False,
    progress: bool = False,
    weights: str = "auto",
    calibration: list[str | Path] | None = None,
) -> ConversionSummary:
    """Write a ladder copy of `source` (a checkpoint directory, a .gguf file, or None for the
    embedded SmolLM2) into `out` (default `runs/convert/<name>-ladder<N>`).

    `ladder_layers`: N (upper N), "16-31", "3,5,7" or a list; default the upper half; "auto:N" or
    "auto:N:any" measure which layers to rewire (`ladder.layer_search`) on `calibration` text files or
    folders (default: training books from the data folder, never evaluation text). `dtype`:
    cast floating tensors (a torch dtype or its name; default: keep the source's; float32 for
    GGUF). `max_shard_size` in bytes: reshard (default: keep the source's shards). `verify`: None
    = when both models fit in memory. `weights`: how unchanged weight files reach the output
    (`WEIGHT_MODES`). Bad input raises `UsageError` before anything is written.
    """
    started = time.perf_counter()
    if weights not in WEIGHT_MODES:
        raise UsageError(f"--weights {weights!r}: choose from {', '.join(WEIGHT_MODES)}")
    dtype = None if dtype is None else str(dtype).removeprefix("torch.")
    source_path = resolve_model_path(source)
    is_gguf = source_path.suffix == ".gguf"
    # A GGUF file is read for its checks, its tokenizer, config and weights, and its licence: parsed once.
    with gguf_parsed_once() if is_gguf else contextlib.nullcontext():
        if is_gguf:
            from .gguf import inspect_llama_gguf

            num_hidden_layers = inspect_llama_gguf(source_path).num_hidden_layers
        else:
            directory_config = _read_config(source_path)
            num_hidden_layers = config_size(directory_config, "num_hidden_layers")
        # By default the upper half, as in the paper's 16 of 32.
        spec = num_hidden_layers // 2 if ladder_layers is None else ladder_layers
        auto = parse_auto_layers(spec, num_hidden_layers, "--layers")
        if calibration is not None and auto is None:
            raise UsageError("--calibration goes with --layers auto:N (it is the text the layer search measures on)")
        layers = parse_ladder_layers(spec, num_hidden_layers, "--layers") if auto is None else None
        out = Path(out) if out is not None else default_output_dir(source_path, auto.count if auto else len(layers))
        _check_output_location(source_path, out)
        if out.exists() and not force:
            raise UsageError(f"output {out} already exists; pass --force to replace it")

        if is_gguf:
            _say(progress, f"dequantizing {source_path.name} ...")
            opened = _load_gguf(source_path, dtype or "float32")
        else:
            opened = _open_directory(source_path, directory_config, allow_pickle)
        search = None
        if auto is not None:
            search = _search_layers(opened, auto, calibration, progress)
            layers = search.chosen
        dropped = check_tensors(opened.tensors, opened.config)
        kept = [
            dataclasses.replace(spec, dtype=dtype) if dtype is not None and spec.is_floating_point else spec
            for spec in opened.tensors.values()
            if spec.name not in dropped
        ]
        copy_as_is = (
            opened.format == "safetensors"
            and not dropped
            and max_shard_size is None
            and all(spec.dtype == opened.tensors[spec.name].dtype for spec in kept)
        )
        if weights in ("link", "reflink"):
            if not copy_as_is:
                raise UsageError(
                    f"--weights {weights}: the weights are rewritten here (a dtype cast, resharding, a "
                    "dropped tensor or a non-safetensors source), so there are no files to link"
                )
            if weights == "link":
                _check_link_possible(source_path, out)
        layout = (
            [OutputShard(s.path.name, s.tensors) for s in opened.shards]
            if copy_as_is
            else _output_layout(opened, kept, max_shard_size)
        )
        summary = ConversionSummary(
            source=str(source_path.resolve()),
            source_format=opened.format,
            output=str(out.resolve()),
            num_hidden_layers=num_hidden_layers,
            ladder_layers=layers,
            dtype=_dtype_name(kept),
            weights="copied" if copy_as_is else "rewritten",
            tensors=len(kept),
            weight_bytes=sum(spec.nbytes for spec in kept),
            shards=[shard.filename for shard in layout],
            dropped=dropped,
            not_copied=opened.not_copied,
            source_sha256={},
            layer_search=search,
        )
        config = ladder_config_dict(opened.config, layers, summary.dtype)
        verify_skipped = _fits_in_memory(kept) if verify is None else None if verify else "skipped: --no-verify"

        with atomic_directory(out, force) as staging:
            total = sum(path.stat().st_size for path in opened.weight_files)
            with tqdm(
                desc="weights (sha256 on the way)",
                total=total,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                disable=None if progress else True,
            ) as bar:
                if copy_as_is:
                    summary.weights, summary.source_sha256 = _place_weights(opened.shards, staging, weights, bar)
                else:
                    summary.source_sha256 = _rewrite_weights(opened, layout, staging, bar)
            _write_config(staging, config)
            for path in opened.other_files:
                shutil.copyfile(path, staging / path.name)
            kept_source_card = (source_path / "README.md").is_file()
            if kept_source_card:
                shutil.copyfile(source_path / "README.md", staging / "README.source.md")
            if opened.tokenizer is not None:
                opened.tokenizer.save_pretrained(staging)
                opened.model.generation_config.save_pretrained(staging)

            if verify_skipped is None:
                _say(progress, "verifying: both models on fixed prompts ...")
                from .verify import damage_problems

                summary.damage = _verify(opened, staging, kept)
                if problems := damage_problems(summary.damage):
                    raise RuntimeError(f"verification failed, nothing written: {'; '.join(problems)}")
            summary.verify_skipped = verify_skipped
            summary.seconds = round(time.perf_counter() - started, 2)
            (staging / "README.md").write_text(_model_card(summary, source_facts(source_path), kept_source_card))
            manifest = {
                "tool": "ladder-llama",
                "version": ladder.__version__,
                "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                **dataclasses.asdict(summary),
            }
            (staging / "conversion.json").write_text(json.dumps(manifest, indent=2) + "\n")
            _flush_to_disk(staging)
        return summary
