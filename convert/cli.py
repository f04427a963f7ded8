"""`ladder convert [MODEL] [--layers SPEC] [--out DIR] ...`: `convert_checkpoint` and its summary."""

from __future__ import annotations

import argparse
from pathlib import Path

from ladder.errors import ArgumentParser
from ladder.io.loading import DTYPE_NAMES
from ladder.layers import format_layers
from ladder.log import log
from ladder.units import parse_size

# Light on purpose (no torch, no transformers): `--help` and a copy-mode conversion start at once.
from .convert import convert_checkpoint
from .layout import WEIGHT_MODES, ConversionSummary


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="ladder convert",
        description="Rewire a Llama, Mistral, Qwen2 or Qwen3 checkpoint (a Hugging Face directory, or a Llama "
        ".gguf file) into Ladder Residual form. No weight changes; the output loads with transformers.",
    )
    parser.add_argument(
        "model",
        nargs="?",
        metavar="MODEL",
        help="checkpoint directory, .gguf file or Hub model ID org/name[@revision] (default: the embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--layers",
        metavar="SPEC",
        help="ladder layers: N (the upper N), a range 16-31, a list 3,5,7, "
        "auto:N (the contiguous N layers the rewiring damages least, measured on calibration text) "
        "or auto:N:any (any N layers) (default: the upper half)",
    )
    parser.add_argument(
        "--calibration",
        nargs="+",
        type=Path,
        metavar="PATH",
        help="with --layers auto:N: text files or folders of training text to measure on "
        "(default: eight Gutenberg training books from the data folder)",
    )
    parser.add_argument(
        "--out", type=Path, metavar="DIR", help="output directory (default: runs/convert/<model>-ladder<N>)"
    )
    parser.add_argument(
        "--dtype", choices=DTYPE_NAMES, help="cast floating weights (default: keep the source's; float32 for GGUF)"
    )
    parser.add_argument(
        "--max-shard-size",
        metavar="SIZE",
        help="reshard into files of at most this size, e.g. 5GB, 500MB, 2GiB (default: the source's shards)",
    )
    parser.add_argument(
        "--weights",
        choices=WEIGHT_MODES,
        default="copy",
        help="how unchanged weight files reach the output: copy (default), "
        "link (hard links: instant, but the output's files ARE the source's, so editing one in place "
        "edits the other; same filesystem only)",
    )
    parser.add_argument("--force", action="store_true", help="replace an earlier `ladder convert` output")
    parser.add_argument(
        "--verify",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="measure the conversion damage on fixed prompts (default: when both models fit in memory)",
    )
    return parser


def _size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError


def format_summary(summary: ConversionSummary) -> str:
    layers = summary.ladder_layers
    shards = summary.shards[0] if len(summary.shards) == 1 else f"{summary.shards[0]} ... {summary.shards[-1]}"
    lines = [
        f"converted {Path(summary.source).name} ({summary.source_format}) -> {summary.output}",
        f"  ladder layers  {len(layers)} of {summary.num_hidden_layers}: {format_layers(layers)}",
        f"  weights        {summary.weights}: {summary.tensors} tensors, {summary.dtype}, "
        f"{_size(summary.weight_bytes)} in {len(summary.shards)} shard{'s' if len(summary.shards) > 1 else ''} ({shards})",
    ]
    if summary.dropped:
        lines.append("  dropped        " + "; ".join(f"{name} ({why})" for name, why in summary.dropped.items()))
    if summary.not_copied:
        lines.append("  not copied     " + ", ".join(summary.not_copied) + " (other weight formats, code, folders)")
    if summary.layer_search is not None:
        lines.append(f"  layer search   {summary.layer_search.summary()}")
    lines.append(f"  time           {summary.seconds:.1f} s")
    damage = summary.damage
    if damage is None:
        lines.append(f"  damage         {summary.verify_skipped}")
    else:
        before = (
            "all layers (no ladder layer)"
            if damage.first_ladder_layer is None
            else f"layer {damage.first_ladder_layer}"
        )
        lines += [
            f"  damage         original vs ladder, no retraining, {damage.prompts} prompts ({damage.tokens} tokens):",
            f"    max |Δ| of hidden states before {before}: {damage.hidden_max_abs_diff:g} (must be 0)",
            f"    next-token top-1 agreement: {damage.top1_agreement:.1%}",
            f"    mean KL(original || ladder): {damage.mean_kl:.4f} nats",
        ]
        if damage.first_ladder_layer is None:
            lines.append(f"    max |Δ| of logits: {damage.logits_max_abs_diff:g} (must be 0)")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    summary = convert_checkpoint(
        args.model,
        out=args.out,
        ladder_layers=args.layers,
        dtype=args.dtype,
        max_shard_size=parse_size(args.max_shard_size, "--max-shard-size") if args.max_shard_size else None,
        force=args.force,
        verify=args.verify,
        progress=True,
        weights=args.weights,
        calibration=args.calibration,
    )
    log.info(format_summary(summary))
    return 0
