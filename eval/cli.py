"""`ladder eval MODEL [MODEL ...] [--baseline B] [--suite S] [--limit N]`: score models side by side.

Several processes (data parallel, one model copy each): `--processes N`, or the same command under
`accelerate launch --multi_gpu --num_processes N -m ladder.eval.cli MODEL ...`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

from ladder.cli_types import non_negative_int, positive_int
from ladder.errors import ArgumentParser, UsageError, first_line, run_command
from ladder.io.files import ladder_cache_dir, ladder_data_dir
from ladder.io.loading import gguf_parsed_once, visible_gpus
from ladder.io.yaml_files import parse_yaml
from ladder.launch import multi_process_launcher

from .backends import BACKENDS
from .evaluate import check_outputs, check_tasks, evaluate_models, quiet_libraries
from .runtime import DEFAULT_BATCH_SIZE, check_processes, resolve_runtime
from .suite import load_suite, suite_names, tasks_suite

DEFAULT_RUNS = Path("runs/eval")
# The options that override every suite task's setting of the same name (SuiteTask's fields).
SUITE_OPTIONS = ("num_fewshot", "apply_chat_template", "fewshot_as_multiturn", "system_instruction", "gen_kwargs")


def _limit(text: str) -> int | float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if 0 < value < 1:
        return value
    if value < 1 or not value.is_integer():
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer or a fraction between 0 and 1")
    return int(value)


def _batch_size(text: str) -> int | str:
    return "auto" if text == "auto" else positive_int(text)


def _gen_kwargs(text: str) -> dict:
    """lm-eval's --gen_kwargs, each value typed as YAML."""
    settings = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(f"{text!r}: expected key=value[,key=value...]")
        try:
            settings[key.strip()] = parse_yaml(value)
        except yaml.YAMLError as error:
            problem = getattr(error, "problem", None) or first_line(error)
            raise argparse.ArgumentTypeError(f"{item!r} does not parse as YAML: {problem}") from None
        if isinstance(settings[key.strip()], dict):
            raise argparse.ArgumentTypeError(f"{item!r}: a value is a number, a string, true/false or a [list]")
    return settings


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="ladder eval",
        description="Score models side by side with lm-evaluation-harness. The first MODEL (or --baseline) is "
        "the reference column; each other model gets its difference from it, with a standard error.",
    )
    parser.add_argument(
        "models",
        nargs="+",
        metavar="MODEL",
        help="checkpoint folder, .gguf file, Hub model ID (org/name[@revision]) or `embedded`; LABEL=MODEL names "
        "its column (e.g. original=embedded)",
    )
    parser.add_argument("--baseline", metavar="B", help="the reference model (first column); default: the first MODEL")
    what = parser.add_mutually_exclusive_group()
    what.add_argument(
        "--suite",
        metavar="S",
        help=f"a suite name ({', '.join(suite_names())}) or a suite .yaml file (default: smoke)",
    )
    what.add_argument(
        "--tasks",
        metavar="T1,T2,...",
        help="lm-eval task, group or tag names, comma-separated as lm_eval takes them: stock ones (from the Hub) "
        "and ours (ladder_piqa, ...), each with its own settings",
    )
    parser.add_argument(
        "--limit",
        type=_limit,
        metavar="N",
        help="score at most N items of each task, or a fraction of them when below 1 (as lm_eval's --limit)",
    )
    parser.add_argument(
        "--num-fewshot",
        "--num_fewshot",
        type=non_negative_int,
        metavar="N",
        help="few-shot examples before each item, on every task (as lm_eval's --num_fewshot; default: the suite's)",
    )
    parser.add_argument("--model_args", help=argparse.SUPPRESS)  # lm_eval's: answered in main
    parser.add_argument(
        "--out",
        "--output_path",
        type=Path,
        metavar="DIR",
        help="results folder (default: runs/eval/<time>-<suite>-<random>)",
    )
    parser.add_argument("--force", action="store_true", help="replace an existing results folder")
    parser.add_argument(
        "--data", type=Path, metavar="DIR", help="benchmark data folder (default: $LADDER_DATA, else ../shared/data)"
    )
    parser.add_argument(
        "--batch-size",
        "--batch_size",
        type=_batch_size,
        default=DEFAULT_BATCH_SIZE,
        metavar="N",
        help=f"lm-eval batch size per process, or `auto` (on a GPU lm-eval finds the largest that fits; "
        f"on the CPU the default, {DEFAULT_BATCH_SIZE})",
    )
    parser.add_argument(
        "--device",
        default="auto",
        metavar="D",
        help="auto (a GPU when one is present, else the CPU; the default), cpu, cuda or cuda:N",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float16", "float32"],
        help="weights' dtype; auto: bfloat16 on a GPU (float16 where it lacks bf16), float32 on the CPU",
    )
    parser.add_argument(
        "--processes",
        type=positive_int,
        default=1,
        metavar="N",
        help="score with N processes, each with a copy of the model and a share of the items "
        "(starts `accelerate launch --multi_gpu --num_processes N`; GPUs, or the CPU over gloo)",
    )
    parser.add_argument(
        "--parallelize",
        action="store_true",
        help="split one model over all visible GPUs (transformers' device_map=auto), for a model too large for one",
    )
    parser.add_argument(
        "--backend",
        choices=tuple(BACKENDS),
        default="hf",
        help="hf: transformers in this process (default); vllm: a vLLM engine per model (in .venv-serve: "
        "make eval BACKEND=vllm)",
    )
    parser.add_argument(
        "--tp", type=positive_int, default=1, metavar="N", help="tensor-parallel ranks of the vllm backend (default 1)"
    )
    parser.add_argument(
        "--data-parallel",
        type=positive_int,
        default=1,
        metavar="N",
        help="vllm backend: N engines (each with --tp ranks, on its own GPUs or CPU cores) splitting the items",
    )
    parser.add_argument(
        "--log-samples",
        action="store_true",
        help="keep lm-eval's per-item records (prompt, target, output or log-likelihoods) in DIR/samples/",
    )
    chat = parser.add_argument_group("instruct models (lm-eval's chat options; override the suite's)")
    chat.add_argument(
        "--apply-chat-template",
        nargs="?",
        const=True,
        default=None,
        metavar="NAME",
        help="render prompts with the tokenizer's chat template (NAME: one of several templates)",
    )
    chat.add_argument(
        "--no-apply-chat-template",
        dest="apply_chat_template",
        action="store_const",
        const=False,
        help="plain prompts even where the suite applies the chat template (a base model)",
    )
    chat.add_argument(
        "--fewshot-as-multiturn",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="few-shot examples as alternating user/assistant turns (needs the chat template)",
    )
    chat.add_argument("--system-instruction", metavar="TEXT", help="a system message before every prompt")
    chat.add_argument(
        "--gen-kwargs",
        type=_gen_kwargs,
        metavar="K=V,...",
        help="generation settings of generating tasks, e.g. max_gen_toks=512,temperature=0",
    )
    parser.add_argument(
        "--cache",
        type=Path,
        metavar="DIR",
        help="results cache, keyed by model hash and task config (default: $LADDER_CACHE/eval, else "
        "~/.cache/ladder/eval: shared by runs from any folder)",
    )
    parser.add_argument("--no-cache", action="store_true", help="score everything again, and cache nothing")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.model_args is not None:
        raise UsageError(
            "--model_args: name the model as MODEL (a checkpoint folder, .gguf file, Hub ID or `embedded`), "
            "its settings with --dtype, --device, --batch-size, --parallelize"
        )
    suite = (
        (tasks_suite(args.tasks) if args.tasks else load_suite(args.suite or "smoke"))
        .with_limit(args.limit)
        .with_options(**{key: getattr(args, key) for key in SUITE_OPTIONS})
    )
    if args.data is not None and not args.data.is_dir():
        raise UsageError(f"data folder {args.data} does not exist")
    # A suite of local files needs the data folder; one of stock lm-eval tasks reads the Hub instead.
    data_dir = args.data or (ladder_data_dir() if suite.offline else None)
    models = ([args.baseline] if args.baseline else []) + args.models
    cache_dir = None if args.no_cache else args.cache or ladder_cache_dir() / "eval"
    # Named here, once: every process of a launched run writes to it.
    out = args.out or DEFAULT_RUNS / f"{time.strftime('%Y%m%d-%H%M%S')}-{suite.name}-{os.urandom(3).hex()}"
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if args.processes > 1 and launched == 1:
        # This command again in N processes (`multi_process_launcher`), after the checks that would
        # otherwise fail once per process.
        from .models import resolve_models

        check_outputs(resolve_models(models), out, cache_dir, data_dir, args.force)
        check_processes(args.device, args.parallelize)
        gpus = visible_gpus() if args.device != "cpu" else 0
        if gpus and args.processes > gpus:
            raise UsageError(f"--processes {args.processes}: only {gpus} GPU(s) are visible (one process per GPU)")
        quiet_libraries(args.verbose)
        check_tasks(suite, data_dir, args.processes)
        command = [*multi_process_launcher(args.processes), "-m", "ladder.eval.cli", *argv, "--out", str(out)]
        return subprocess.run(command).returncode
    if args.processes > 1 and args.processes != launched:
        raise UsageError(f"--processes {args.processes} under a launcher that started {launched}")

    runtime = resolve_runtime(
        args.device, args.dtype, args.batch_size, args.parallelize, args.backend, args.tp, args.data_parallel
    )
    # A GGUF model is parsed once in the run: for its template check, its cache key and its load.
    with gguf_parsed_once():
        evaluation = evaluate_models(
            models,
            suite,
            out,
            runtime,
            force=args.force,
            data_dir=data_dir,
            cache_dir=cache_dir,
            verbose=args.verbose,
            log_samples=args.log_samples,
        )
    if evaluation is not None:  # process 0 of several prints for all
        print(evaluation.table)
        print(f"\nresults in {evaluation.out} ({evaluation.wall_seconds:.0f} s):")
        for report in sorted(evaluation.out.glob("report.*")):
            print(f"  {report}")
    return 0


if __name__ == "__main__":
    sys.exit(run_command("eval", main, sys.argv[1:]))
