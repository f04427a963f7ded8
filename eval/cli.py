"""`ladder eval MODEL [MODEL ...] [--baseline B] [--suite S] [--limit N]`: score models side by side.

The first model (the `--baseline` when given) is the reference column; every other model gets its
difference from it. A model is a checkpoint folder, a .gguf file, or `embedded` (the SmolLM2 GGUF
that `make install` ships), optionally as LABEL=MODEL to name its column. Writes a results folder
(default runs/eval/<time>-<suite>) holding lm-eval's JSON per model and report.md / report.json /
report.png, and prints the table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import shutil
import time
from pathlib import Path

from ladder.errors import ArgumentParser, UsageError
from ladder.files import atomic_directory, atomic_write, ladder_data_dir

from .suite import SuiteTask, load_suite, suite_names

DEFAULT_RUNS = Path("runs/eval")


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
        help="checkpoint folder, .gguf file or `embedded`; LABEL=MODEL names its column (e.g. original=embedded)",
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
        "--backend", choices=("hf", "vllm"), default="hf",
        help="hf: transformers in this process (default); vllm: a vLLM engine per model (in .venv-serve: make eval BACKEND=vllm)",
    )
    parser.add_argument("--tp", type=_positive_int, default=1, metavar="N", help="tensor-parallel ranks of the vllm backend (default 1)")
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
    data_dir = args.data or ladder_data_dir()

    # lm-eval is slow to import: only once the arguments are good.
    import lm_eval

    from . import harness, report

    models = harness.resolve_models(([args.baseline] if args.baseline else []) + args.models)
    if args.backend == "vllm":
        from .vllm_backend import check_models

        check_models(models)
    elif args.tp != 1:
        raise UsageError("--tp is for --backend vllm")
    out = args.out or DEFAULT_RUNS / f"{time.strftime('%Y%m%d-%H%M%S')}-{suite.name}"
    if not args.verbose:
        logging.getLogger("lm_eval").setLevel(logging.ERROR)
        import datasets

        datasets.disable_progress_bars()

    started = time.monotonic()
    with atomic_directory(out, force=args.force) as staging:
        datasets_cache = staging / ".datasets-cache"
        offline = harness.hub_offline(datasets_cache) if suite.offline else contextlib.nullcontext()
        with offline:
            manager = harness.task_manager(suite, data_dir)
            prepared = harness.task_configs(suite, manager)
            results = harness.run_suite(
                models, suite, manager, prepared,
                batch_size=args.batch_size, cache_dir=None if args.no_cache else args.cache,
                backend=args.backend, tensor_parallel=args.tp,
            )
        shutil.rmtree(datasets_cache, ignore_errors=True)
        for model_results in results:
            name = "".join(c if c.isalnum() or c in "-_." else "_" for c in model_results.model.label)
            atomic_write(staging / f"{name}.json", _json(harness.lm_eval_json(model_results)))
        header = {
            "suite": suite.name,
            "tasks": ", ".join(_describe(task) for task in suite.tasks),
            "lm_eval": lm_eval.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "wall_seconds": round(time.monotonic() - started, 1),
        }
        table = report.write_report(results, header, staging)
    print(table)
    print(f"\nresults in {out} ({header['wall_seconds']:.0f} s)")
    return 0


def _describe(task: SuiteTask) -> str:
    settings = []
    if task.num_fewshot:
        settings.append(f"{task.num_fewshot}-shot")
    if task.every > 1:
        settings.append(f"one item in {task.every}")
    if task.limit:
        settings.append(f"at most {task.limit}")
    return f"{task.task} ({', '.join(settings)})" if settings else task.task


def _json(data) -> str:
    return json.dumps(data, indent=2, default=str, ensure_ascii=False) + "\n"
