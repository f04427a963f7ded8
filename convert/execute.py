"""Carry out a conversion `Plan`: write the weights, the config and modeling files, the source's
other files, verify, then the model card and `conversion.json`, all into a staging directory that
appears under its name only once it is complete.

Where no dtype change and no resharding is asked, the source's safetensors files go over as they
are: copied side by side (each byte read once, written with direct I/O and hashed on another
thread: `ladder.io.fs`), reflinked where the filesystem allows, or hard-linked on request
(`weights`); otherwise the tensors stream through `ladder.io.tensors` one 64 MiB block at a time,
hashed as they are read. The manifest records the sha256 of every source weight file (not for
hard links, which would cost a read of every byte).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

import ladder
import ladder.model
from ladder.errors import UsageError
from ladder.io.files import StreamingSha256, atomic_directory, sha256_file
from ladder.io.fs import UNSUPPORTED_LINK_ERRNOS, copy_file, flush_to_disk, link_file
from ladder.io.model_card import SourceFacts, loading_section, origin_line, render_card, source_facts
from ladder.io.tensors import (
    LazyTensorLoader,
    OutputShard,
    Shard,
    ShardedTensorIndex,
    ShardedWriter,
    TensorSpec,
    read_chunks,
    split_rows,
    write_index,
)
from ladder.layers import format_layers

from .plan import ConversionSummary, Plan, Source, load_pickle, say

if TYPE_CHECKING:
    import torch

    from .verify import Damage

# What save_pretrained writes beside config.json so that the checkpoint loads with
# trust_remote_code=True: the files `auto_map` names and their relative imports.
MODELING_FILES = ("configuration_ladder_llama.py", "modeling_ladder_llama.py", "config_rules.py")


def write_conversion(plan: Plan, force: bool, weights: str, progress: bool, started: float) -> ConversionSummary:
    """Write everything `plan` says into `plan.out`, completing and returning its summary; `started`
    (a `time.perf_counter()`) times the whole conversion. `force` replaces only an earlier conversion;
    of two runs into one folder, one is refused in one line, never silently replaced."""
    summary, source = plan.summary, plan.source
    with atomic_directory(plan.out, force, command="convert") as staging:
        _write_weights(plan, staging, weights, progress)
        _write_config(staging, plan.config)
        _copy_other_files(source, staging)
        if plan.verify_skipped is None:
            summary.damage = _checked_damage(source, staging, plan.kept, progress)
        summary.verify_skipped = plan.verify_skipped
        summary.seconds = round(time.perf_counter() - started, 2)
        (staging / "README.md").write_text(_model_card(summary, source_facts(source.path), source.card is not None))
        _write_manifest(staging, summary)
        flush_to_disk(staging)
    return summary


def _write_weights(plan: Plan, staging: Path, weights: str, progress: bool) -> None:
    """The weight files, as they are or rewritten, with the sha256 of each source file."""
    summary, source = plan.summary, plan.source
    total = sum(path.stat().st_size for path in source.weight_files)
    with tqdm(
        desc="weights (sha256 on the way)",
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        disable=None if progress else True,
    ) as bar:
        if plan.copy_as_is:
            summary.weights, summary.source_sha256 = _place_weights(source.shards, staging, weights, bar)
        else:
            summary.source_sha256 = _rewrite_weights(source, plan.layout, staging, bar)


def _copy_other_files(source: Source, staging: Path) -> None:
    """Tokenizer, generation config, licence (a GGUF file's tokenizer saved); the source's model card
    as README.source.md (each checked to stay inside the source folder by `ladder.convert.plan`)."""
    for path in source.other_files:
        shutil.copyfile(path, staging / path.name)
    if source.card is not None:
        shutil.copyfile(source.card, staging / "README.source.md")
    if source.tokenizer is not None:
        source.tokenizer.save_pretrained(staging)
        source.model.generation_config.save_pretrained(staging)


def _checked_damage(source: Source, staging: Path, kept: list[TensorSpec], progress: bool) -> Damage:
    """The conversion damage; an error, and nothing written, where the written model is broken
    (a `UsageError` where the source's outputs are not finite, a bug of this tool otherwise)."""
    say(progress, "verifying: both models on fixed prompts ...")
    from .verify import damage_not_finite, damage_problems

    damage = _verify(source, staging, kept)
    if broken := damage_not_finite(damage):  # bad input: the source's own outputs are not finite
        raise UsageError(f"verification failed, nothing written: {broken}")
    if problems := damage_problems(damage):
        raise RuntimeError(f"verification failed, nothing written: {'; '.join(problems)}")
    return damage


def _write_manifest(staging: Path, summary: ConversionSummary) -> None:
    manifest = {
        "tool": "ladder-llama",
        "version": ladder.__version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **dataclasses.asdict(summary),
    }
    (staging / "conversion.json").write_text(json.dumps(manifest, indent=2) + "\n")


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
        state = load_pickle(path) if source.format == "pickle" else source.model.state_dict()
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


def _write_config(directory: Path, config: dict) -> None:
    """config.json and the modeling files its `auto_map` names, so that the checkpoint also loads
    with trust_remote_code=True where `ladder` is not installed."""
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in MODELING_FILES:
        shutil.copyfile(Path(ladder.model.__file__).parent / name, directory / name)


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
        holder = {name: path for path in source.weight_files for name in load_pickle(path)}
        opened: dict[Path, dict[str, torch.Tensor]] = {}

        def read(name: str) -> torch.Tensor:
            if holder[name] not in opened:
                opened.clear()
                opened[holder[name]] = load_pickle(holder[name])
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

    # Never code the source ships (its model_type is checked; its tokenizer_config.json may name classes).
    config = AutoConfig.from_pretrained(converted, trust_remote_code=False)
    source_config = (
        source.model.config
        if source.model is not None
        else AutoConfig.from_pretrained(source.path, trust_remote_code=False)
    )
    with torch.device("meta"):
        ladder_model = AutoModelForCausalLM.from_config(config).eval()
        original = AutoModelForCausalLM.from_config(source_config).eval()
    dtypes = {spec.name: getattr(torch, spec.dtype) for spec in kept}
    if "lm_head.weight" not in dtypes:  # tied, or dropped as tied
        dtypes["lm_head.weight"] = dtypes["model.embed_tokens.weight"]
    try:
        tokenizer = AutoTokenizer.from_pretrained(converted, trust_remote_code=False)
    except (OSError, ValueError, TypeError):
        tokenizer = None
    prompts = prompt_ids(tokenizer, config.vocab_size)
    with _source_reader(source) as read:
        return measure_damage_layerwise(original, ladder_model, read, _safetensors_reader(converted), dtypes, prompts)


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
