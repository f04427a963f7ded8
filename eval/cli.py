"""`ladder eval MODEL [MODEL ...] [--baseline B] [--suite S] [--limit N]`: score models side by side.

The first model (the `--baseline` when given) is the reference column; every other model gets its
difference from it. A model is a checkpoint folder, a .gguf file, or `embedded` (the SmolLM2 GGUF
that `make install` ships), optionally as LABEL=MODEL to name its column. Writes a results folder
(default runs/eval/<time>-<suite>) holding lm-eval's JSON per model and report.md / report.json /
report.png, and prints the table.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ladder.errors import ArgumentParser, UsageError
from ladder.files import ladder_data_dir

from .evaluate import DEFAULT_RUNS, evaluate_models
from .suite import load_suite, suite_names


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="ladder eval",
        description="Score models side by side with lm-evaluation-harness. The first MODEL (or --baseline) is "
        "the reference column; each other model gets its difference from it, with a standard error.",
    )
    parser.add_argument(
        "models", nargs="+", metavar="MODEL",
        help="checkpoint folder, .gguf file, Hub model ID (org/name[@revision]) or `embedded`; LABEL=MODEL names "
        "its column (e.g. original=embedded)",
    )
    parser.add_argument("--baseline", metavar="B", help="the reference model (first column); default: the first MODEL")
    parser.add_argument(
        "--suite", default="smoke", metavar="S",
        help=f"a suite name ({', '.join(suite_names())}) or a suite .yaml file (default: smoke)",
    )
    parser.add_argument("--limit", type=_positive_int, metavar="N", help="score at most N items of each task")
    parser.add_argument("--out", type=Path, metavar="DIR", help="results folder (default: runs/eval/<time>-<suite>)")
    parser.add_argument("--force", action="store_true", help="replace an existing results folder")
    parser.add_argument(
        "--data", type=Path, metavar="DIR", help="benchmark data folder (default: $LADDER_DATA, else ../shared/data)"
    )
    parser.add_argument("--batch-size", type=_positive_int, default=8, metavar="N", help="lm-eval batch size (default 8)")
    parser.add_argument(
        "--cache", type=Path, default=DEFAULT_RUNS / "cache", metavar="DIR",
        help="results cache, keyed by model hash and task config (default: runs/eval/cache)",
    )
    parser.add_argument("--no-cache", action="store_true", help="score everything again, and cache nothing")
    parser.add_argument("-v", "--verbose", action="store_true", help="show lm-eval's log messages")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    suite = load_suite(args.suite).with_limit(args.limit)
    if args.data is not None and not args.data.is_dir():
        raise UsageError(f"data folder {args.data} does not exist")
    # A suite of local files needs the data folder; one of stock lm-eval tasks reads the Hub instead.
    data_dir = args.data or (ladder_data_dir() if suite.offline else None)

    evaluation = evaluate_models(
        ([args.baseline] if args.baseline else []) + args.models, suite, out=args.out, force=args.force,
        data_dir=data_dir, batch_size=args.batch_size, cache_dir=None if args.no_cache else args.cache,
        verbose=args.verbose,
    )
    print(evaluation.table)
    print(f"\nresults in {evaluation.out} ({evaluation.wall_seconds:.0f} s)")
    return 0
