"""`make demo` (or `ladder demo`): convert the embedded SmolLM2-135M-Instruct's upper layers, retrain
them, and score the original, the ladder model and the retrained one side by side, each step through
the stages' library functions with the equivalent `ladder` command printed. A rerun reuses what is
finished under --out unless `--redo` names it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import time
from collections.abc import Iterator
from pathlib import Path

from tabulate import tabulate

from ladder.errors import ArgumentParser, UsageError
from ladder.io.files import atomic_write
from ladder.io.outputs import check_output, check_removable, make_output_folder, remove_output
from ladder.log import log

# Every file the demo reads is local: switch the Hub off before transformers or datasets load.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

STAGES = ("convert", "data", "adapt", "eval")
LABELS = ("original", "ladder", "retrained")  # the report's columns
HEADLINE = ("ladder_wikitext", "word_perplexity")  # held-out text: none of it is in the training data


@contextlib.contextmanager
def _stage(number: int, name: str, what: str, seconds: dict[str, float]) -> Iterator[None]:
    log.info(f"\n=== [{number}/{len(STAGES)}] {name}: {what}")
    started = time.monotonic()
    yield
    seconds[name] = round(time.monotonic() - started, 1)
    log.info(f"=== {name} took {seconds[name]:.0f} s")


def _command(*words: object) -> None:
    log.info("$ ladder " + " ".join(shlex.quote(str(word)) for word in words))


class Demo:
    """The demo's recipe, suite and folders, loaded and checked before any stage runs."""

    def __init__(self, args: argparse.Namespace) -> None:
        # The stages import torch: the recipe (ladder.adapt.recipe.Recipe) and suite load here.
        from ladder.adapt.recipe import load_recipe
        from ladder.eval.suite import load_suite
        from ladder.io.loading import resolve_model_path

        self.args = args
        self.recipe = load_recipe(args.recipe)
        if self.recipe.model.ladder_layers is None:
            raise UsageError(
                f"recipe {args.recipe}: the demo converts model.path, so model.ladder_layers must name the layers"
            )
        self.original = self.recipe.model.path or "embedded"
        suite_file = [Path(args.suite)] if Path(args.suite).is_file() else []
        out = check_output(
            args.out, "demo", [args.recipe, resolve_model_path(self.original), *suite_file], existing="add"
        )
        self.ladder_dir, self.adapt_dir, self.data_cache = out / "ladder", out / "adapt", out / "data"
        self.report_dir, self.eval_cache = out / "report", out / "eval-cache"
        self.adapt_overrides = [
            f"model.path={self.ladder_dir}",
            "model.ladder_layers=null",
            f"output_dir={self.adapt_dir}",
            f"data.cache_dir={self.data_cache}",
            "resume=true",  # resume: a finished run returns its model, a killed one continues
        ]
        self.redo = set(STAGES) if "all" in args.redo else set(args.redo)
        self.adapt_recipe = load_recipe(args.recipe, self.adapt_overrides)
        self.suite = load_suite(args.suite)
        self.seconds: dict[str, float] = {}
        self.reused: list[str] = []


def main(argv: list[str]) -> int:
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
    demo = Demo(parser.parse_args(argv))
    check_reuse(demo)
    started = time.monotonic()
    convert_stage(demo)
    data_stage(demo)
    adapt_stage(demo)
    eval_stage(demo)
    demo.seconds["total"] = round(time.monotonic() - started, 1)
    write_summary(demo)
    return 0


def check_reuse(demo: Demo) -> None:
    """A result made under other settings is refused before any stage runs, unless --redo asks for
    it again. A new conversion makes the retrained model stale too."""
    from ladder.adapt.preflight import resume_point
    from ladder.convert.convert import conversion_differences

    layers = demo.recipe.model.ladder_layers
    reuse_conversion = "convert" not in demo.redo and (demo.ladder_dir / "config.json").is_file()
    if reuse_conversion and (differences := conversion_differences(demo.ladder_dir, demo.original, layers)):
        raise UsageError(
            f"{demo.ladder_dir} was converted with other settings ({', '.join(differences)} differ from "
            f"{demo.args.recipe}'s model.path and model.ladder_layers); --redo convert converts again"
        )
    if not reuse_conversion:
        demo.redo |= {"convert", "adapt"}
    # Each folder a stage replaces or deletes is an earlier output of the command that writes it.
    check_output(demo.ladder_dir, "convert", [demo.original], force=True)
    check_output(demo.adapt_dir, "adapt", existing="add", what="output_dir")
    check_output(demo.report_dir, "eval", force=True)
    removed = {
        "adapt": (demo.adapt_dir, "adapt"),
        "data": (demo.data_cache, "adapt"),
        "eval": (demo.eval_cache, "eval"),
    }
    for stage, (folder, command) in removed.items():
        if stage in demo.redo:
            check_removable(folder, command)
    if "adapt" not in demo.redo:
        try:
            resume_point(demo.adapt_recipe)
        except UsageError as error:
            raise UsageError(f"{error}; for the demo: --redo adapt retrains") from None


def convert_stage(demo: Demo) -> None:
    from ladder.convert.cli import format_summary
    from ladder.convert.convert import convert_checkpoint
    from ladder.layers import format_layers

    layers = demo.recipe.model.ladder_layers
    with _stage(1, "convert", f"{demo.original} -> {demo.ladder_dir}, ladder layers: {layers}", demo.seconds):
        if "convert" not in demo.redo:
            log.info(f"reusing {demo.ladder_dir} (--redo convert converts again)")
            demo.reused.append("convert")
            return
        shown = format_layers(sorted(layers)) if isinstance(layers, list) else layers  # text only in the command shown
        _command("convert", demo.original, "--layers", shown, "--out", demo.ladder_dir, "--force")
        summary = convert_checkpoint(
            demo.original, out=demo.ladder_dir, ladder_layers=layers, force=True, progress=True
        )
        log.info(format_summary(summary))


def data_stage(demo: Demo) -> None:
    from ladder.adapt.train import prepare

    with _stage(2, "data", f"tokenize the recipe's books into {demo.data_cache}", demo.seconds):
        if "data" in demo.redo:
            remove_output(demo.data_cache, "adapt")
        make_output_folder(demo.data_cache, "adapt")  # adapt's data cache, which a later --redo data may delete
        _command("adapt", demo.args.recipe, *demo.adapt_overrides, "--prepare-data")
        splits = prepare(demo.adapt_recipe)
        log.info(f"{len(splits.train)} training and {len(splits.eval)} evaluation blocks")


def adapt_stage(demo: Demo) -> None:
    from ladder.adapt.train import TrainingDiverged, train

    with _stage(3, "adapt", f"retrain with {demo.args.recipe} -> {demo.adapt_dir}/model", demo.seconds):
        if "adapt" in demo.redo:
            remove_output(demo.adapt_dir, "adapt")
        elif (demo.adapt_dir / "model" / "config.json").is_file():
            demo.reused.append("adapt")
        _command("adapt", demo.args.recipe, *demo.adapt_overrides)
        try:
            train(demo.adapt_recipe)
        except TrainingDiverged as error:
            raise SystemExit(f"ladder demo: the adapt stage failed: {error}") from None


def eval_stage(demo: Demo) -> None:
    from ladder.eval.evaluate import evaluate_models

    report_dir, eval_cache = demo.report_dir, demo.eval_cache
    with _stage(4, "eval", f"score {', '.join(LABELS)} on the {demo.args.suite} suite -> {report_dir}", demo.seconds):
        if "eval" in demo.redo:
            remove_output(eval_cache, "eval")
        make_output_folder(eval_cache, "eval")  # eval's cache, which a later --redo eval may delete
        models = [
            f"{label}={path}" for label, path in zip(LABELS, (demo.original, demo.ladder_dir, demo.adapt_dir / "model"))
        ]
        _command("eval", *models, "--suite", demo.args.suite, "--out", report_dir, "--force", "--cache", eval_cache)
        evaluation = evaluate_models(models, demo.suite, out=report_dir, force=True, cache_dir=eval_cache)
        print(evaluation.table)


def write_summary(demo: Demo) -> None:
    """The stages' times and the headline scores: printed, and added to the eval report."""
    report_dir = demo.report_dir
    report = json.loads((report_dir / "report.json").read_text())
    stages = [
        [f"{name}{' (reused)' if name in demo.reused else ''}", f"{value:.0f}"] for name, value in demo.seconds.items()
    ]
    table = tabulate(stages, ["stage", "seconds"], tablefmt="pipe", colalign=("left", "right"), disable_numparse=True)
    lines = ["## Pipeline", "", table]
    headline = next((r for r in report["rows"] if (r["task"], r["metric"]) == HEADLINE), None)
    if headline:
        original, ladder, retrained = (headline["scores"][label]["value"] for label in LABELS)
        recovered = (ladder - retrained) / (ladder - original) if ladder != original else float("nan")
        lines += [
            "",
            f"Held-out WikiText-2 word perplexity: original {original:.2f}, ladder {ladder:.2f}, "
            f"retrained {retrained:.2f}: retraining won back {recovered:.0%} of what the rewiring cost.",
        ]
    metrics = demo.adapt_dir / "metrics.jsonl"
    records = (
        [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.is_file() else []
    )
    held_out = [record["eval_perplexity"] for record in records if "eval_perplexity" in record]
    if held_out:
        lines += [
            f"Held-out book perplexity during retraining (adapt's own evaluation): "
            f"{' -> '.join(f'{value:.2f}' for value in held_out)}."
        ]
    summary = "\n".join(lines)
    print("\n" + summary)
    report["pipeline"] = {"seconds": demo.seconds, "reused": demo.reused}
    atomic_write(report_dir / "report.json", json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    atomic_write(
        report_dir / "report.md", (report_dir / "report.md").read_text().rstrip("\n") + "\n\n" + summary + "\n"
    )
