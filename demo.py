"""`make demo` (or `ladder demo`): the whole pipeline on the embedded SmolLM2-135M-Instruct.

Converts the recipe's upper layers into ladder form, retrains them with the recipe, and scores the
original, the ladder model before retraining and the ladder model after it side by side on the
`demo` eval suite. It drives the three stages' own command lines, so each step is one a user could
type. Everything lands under runs/demo; a rerun reuses what is finished (the conversion, the
tokenized data, the retrained model, every score in the demo's eval cache) unless `--redo` names it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

from ladder.errors import ArgumentParser, UsageError
from ladder.files import atomic_write

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
    parser.add_argument("--recipe", type=Path, default=Path("recipes/smollm2-135m-ladder-cpu.yaml"),
                        help="adapt recipe; its model.path and model.ladder_layers say what to convert "
                        "(default: %(default)s)")
    parser.add_argument("--suite", default="demo", help="eval suite name or .yaml file (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("runs/demo"), help="working folder (default: %(default)s)")
    parser.add_argument("--redo", nargs="+", default=[], choices=[*STAGES, "all"], metavar="STAGE",
                        help=f"do these stages again instead of reusing their results: {', '.join(STAGES)} or all")
    return parser


@contextlib.contextmanager
def _stage(number: int, name: str, what: str, seconds: dict[str, float]) -> Iterator[None]:
    print(f"\n=== [{number}/{len(STAGES)}] {name}: {what}", flush=True)
    started = time.monotonic()
    yield
    seconds[name] = round(time.monotonic() - started, 1)
    print(f"=== {name} took {seconds[name]:.0f} s", flush=True)


def _check(status: int, stage: str) -> None:
    if status:
        raise SystemExit(f"ladder demo: the {stage} stage failed (exit status {status}); see above")


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    redo = set(STAGES) if "all" in args.redo else set(args.redo)

    # The stages load torch, transformers and lm-eval: import them once the arguments are good.
    from adapt import cli as adapt_cli
    from adapt.recipe import load_recipe
    from convert import cli as convert_cli
    from eval import cli as eval_cli

    recipe = load_recipe(args.recipe)
    if recipe.model.ladder_layers is None:
        raise UsageError(f"recipe {args.recipe}: the demo converts model.path, so model.ladder_layers must name the layers")
    original = recipe.model.path or "embedded"
    ladder_dir, adapt_dir, report_dir = args.out / "ladder", args.out / "adapt", args.out / "report"
    data_cache, eval_cache = args.out / "data", args.out / "eval-cache"
    adapt_args = [
        str(args.recipe), f"model.path={ladder_dir}", "model.ladder_layers=null", f"output_dir={adapt_dir}",
        f"data.cache_dir={data_cache}", "resume=true",  # resume: a finished run returns its model, a killed one continues
    ]
    seconds: dict[str, float] = {}
    reused = []
    started = time.monotonic()

    with _stage(1, "convert", f"{original} -> {ladder_dir}, ladder layers: {recipe.model.ladder_layers}", seconds):
        if "convert" not in redo and (ladder_dir / "config.json").is_file():
            print(f"reusing {ladder_dir} (--redo convert converts again)")
            reused.append("convert")
        else:
            source = [] if original == "embedded" else [original]
            layers = recipe.model.ladder_layers
            layers = ",".join(map(str, layers)) if isinstance(layers, list) else str(layers)
            _check(convert_cli.main([*source, "--layers", layers, "--out", str(ladder_dir), "--force"]), "convert")

    with _stage(2, "data", f"tokenize the recipe's books into {data_cache}", seconds):
        if "data" in redo:
            shutil.rmtree(data_cache, ignore_errors=True)
        _check(adapt_cli.main([*adapt_args, "--prepare-data"]), "data")

    with _stage(3, "adapt", f"retrain with {args.recipe} -> {adapt_dir}/model", seconds):
        if "adapt" in redo:
            shutil.rmtree(adapt_dir, ignore_errors=True)
        elif (adapt_dir / "model" / "config.json").is_file():
            reused.append("adapt")
        _check(adapt_cli.main(adapt_args), "adapt")

    with _stage(4, "eval", f"score {', '.join(LABELS)} on the {args.suite} suite -> {report_dir}", seconds):
        if "eval" in redo:
            shutil.rmtree(eval_cache, ignore_errors=True)
        models = [f"{LABELS[0]}={original}", f"{LABELS[1]}={ladder_dir}", f"{LABELS[2]}={adapt_dir / 'model'}"]
        _check(eval_cli.main([*models, "--suite", args.suite, "--out", str(report_dir), "--force",
                              "--cache", str(eval_cache)]), "eval")

    seconds["total"] = round(time.monotonic() - started, 1)
    report = json.loads((report_dir / "report.json").read_text())
    summary = _summary(report["rows"], adapt_dir, seconds, reused)
    print("\n" + summary)
    # The eval stage wrote the report; the demo adds its stage times to it.
    report["pipeline"] = {"seconds": seconds, "reused": reused}
    atomic_write(report_dir / "report.json", json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    atomic_write(report_dir / "report.md", (report_dir / "report.md").read_text().rstrip("\n") + "\n\n" + summary + "\n")
    return 0


def _summary(rows: list[dict], adapt_dir: Path, seconds: dict[str, float], reused: list[str]) -> str:
    lines = ["## Pipeline", "", "| stage | seconds |", "|---|---|"]
    lines += [f"| {name}{' (reused)' if name in reused else ''} | {value:.0f} |" for name, value in seconds.items()]
    headline = next((r for r in rows if (r["task"], r["metric"]) == HEADLINE), None)
    if headline:
        original, ladder, retrained = (headline["scores"][label]["value"] for label in LABELS)
        recovered = (ladder - retrained) / (ladder - original) if ladder != original else float("nan")
        lines += ["", f"Held-out WikiText-2 word perplexity: original {original:.2f}, ladder {ladder:.2f}, "
                      f"retrained {retrained:.2f}: retraining won back {recovered:.0%} of what the rewiring cost."]
    held_out = _adapt_perplexities(adapt_dir / "metrics.jsonl")
    if held_out:
        lines += [f"Held-out book perplexity during retraining (adapt's own evaluation): "
                  f"{' -> '.join(f'{value:.2f}' for value in held_out)}."]
    return "\n".join(lines)


def _adapt_perplexities(metrics: Path) -> list[float]:
    if not metrics.is_file():
        return []
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [record["eval_perplexity"] for record in records if "eval_perplexity" in record]
