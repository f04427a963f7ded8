"""Carry out a `Conversion` in a staging directory (`atomic_directory`) that appears under its name
only once complete: the weights (the source's files copied or hard-linked as they are, or shards
rewritten), config and modeling files, the other files, verification, model card, conversion.json.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

import ladder
import ladder.model
from ladder.errors import UsageError
from ladder.io.files import atomic_directory
from ladder.io.loading import load_config
from ladder.io.model_card import SourceFacts, loading_section, origin_line, render_card, source_facts
from ladder.io.tensors import SINGLE_NAME, OutputShard, ShardedTensorIndex, write_index, write_shards
from ladder.layers import format_layers

from .layout import Conversion, ConversionSummary, Source, say

if TYPE_CHECKING:
    import torch

    from .verify import Damage

# What save_pretrained writes beside config.json so that the checkpoint loads with
# trust_remote_code=True: the files `auto_map` names and their relative imports.
MODELING_FILES = ("configuration_ladder.py", "modeling_ladder.py", "config_rules.py")


def write_conversion(conversion: Conversion, force: bool, progress: bool, started: float) -> ConversionSummary:
    """Write `conversion` into `conversion.out`, completing and returning its summary; `started` (a
    `time.perf_counter()`) times the whole conversion. `force` replaces only an earlier conversion."""
    summary, source = conversion.summary, conversion.source
    with atomic_directory(conversion.out, force, command="convert") as staging:
        _write_weights(conversion, staging, progress)
        _write_config(staging, conversion.config)
        # Tokenizer, generation config, licence (a GGUF file's saved); the model card as README.source.md.
        for path in source.other_files:
            shutil.copyfile(path, staging / path.name)
        if source.card is not None:
            shutil.copyfile(source.card, staging / "README.source.md")
        if source.tokenizer is not None:
            source.tokenizer.save_pretrained(staging)
            source.model.generation_config.save_pretrained(staging)
        if summary.verify_skipped is None:
            summary.damage = _verify(source, staging, conversion.layout, progress)
        summary.seconds = round(time.perf_counter() - started, 2)
        (staging / "README.md").write_text(_model_card(summary, source_facts(source.path), source.card is not None))
        created = datetime.now(timezone.utc).isoformat(timespec="seconds")
        manifest = {"tool": "ladder-llama", "version": ladder.__version__, "created": created}
        (staging / "conversion.json").write_text(json.dumps(manifest | dataclasses.asdict(summary), indent=2) + "\n")
        for path in staging.iterdir():  # every file on the disk before the folder is renamed into place
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    return summary


def _write_weights(conversion: Conversion, staging: Path, progress: bool) -> None:
    source, summary = conversion.source, conversion.summary
    if summary.weights == "rewritten":  # not the source's files as they are
        write_shards(staging, conversion.layout, _tensor_reader(source))
        return
    sizes = {shard.path: shard.path.stat().st_size for shard in source.shards}
    place = os.link if summary.weights == "hard-linked" else shutil.copyfile
    with tqdm(
        desc="weights", total=sum(sizes.values()), unit="B", unit_scale=True, disable=None if progress else True
    ) as bar:
        for path, size in sizes.items():
            place(path, staging / path.name)
            bar.update(size)
    if any(shard.filename != SINGLE_NAME for shard in conversion.layout):  # the source's files, as they are
        write_index(staging, conversion.layout)


def _write_config(directory: Path, config: dict) -> None:
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in MODELING_FILES:
        shutil.copyfile(Path(ladder.model.__file__).parent / name, directory / name)


def _tensor_reader(source: Source | Path) -> Callable[[str], torch.Tensor]:
    """Tensor name -> tensor; a safetensors file is opened for each read (one kept open stays mapped,
    and every page read would count in the process's memory until it closes)."""
    if isinstance(source, Source) and source.model is not None:
        return source.model.state_dict().__getitem__
    index = ShardedTensorIndex.from_directory(source.path if isinstance(source, Source) else source)

    def read(name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(index.shard_of(name).path, framework="pt") as handle:
            return handle.get_tensor(name)

    return read


def _verify(source: Source, converted: Path, layout: list[OutputShard], progress: bool) -> Damage:
    """The conversion damage: the written checkpoint against the original in float32, both rounded
    to the written dtype, one module at a time (`measure_damage_layerwise`). Nothing is written
    where the written model is broken (a `UsageError` where the source's outputs are not finite, a
    bug of this tool otherwise)."""
    say(progress, "verifying: both models on fixed prompts ...")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .verify import damage_not_finite, damage_problems, measure_damage_layerwise, prompt_ids

    config = load_config(converted)
    source_config = source.model.config if source.model is not None else load_config(source.path)
    with torch.device("meta"):
        ladder_model = AutoModelForCausalLM.from_config(config).eval()
        original = AutoModelForCausalLM.from_config(source_config).eval()
    dtypes = {spec.name: getattr(torch, spec.dtype) for shard in layout for spec in shard.tensors}
    try:
        tokenizer = AutoTokenizer.from_pretrained(converted, trust_remote_code=False)
    except (OSError, ValueError, TypeError):
        tokenizer = None
    prompts = prompt_ids(tokenizer, config.vocab_size)
    damage = measure_damage_layerwise(
        original, ladder_model, _tensor_reader(source), _tensor_reader(converted), dtypes, prompts
    )
    if broken := damage_not_finite(damage):  # bad input: the source's own outputs are not finite
        raise UsageError(f"verification failed, nothing written: {broken}")
    if problems := damage_problems(damage):
        raise RuntimeError(f"verification failed, nothing written: {'; '.join(problems)}")
    return damage


def _model_card(summary: ConversionSummary, source: SourceFacts, kept_source_card: bool) -> str:
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
    lines += ["", "`conversion.json` records the source, the settings and these figures."]
    if kept_source_card:
        lines.append("The source's own model card is kept as `README.source.md`.")
    if source.license:
        lines.append(
            f"The licence is the source's ({source.license_name or source.license}); its licence files, "
            "if it had any, are copied beside the weights."
        )
    return render_card(source, Path(summary.output).name, "\n".join(lines))
