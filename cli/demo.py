"""`make demo` (or `ladder demo`): the whole pipeline on the embedded SmolLM2-135M-Instruct.

Converts the recipe's upper layers into ladder form, retrains them with the recipe, and scores the
original, the ladder model before retraining and the ladder model after it side by side on the
`demo` eval suite. Each step is one a user could type: it calls the stages' library functions and prints the equivalent `ladder` command of each.
Everything lands under runs/demo; a rerun reuses what is finished (the conversion, the
tokenized data, the retrained model, every score in the demo's eval cache) unless `--redo` names it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

from ladder.errors import ArgumentParser, UsageError
from ladder.io.files import atomic_write

# Every file the demo reads is local: switch the Hub off before transformers or datasets load.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

STAGES = ("convert", "data", "adapt", "eval")
LABELS = ("original", "ladder", "retrained")  # the report's columns
HEADLINE = ("ladder_wikitext", "word_perplexity")  # held-out text: none of it is in the training data


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="ladder demo",
        description="Convert, retrain and evaluate: the embedded SmolLM2-135M-Instruct with the upper layers the "
        "recipe names made ladder, before and after retraining, against the original.",
    )
    parser.add_argument(
        "--recipe",
        type=Path,
        default=Path("recipes/smollm2-135m-ladder-cpu.yaml"),
        help="adapt recipe; its model.path and model.ladder_layers say what to convert (default: %(default)s)",
    )
    parser.add_argument("--suite", default="demo", help="eval suite name or .yaml file (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("runs/demo"), help="working folder (default: %(default)s)")
    parser.add_argument(
        "--redo",
        nargs="+",
        default=[],
        choices=[*STAGES, "all"],
        metavar="STAGE",
        help=f"do these stages again instead of reusing their results: {', '.join(STAGES)} or all",
    )
    return parser


@contextlib.contextmanager
def _stage(number: int, name: str, what: str, seconds: dict[str, float]) -> Iterator[None]:
    print(f"\n=== [{number}/{len(STAGES)}] {name}: {what}", flush=True)
    started = time.monotonic()
    yield
    seconds[name] = round(time.monotonic() - started, 1)
    print(f"=== {name} took {seconds[name]:.0f} s", flush=True)


def _command(*words: object) -> None:
    print("$ ladder " + " ".join(shlex.quote(str(word)) for word in words), flush=True)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    redo = set(STAGES) if "all" in args.redo else set(args.redo)

    # The stages load torch, transformers and lm-eval: import them once the arguments are good.
    from ladder.adapt.recipe import load_recipe
    from ladder.adapt.train import TrainingDiverged, prepare, resume_point, train
    from ladder.convert.cli import format_summary
    from ladder.convert.convert import conversion_differences, convert_checkpoint
    from ladder.eval.evaluate import evaluate_models
    from ladder.eval.suite import load_suite
    from ladder.layers import format_layers

    recipe = load_recipe(args.recipe)
    if recipe.model.ladder_layers is None:
        raise UsageError(
            f"recipe {args.recipe}: the demo converts model.path, so model.ladder_layers must name the layers"
        )
    suite = load_suite(args.suite)
    original = recipe.model.path or "embedded"
    ladder_dir, adapt_dir, report_dir = args.out / "ladder", args.out / "adapt", args.out / "report"
    data_cache, eval_cache = args.out / "data", args.out / "eval-cache"
    adapt_overrides = [
        f"model.path={ladder_dir}",
        "model.ladder_layers=null",
        f"output_dir={adapt_dir}",
        f"data.cache_dir={data_cache}",
        "resume=true",  # resume: a finished run returns its model, a killed one continues
    ]
    adapt_recipe = load_recipe(args.recipe, adapt_overrides)
    # A result made under other settings is never reused: it is refused here, before any stage runs,
    # naming what differs, unless --redo asks for it again. A new conversion makes the retrained
    # model stale too (its recipe names the same folder, so only this order can tell).
    reuse_conversion = "convert" not in redo and (ladder_dir / "config.json").is_file()
    if reuse_conversion and (differences := conversion_differences(ladder_dir, original, recipe.model.ladder_layers)):
        raise UsageError(
            f"{ladder_dir} was converted with other settings ({', '.join(differences)} differ from "
            f"{args.recipe}'s model.path and model.ladder_layers); --redo convert converts again"
        )
    if not reuse_conversion:
        redo.add("adapt")
    if "adapt" not in redo:
        try:
            resume_point(adapt_recipe)
        except UsageError as error:
            raise UsageError(f"{error}; for the demo: --redo adapt retrains") from None
    seconds: dict[str, float] = {}
    reused = []
    started = time.monotonic()

    with _stage(1, "convert", f"{original} -> {ladder_dir}, ladder layers: {recipe.model.ladder_layers}", seconds):
        if reuse_conversion:
            print(f"reusing {ladder_dir} (--redo convert converts again)")
            reused.append("convert")
        else:
            layers = recipe.model.ladder_layers  # parsed by convert_checkpoint; text only in the command shown
            shown = format_layers(sorted(layers)) if isinstance(layers, list) else layers
            _command("convert", original, "--layers", shown, "--out", ladder_dir, "--force")
            summary = convert_checkpoint(original, out=ladder_dir, ladder_layers=layers, force=True, progress=True)
            print(format_summary(summary))

    with _stage(2, "data", f"tokenize the recipe's books into {data_cache}", seconds):
        if "data" in redo:
            shutil.rmtree(data_cache, ignore_errors=True)
        _command("adapt", args.recipe, *adapt_overrides, "--prepare-data")
        splits = prepare(adapt_recipe)
        print(f"{len(splits.train)} training and {len(splits.eval)} evaluation blocks")

    with _stage(3, "adapt", f"retrain with {args.recipe} -> {adapt_dir}/model", seconds):
        if "adapt" in redo:
            shutil.rmtree(adapt_dir, ignore_errors=True)
        elif (adapt_dir / "model" / "config.json").is_file():
            reused.append("adapt")
        _command("adapt", args.recipe, *adapt_overrides)
        try:
            train(adapt_recipe)
        except TrainingDiverged as error:
            raise SystemExit(f"ladder demo: the adapt stage failed: {error}") from None

    with _stage(4, "eval", f"score {', '.join(LABELS)} on the {args.suite} suite -> {report_dir}", seconds):
        if "eval" in redo:
            shutil.rmtree(eval_cache, ignore_errors=True)
        models = [f"{LABELS[0]}={original}", f"{LABELS[1]}={ladder_dir}", f"{LABELS[2]}={adapt_dir / 'model'}"]
        _command("eval", *models, "--suite", args.suite, "--out", report_dir, "--force", "--cache", eval_cache)
        evaluation = evaluate_models(models, suite, out=report_dir, force=True, cache_dir=eval_cache)
        print(evaluation.table)

    seconds["total"] = round(time.monotonic() - started, 1)
    report = json.loads((report_dir / "report.json").read_text())
    summary = _summary(report["rows"], adapt_dir, seconds, reused)
    print("\n" + summary)
    # The eval stage wrote the report; the demo adds its stage times to it.
    report["pipeline"] = {"seconds": seconds, "reused": reused}
    atomic_write(report_dir / "report.json", json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    atomic_write(
        report_dir / "report.md", (report_dir / "report.md").read_text().rstrip("\n") + "\n\n" + summary + "\n"
    )
    return 0


def _summary(rows: list[dict], adapt_dir: Path, seconds: dict[str, float], reused: list[str]) -> str:
    lines = ["## Pipeline", "", "| stage | seconds |", "|---|---|"]
    lines += [f"| {name}{' (reused)' if name in reused else ''} | {value:.0f} |" for name, value in seconds.items()]
    headline = next((r for r in rows if (r["task"], r["metric"]) == HEADLINE), None)
    if headline:
        original, ladder, retrained = (headline["scores"][label]["value"] for label in LABELS)
        recovered = (ladder - retrained) / (ladder - original) if ladder != original else float("nan")
        lines += [
            "",
            f"Held-out WikiText-2 word perplexity: original {original:.2f}, ladder {ladder:.2f}, "
            f"retrained {retrained:.2f}: retraining won back {recovered:.0%} of what the rewiring cost.",
        ]
    held_out = _adapt_perplexities(adapt_dir / "metrics.jsonl")
    if held_out:
        lines += [
            f"Held-out book perplexity during retraining (adapt's own evaluation): "
            f"{' -> '.join(f'{value:.2f}' for value in held_out)}."
        ]
    return "\n".join(lines)


def _adapt_perplexities(metrics: Path) -> list[float]:
    if not metrics.is_file():
        return []
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [record["eval_perplexity"] for record in records if "eval_perplexity" in record]
