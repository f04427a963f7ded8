"""Convert a Llama checkpoint into a ladder checkpoint: `convert_checkpoint`, the one library
function the CLI calls.

Conversion changes no weight, only the wiring (`ladder_layers` in config.json). Where no dtype
change and no resharding is asked, the source's safetensors files are copied as they are (a
reflink where the filesystem allows) while they are hashed; otherwise the tensors stream through
`tensor_io` one 64 MiB block at a time. Either way every source tensor is checked against the
shapes the config implies and is used or dropped on purpose, the manifest records the sha256 of
every source weight file, and the output directory appears only once it is complete.
"""

from __future__ import annotations

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
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import psutil  # a dependency of accelerate
import torch
from tqdm import tqdm
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.dynamic_module_utils import custom_object_save
from transformers.utils import logging as transformers_logging

import ladder
from ladder.auto import LadderLlamaConfig, LadderLlamaForCausalLM
from ladder.errors import UsageError, first_line
from ladder.files import atomic_directory, sha256_file
from ladder.layer_search import LayerSearch, calibration_from_files, choose_ladder_layers
from ladder.layers import AutoLayers, check_llama_model_type, format_layers, parse_auto_layers, parse_ladder_layers
from ladder.loading import load_model, read_config_dict, resolve_model_path
from ladder.rewire import ladder_config
from ladder.tensor_io import (
    INDEX_NAME,
    OutputShard,
    Shard,
    ShardedTensorIndex,
    ShardedWriter,
    TensorSpec,
    check_weight_map,
    copy_file,
    plan_shards,
    read_chunks,
    shard_filenames,
    split_rows,
    weight_files,
    write_index,
)

from .gguf import inspect_llama_gguf
from .verify import Damage, damage_problems, measure_damage, prompt_ids

DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # what save_pretrained uses ("5GB")
PICKLE_INDEX_NAME = "pytorch_model.bin.index.json"
# Weights in other formats or layouts (TF, Flax, ONNX, Meta's consolidated.pth): stale once the
# wiring changes, so they are not copied.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx")
# Written fresh rather than copied; the source's own model card is kept as README.source.md.
WRITTEN_FILES = ("config.json", "conversion.json", "README.md", INDEX_NAME, PICKLE_INDEX_NAME)
# llama.cpp file names end in the quantization type: SmolLM2-135M-Instruct.Q4_1.gguf.
GGUF_TYPE_SUFFIX = re.compile(r"[.-](?:I?Q\d\w*|B?F\d+)$", re.IGNORECASE)


@dataclass
class Source:
    """A checkpoint opened for conversion. Of safetensors and pickle weights only the headers
    are read so far; a GGUF file is dequantized whole by transformers (GGUF models are small)."""

    path: Path
    format: str  # "safetensors", "pickle" or "gguf"
    config: PretrainedConfig
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
    weights: str  # "copied" (files as they are) or "rewritten" (tensors streamed)
    tensors: int
    weight_bytes: int
    shards: list[str]
    dropped: dict[str, str]  # tensor name -> why
    not_copied: list[str]
    source_sha256: dict[str, str]  # weight file name -> hash
    seconds: float = 0.0
    damage: Damage | None = None
    verify_skipped: str | None = None
    layer_search: LayerSearch | None = None  # `--layers auto:N`: every candidate's measured damage and the choice


def _say(progress: bool, message: str) -> None:
    if progress:
        print(message, file=sys.stderr, flush=True)


def default_output_dir(source: Path, num_ladder_layers: int) -> Path:
    """runs/convert/<source name>-ladder<N>, the name a GGUF file's quantization suffix removed."""
    name = GGUF_TYPE_SUFFIX.sub("", source.stem) if source.suffix == ".gguf" else source.resolve().name
    return Path("runs") / "convert" / f"{name}-ladder{num_ladder_layers}"


def _check_output_location(source: Path, out: Path) -> None:
    source, out = source.resolve(), out.resolve()
    if out == source or source in out.parents:
        raise UsageError(f"output {out} is inside the source {source}; choose a directory outside it")
    if out in source.parents:
        raise UsageError(f"output {out} contains the source {source}; replacing it would delete the source")


def _read_config(directory: Path) -> PretrainedConfig:
    check_llama_model_type(read_config_dict(directory).get("model_type"), str(directory / "config.json"))
    try:
        return AutoConfig.from_pretrained(directory)
    except (OSError, ValueError, TypeError) as error:
        raise UsageError(f"cannot read {directory / 'config.json'}: {first_line(error)}") from None


def _load_pickle(path: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as error:
        raise UsageError(f"cannot read {path} with torch.load(weights_only=True): {first_line(error)}") from None
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise UsageError(f"{path} does not hold a state dict of tensors")
    return state


def _open_directory(directory: Path, config: PretrainedConfig, allow_pickle: bool) -> Source:
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


def _load_gguf(path: Path, dtype: torch.dtype) -> Source:
    model, tokenizer = load_model(path, dtype)
    tensors = {name: TensorSpec(name, t.dtype, tuple(t.shape)) for name, t in model.state_dict().items()}
    return Source(path, "gguf", model.config, tensors, [path], model=model, tokenizer=tokenizer)


def check_tensors(source: dict[str, TensorSpec], skeleton: PreTrainedModel) -> dict[str, str]:
    """Match the source's tensors with what `skeleton` (the ladder model, on the meta device)
    holds: every shape must agree, and a tensor it does not hold is dropped only for a known
    reason. Returns the dropped tensors, each with its reason."""
    expected = {name: tuple(t.shape) for name, t in skeleton.state_dict().items()}
    dropped = {}
    if skeleton.config.tie_word_embeddings:
        expected.pop("lm_head.weight")
        if "lm_head.weight" in source:
            dropped["lm_head.weight"] = "tied to model.embed_tokens.weight"
    for name in source:
        if name.endswith("rotary_emb.inv_freq"):
            dropped[name] = "recomputed from the config"
    if unknown := [name for name in source if name not in expected and name not in dropped]:
        raise UsageError(f"tensor {', '.join(unknown[:3])} is not part of a Llama with this config "
                         f"({len(unknown)} such tensor{'s' if len(unknown) > 1 else ''})")
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
    groups = [kept_in_shard for shard in source.shards
              if (kept_in_shard := tuple(names[s.name] for s in shard.tensors if s.name in names))]
    return [OutputShard(filename, group) for filename, group in zip(shard_filenames(len(groups)), groups)]


def _source_blocks(source: Source, bar: tqdm) -> Iterator[tuple[TensorSpec, torch.Tensor]]:
    """Every source tensor in reading order, in row blocks."""
    if source.format == "safetensors":
        for shard in source.shards:
            yield from read_chunks(shard, lambda data: bar.update(len(data)))
        return
    for path in source.weight_files:
        state = _load_pickle(path) if source.format == "pickle" else source.model.state_dict()
        for name, tensor in state.items():
            yield from split_rows(source.tensors[name], tensor)
        bar.update(path.stat().st_size)


def _rewrite_weights(source: Source, layout: list[OutputShard], directory: Path, bar: tqdm) -> None:
    """Stream the kept tensors into the planned shards (which cast them to their output dtype)."""
    writer = ShardedWriter(directory, layout)
    kept = {spec.name for shard in layout for spec in shard.tensors}
    for spec, block in _source_blocks(source, bar):
        if spec.name in kept:
            writer.write(spec.name, block)
    writer.close()


def _copy_weights(shards: list[Shard], directory: Path, bar: tqdm) -> None:
    """Copy the weight files as they are, and their index."""
    for shard in shards:
        copy_file(shard.path, directory / shard.path.name, bar.update)
    if any(shard.path.name != "model.safetensors" for shard in shards):
        write_index(directory, [OutputShard(shard.path.name, shard.tensors) for shard in shards])


class _Cancelled(Exception):
    """Raised inside a hashing thread to stop it at its next chunk."""


class _SourceHasher:
    """The sha256 of each source weight file, computed by worker threads while the main thread
    writes the output: hashing is CPU work and writing mostly waits for the disk, so they overlap
    (and a file read by both at about the same time comes from the disk once)."""

    def __init__(self, paths: list[Path], bar: tqdm):
        self._cancelled, self._lock, self._bar = threading.Event(), threading.Lock(), bar
        self._pool = ThreadPoolExecutor(max_workers=max(1, min(len(paths), os.cpu_count() or 1)))
        self._jobs = {path.name: self._pool.submit(sha256_file, path, on_chunk=self._tick) for path in paths}

    def _tick(self, nbytes: int) -> None:
        if self._cancelled.is_set():
            raise _Cancelled
        with self._lock:
            self._bar.update(nbytes)

    def results(self) -> dict[str, str]:
        return {name: job.result() for name, job in self._jobs.items()}

    def __enter__(self) -> _SourceHasher:
        return self

    def __exit__(self, *exception) -> None:
        self._cancelled.set()
        self._pool.shutdown(wait=True, cancel_futures=True)


def _flush_to_disk(directory: Path) -> None:
    """fsync every file once at the end (not each as it is written, which would make the writes
    wait for the disk one file at a time), before the directory is renamed into place."""
    for path in directory.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())


def _write_config(directory: Path, config: LadderLlamaConfig, skeleton: PreTrainedModel, dtype: str) -> None:
    """config.json with `auto_map`, and the modeling files it names, so that the checkpoint also
    loads with trust_remote_code=True where `ladder` is not installed: what save_pretrained writes
    besides the weights."""
    config.architectures = [type(skeleton).__name__]
    if dtype in ("float32", "bfloat16", "float16"):
        config.dtype = dtype
    custom_object_save(skeleton, directory, config=config)
    config.save_pretrained(directory)


def _dtype_name(tensors: list[TensorSpec]) -> str:
    names = sorted({str(spec.dtype).removeprefix("torch.") for spec in tensors if spec.dtype.is_floating_point})
    return names[0] if len(names) == 1 else "mixed (" + ", ".join(names) + ")"


def _fits_in_memory(tensors: list[TensorSpec]) -> str | None:
    """Why verification would not fit in memory, or None when it does."""
    needed = 2 * 4 * sum(math.prod(spec.shape) for spec in tensors)  # both models, in float32
    available = psutil.virtual_memory().available
    if needed < 0.8 * available:
        return None
    return (f"skipped: both models need about {needed / 1e9:.1f} GB in float32, {available / 1e9:.1f} GB "
            "is available (--verify runs it anyway)")


def _verify(source: Source, converted: Path, dtype: torch.dtype | str) -> Damage:
    """Load the written checkpoint as transformers will, and the original the same way, and
    compare them in float32 (same weights, so only the wiring differs)."""
    bars_were_on = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()  # two "Loading weights" bars say nothing here
    try:
        ladder_model = AutoModelForCausalLM.from_pretrained(converted, dtype=dtype).float().eval()
        if source.model is not None:
            original = source.model.float().eval()
        else:
            original = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype).float().eval()
    finally:
        if bars_were_on:
            transformers_logging.enable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(converted)
    except (OSError, ValueError, TypeError):
        tokenizer = None
    return measure_damage(original, ladder_model, prompt_ids(tokenizer, ladder_model.config.vocab_size))


def _search_layers(source: Source, auto: AutoLayers, calibration: list[Path] | None, progress: bool) -> LayerSearch:
    """Run the `auto:N` search on the source model (loaded whole, in float32, unless it is a GGUF
    file, which is loaded already) with calibration text from training data."""
    if source.model is not None:
        model, tokenizer = source.model, source.tokenizer
    else:
        model, tokenizer = load_model(source.path)
    _say(progress, f"{auto}: measuring the damage of each candidate layer set on calibration text ...")
    search = choose_ladder_layers(model, calibration_from_files(tokenizer, calibration), auto)
    _say(progress, search.summary())
    return search


def _model_card(summary: ConversionSummary, kept_source_card: bool) -> str:
    source_name = Path(summary.source).name
    lines = [
        "---", "library_name: transformers", "tags:", "- ladder-residual", "- llama", "---", "",
        f"# {Path(summary.output).name}", "",
        f"`{source_name}` rewired with Ladder Residual (Zhang et al., arXiv 2501.06589) in "
        f"{len(summary.ladder_layers)} of its {summary.num_hidden_layers} layers ({format_layers(summary.ladder_layers)}), "
        f"by ladder-llama {ladder.__version__}. No weight was changed ({summary.dtype}): in a ladder layer each "
        "module reads the residual stream from before the previous module's output was added, so under tensor "
        "parallelism one module's all-reduce overlaps the next module's compute. Until it is retrained "
        "(`ladder adapt`) the model is less accurate than the original.", "",
        "## Loading", "", "```python",
        "import ladder.auto  # registers the ladder model with transformers",
        "from transformers import AutoModelForCausalLM", "",
        "model = AutoModelForCausalLM.from_pretrained(PATH)", "```", "",
        "Without the `ladder` package, pass `trust_remote_code=True` to `AutoModelForCausalLM.from_pretrained` "
        "and `AutoTokenizer.from_pretrained` (the modeling files are included).", "",
        "## Conversion damage, before retraining", "",
    ]
    damage = summary.damage
    if damage is None:
        lines.append(f"Not measured ({summary.verify_skipped}).")
    else:
        lines += [
            f"On {damage.prompts} fixed prompts ({damage.tokens} tokens), against the original:", "",
            "| measure | value |", "|---|---|",
            f"| max abs. difference of hidden states before the first ladder layer | {damage.hidden_max_abs_diff:g} |",
            f"| next-token top-1 agreement | {damage.top1_agreement:.1%} |",
            f"| mean KL(original \\|\\| ladder), nats | {damage.mean_kl:.4f} |",
        ]
    lines += ["", "`conversion.json` records the source, the sha256 of its weight files, and these figures."]
    if kept_source_card:
        lines.append("The source's own model card is kept as `README.source.md`.")
    return "\n".join(lines) + "\n"


def convert_checkpoint(
    source: str | Path | None,
    out: str | Path | None = None,
    ladder_layers: str | int | list[int] | None = None,
    dtype: torch.dtype | None = None,
    max_shard_size: int | None = None,
    force: bool = False,
    verify: bool | None = None,
    allow_pickle: bool = False,
    progress: bool = False,
    calibration: list[str | Path] | None = None,
) -> ConversionSummary:
    """Write a ladder copy of `source` (a checkpoint directory, a .gguf file, or None for the
    embedded SmolLM2) into `out` (default `runs/convert/<name>-ladder<N>`).

    `ladder_layers`: N (upper N), "16-31", "3,5,7" or a list; default the upper half; "auto:N" or
    "auto:N:any" measure which layers to rewire (`ladder.layer_search`) on `calibration` text files or
    folders (default: training books from the data folder, never evaluation text). `dtype`:
    cast floating tensors (default: keep the source's; float32 for GGUF). `max_shard_size` in
    bytes: reshard (default: keep the source's shards). `verify`: None = when both models fit in
    memory. Bad input raises `UsageError` before anything is written.
    """
    started = time.perf_counter()
    source_path = resolve_model_path(source)
    is_gguf = source_path.suffix == ".gguf"
    if is_gguf:
        num_hidden_layers = inspect_llama_gguf(source_path).num_hidden_layers
    else:
        directory_config = _read_config(source_path)
        num_hidden_layers = directory_config.num_hidden_layers
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
        opened = _load_gguf(source_path, dtype or torch.float32)
    else:
        opened = _open_directory(source_path, directory_config, allow_pickle)
    search = None
    if auto is not None:
        search = _search_layers(opened, auto, calibration, progress)
        layers = search.chosen
    config = ladder_config(opened.config, layers)
    with torch.device("meta"):
        skeleton = LadderLlamaForCausalLM(config)
    dropped = check_tensors(opened.tensors, skeleton)
    kept = [dataclasses.replace(spec, dtype=dtype) if dtype is not None and spec.dtype.is_floating_point else spec
            for spec in opened.tensors.values() if spec.name not in dropped]
    copy_as_is = (opened.format == "safetensors" and not dropped and max_shard_size is None
                  and all(spec.dtype == opened.tensors[spec.name].dtype for spec in kept))
    layout = [OutputShard(s.path.name, s.tensors) for s in opened.shards] if copy_as_is else \
        _output_layout(opened, kept, max_shard_size)
    summary = ConversionSummary(
        source=str(source_path.resolve()), source_format=opened.format, output=str(out.resolve()),
        num_hidden_layers=num_hidden_layers, ladder_layers=layers, dtype=_dtype_name(kept),
        weights="copied" if copy_as_is else "rewritten", tensors=len(kept),
        weight_bytes=sum(spec.nbytes for spec in kept), shards=[shard.filename for shard in layout],
        dropped=dropped, not_copied=opened.not_copied, source_sha256={}, layer_search=search,
    )
    verify_skipped = _fits_in_memory(kept) if verify is None else None if verify else "skipped: --no-verify"

    with atomic_directory(out, force) as staging:
        total = sum(path.stat().st_size for path in opened.weight_files)
        bars = dict(total=total, unit="B", unit_scale=True, unit_divisor=1024, disable=None if progress else True)
        with (tqdm(desc="copying weights" if copy_as_is else "writing weights", position=0, **bars) as write_bar,
              tqdm(desc="sha256 of the source", position=1, **bars) as hash_bar,
              _SourceHasher(opened.weight_files, hash_bar) as hasher):
            if copy_as_is:
                _copy_weights(opened.shards, staging, write_bar)
            else:
                _rewrite_weights(opened, layout, staging, write_bar)
            summary.source_sha256 = hasher.results()
        _write_config(staging, config, skeleton, summary.dtype)
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
            summary.damage = _verify(opened, staging, dtype or (torch.float32 if is_gguf else "auto"))
            if problems := damage_problems(summary.damage):
                raise RuntimeError(f"verification failed, nothing written: {'; '.join(problems)}")
        summary.verify_skipped = verify_skipped
        summary.seconds = round(time.perf_counter() - started, 2)
        (staging / "README.md").write_text(_model_card(summary, kept_source_card))
        manifest = {"tool": "ladder-llama", "version": ladder.__version__,
                    "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    **dataclasses.asdict(summary)}
        (staging / "conversion.json").write_text(json.dumps(manifest, indent=2) + "\n")
        _flush_to_disk(staging)
    return summary
