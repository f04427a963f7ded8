"""Recovery experiment on SmolLM2-135M: how much of what the rewiring costs does a short retraining
win back per training token, by layer choice and objective, and is that recovery or just adaptation
to the training text? (docs/recovery.md: the method, the commands and the results.)

The grid (`--shapes`, `--objectives`, `--budgets`) retrains the CPU recipe; every shape and budget also
trains a control (the original with the same layers trained the same way). Held-out log-perplexity on
the recipe's evaluation books (in domain) and WikiText-2 validation (out of domain); each condition's
result is kept in OUT/<condition>.json and reused, so the grid runs in chunks and a killed run
continues. Extra `key=value` arguments override the recipe for every trained condition.

    .venv/bin/python experiments/recovery/recovery.py --shapes 8 auto:8 --objectives lm kd hidden --budgets 24576
    .venv/bin/python experiments/recovery/recovery.py --report             # the tables from what is done
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

import ladder
from ladder.adapt.data import load_blocks
from ladder.adapt.losses import block_losses
from ladder.adapt.recipe import SourceSpec, load_recipe, model_path
from ladder.adapt.train import train
from ladder.io.loading import load_model
from ladder.layer_search import calibration_from_blocks, choose_ladder_layers
from ladder.layers import AutoLayers, format_layers, overlapped_all_reduces, parse_layer_choice, resolve_layer_choice

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "smollm2-135m-ladder-cpu.yaml"
WIKITEXT = SourceSpec(path="${LADDER_DATA}/eval/wikitext2_raw/wiki.valid.raw", max_tokens=8192)
OBJECTIVES = {
    "lm": [],
    "kd": ["objective.name=kd"],
    "hidden": ["objective.name=hidden"],
    "lm+hidden": ["objective.hidden_weight=1"],
    "kd+hidden": ["objective.name=kd", "objective.hidden_weight=1"],
}
HELDOUT = ("books", "wikitext")
# Where the held-out sets are scored: the accelerator that `ladder adapt` trains on, when there is one.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@torch.no_grad()
def heldout_losses(model: torch.nn.Module, tokenizer, recipe) -> dict:
    """The mean next-token loss and the tokens of each held-out set: the recipe's books, WikiText-2."""
    cache, seq_len, batch = recipe.data.cache_folder(), recipe.data.seq_len, recipe.batch.micro_batch
    model.to(DEVICE).eval()
    result = {}
    for name, sources in zip(HELDOUT, (recipe.data.eval, [WIKITEXT])):
        blocks = np.asarray(load_blocks(sources, tokenizer, seq_len, cache, "eval").ids)
        losses = [
            block_losses(model, torch.from_numpy(blocks[i : i + batch].astype(np.int64)).to(DEVICE))
            for i in range(0, len(blocks), batch)
        ]
        result[f"{name}_loss"], result[f"{name}_tokens"] = float(torch.cat(losses).mean()), int(blocks.size)
    return result


def shape_name(shape: str) -> str:
    return shape.replace("auto:", "auto") if shape.startswith("auto") else f"upper{shape}"


def resolve_shape(shape: str, recipe, out: Path) -> dict:
    """The layers of a shape; an auto shape is searched once (on the recipe's training blocks, as
    `ladder adapt` calibrates) and kept in OUT/shape-<name>.json with the search's record."""
    path = out / f"shape-{shape_name(shape)}.json"
    if path.exists():
        return json.loads(path.read_text())
    model, tokenizer = load_model(model_path(recipe.model.path))
    searched: dict = {}  # the search's record, for an auto shape

    def search(auto: AutoLayers) -> list[int]:
        train_blocks = load_blocks(
            recipe.data.train, tokenizer, recipe.data.seq_len, recipe.data.cache_folder(), "train"
        )
        found = choose_ladder_layers(model, calibration_from_blocks(train_blocks.ids), auto)
        print(found.summary(), flush=True)
        searched["search"] = dataclasses.asdict(found)
        return found.chosen

    layers = resolve_layer_choice(parse_layer_choice(shape, model.config.num_hidden_layers), search)
    record = {"layers": layers, **searched}
    path.write_text(json.dumps(record, indent=1))
    return record


def run_zero_shot(name: str, layers: list[int] | None, recipe) -> dict:
    model, tokenizer = load_model(model_path(recipe.model.path))
    if layers is not None:
        model = ladder.to_ladder(model, layers)
    started = time.perf_counter()
    losses = heldout_losses(model, tokenizer, recipe)
    return {"condition": name, "layers": layers, **losses, "eval_seconds": round(time.perf_counter() - started, 1)}


def run_trained(name: str, layers: list[int], extra: list[str], overrides: list[str], recipe, out: Path) -> dict:
    started = time.perf_counter()
    run_recipe = load_recipe(
        RECIPE,
        [*overrides, *extra, f"output_dir={out / name}", "eval_every=100000", "data.eval_blocks=0", "resume=true"],
    )
    final = train(run_recipe)
    train_seconds = time.perf_counter() - started
    steps = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    steps = [step for step in steps if "tokens_per_s" in step]
    model, tokenizer = load_model(final)
    return {
        "condition": name,
        "layers": layers,
        "overrides": [*overrides, *extra],
        "tokens": steps[-1]["tokens"],
        "train_seconds": round(train_seconds, 1),
        # Median over the steps after the first (which pays one-time costs), as seconds per step.
        "step_seconds": statistics.median(
            run_recipe.batch.micro_batch * run_recipe.data.seq_len / s["tokens_per_s"] for s in steps[1:] or steps
        ),
        **heldout_losses(model, tokenizer, recipe),
    }


def conditions(args, recipe, out: Path) -> dict[str, Callable[[], dict]]:
    """{name: function computing its result} for the grid, zero-shot first, each control before its runs."""
    plan = {"original": functools.partial(run_zero_shot, "original", None, recipe)}
    for shape in args.shapes:
        layers, tag = resolve_shape(shape, recipe, out)["layers"], shape_name(shape)
        layer_list = "[" + ",".join(map(str, layers)) + "]"
        plan[f"ladder-{tag}"] = functools.partial(run_zero_shot, f"ladder-{tag}", layers, recipe)
        for budget in args.budgets if args.objectives else []:
            control = ["model.ladder_layers=0", "trainable.mode=layers", f"trainable.layers={layer_list}"]
            trained = {f"control-{tag}@{budget}": control}
            for objective in args.objectives:
                trained[f"{tag}+{objective}@{budget}"] = [f"model.ladder_layers={layer_list}", *OBJECTIVES[objective]]
            for name, extra in trained.items():
                extra = [f"budget={budget}", *extra]
                plan[name] = functools.partial(run_trained, name, layers, extra, args.overrides, recipe, out)
    return plan


def report(results: dict[str, dict], out: Path) -> str:
    if "original" not in results:
        return "(no result for `original` yet: the gaps need it)"
    base = results["original"]
    lines = [
        "Zero-shot damage (ladder, no retraining): log-perplexity increase over the original",
        "",
        "| shape | layers | overlapped all-reduces | books | wikitext | search |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in results.items():
        if not name.startswith("ladder-"):
            continue
        tag = name.removeprefix("ladder-")
        shape_file = out / f"shape-{tag}.json"
        cost, search = "-", json.loads(shape_file.read_text()).get("search") if shape_file.exists() else None
        if search:
            cost = f"{len(search['candidates'])} candidates, {search['forward_passes']:g} forwards of "
            cost += f"{search['calibration_tokens']} tokens, {search['seconds']:.0f} s"
        layers = row["layers"]
        lines.append(
            f"| {tag} | {format_layers(layers)} | {overlapped_all_reduces(layers)} of {2 * len(layers)} | "
            + " | ".join(f"{row[f'{s}_loss'] - base[f'{s}_loss']:+.4f}" for s in HELDOUT)
            + f" | {cost} |"
        )
    lines += [
        "",
        "Retrained: log-perplexity gap to the equally trained control (share of the zero-shot gap closed;",
        "in brackets, against the original)",
        "",
        "| shape | objective | tokens | books gap | books closed | wikitext gap | wikitext closed | s/step | vs lm | train wall |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in results.items():
        if "+" not in name or name.startswith("control-"):
            continue
        tag, rest = name.split("+", 1)
        objective, budget = rest.rsplit("@", 1)
        control, zero = results.get(f"control-{tag}@{budget}"), results.get(f"ladder-{tag}")
        lm = results.get(f"{tag}+lm@{budget}")
        cells = [tag, objective, str(row["tokens"])]
        for s in HELDOUT:
            cells += ["-", "-"]
            if control is not None and zero is not None:
                gap, damage = row[f"{s}_loss"] - control[f"{s}_loss"], zero[f"{s}_loss"] - base[f"{s}_loss"]
                closed = f"{1 - gap / damage:.0%} ({1 - (row[f'{s}_loss'] - base[f'{s}_loss']) / damage:.0%})"
                cells[-2:] = [f"{gap:+.4f}", closed]
        cells += [
            f"{row['step_seconds']:.2f}",
            f"{row['step_seconds'] / lm['step_seconds']:.2f}x" if lm else "-",
            f"{row['train_seconds']:.0f} s",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        f"held-out tokens: books {base['books_tokens']}, wikitext {base['wikitext_tokens']}; "
        "gaps in nats per token (log-perplexity)",
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shapes = ["8", "15", "auto:8", "auto:15"]
    parser.add_argument("--shapes", nargs="+", default=shapes, metavar="SHAPE", help="N (upper N), auto:N, auto:N:any")
    parser.add_argument(
        "--objectives", nargs="*", choices=list(OBJECTIVES), default=list(OBJECTIVES), help="none: zero-shot only"
    )
    parser.add_argument("--budgets", nargs="+", type=int, default=[24576, 49152, 98304], metavar="TOKENS")
    parser.add_argument("--suite", help="also score every model of the run on this eval suite (e.g. demo)")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench" / "recovery")
    parser.add_argument("--report", action="store_true", help="only print the tables of finished conditions")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    recipe = load_recipe(RECIPE, args.overrides)
    for name, compute in {} if args.report else conditions(args, recipe, args.out).items():
        path = args.out / f"{name}.json"
        if path.exists():
            continue
        result = compute()
        path.write_text(json.dumps(result, indent=1))
        print(
            f"{name}: books loss {result['books_loss']:.4f}, wikitext loss {result['wikitext_loss']:.4f}"
            + (f", {result['train_seconds']:.0f} s training" if "train_seconds" in result else ""),
            flush=True,
        )
    results = {
        p.stem: json.loads(p.read_text()) for p in sorted(args.out.glob("*.json")) if not p.stem.startswith("shape-")
    }
    table = report(results, args.out)
    if args.suite and not args.report:
        table += "\n\n" + score_suite(args.suite, results, args.out)
    (args.out / "report.md").write_text(table + "\n")
    print(table)
    return 0


def score_suite(suite_name: str, results: dict[str, dict], out: Path) -> str:
    """Every finished model of the run, side by side on an eval suite (zero-shot ladder models are
    converted first; lm-eval's cache keeps scores already computed)."""
    from ladder.convert.convert import convert_checkpoint
    from ladder.eval.evaluate import evaluate_models
    from ladder.eval.suite import load_suite

    models = ["original=embedded"]
    for name, row in results.items():
        if name.startswith("ladder-"):
            directory = out / "converted" / name
            if not directory.exists():
                convert_checkpoint(None, out=directory, ladder_layers=row["layers"], verify=False)
            models.append(f"{name}={directory}")
        elif name != "original":
            models.append(f"{name}={out / name / 'model'}")
    evaluation = evaluate_models(
        models, load_suite(suite_name), out=out / f"suite-{suite_name}", force=True, cache_dir=out / "eval-cache"
    )
    return f"`{suite_name}` suite ({evaluation.wall_seconds:.0f} s):\n\n{evaluation.table}"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
