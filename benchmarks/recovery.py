"""Recovery experiment on SmolLM2-135M: how much of what the rewiring costs does a short retraining
win back, and is that recovery or just adaptation to the training text?

Held-out perplexity on two sets the training never sees: `books` (the CPU recipe's evaluation books,
other authors than its training books) and `wikitext` (WikiText-2 validation, another domain), for:

    original        SmolLM2-135M-Instruct as shipped
    ladder          its upper layers rewired (the recipe's ladder_layers), no retraining
    ladder+lm       recipes/smollm2-135m-ladder-cpu.yaml as shipped (next-token loss)
    ladder+kd       the same, distilling from the original instead (same tokens)
    original+lm     the control: the original trained the same way (same layers, tokens, lr)

The table reports each model's gap to the original (perplexity ratio); the rewiring's own cost after
retraining is ladder+lm against original+lm, which saw the same tokens.

Each condition's result is kept in OUT/<condition>.json and reused, so the experiment can run in
chunks (each trained condition is a few minutes on 2 CPU cores; a quiet machine times them fairly):

    .venv/bin/python benchmarks/recovery.py --conditions original ladder ladder+lm
    .venv/bin/python benchmarks/recovery.py --conditions ladder+kd
    .venv/bin/python benchmarks/recovery.py --conditions original+lm
    .venv/bin/python benchmarks/recovery.py --report        # the table from what is done

Extra `key=value` arguments override the recipe for every trained condition (e.g. budget=2e4).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import ladder  # noqa: E402
from ladder.adapt.data import load_blocks  # noqa: E402
from ladder.adapt.losses import block_losses  # noqa: E402
from ladder.adapt.recipe import (  # noqa: E402
    SourceSpec,
    load_recipe,
    model_path,
)
from ladder.adapt.train import train  # noqa: E402
from ladder.layers import parse_ladder_layers  # noqa: E402
from ladder.loading import load_model  # noqa: E402

RECIPE = REPO / "recipes" / "smollm2-135m-ladder-cpu.yaml"
WIKITEXT = SourceSpec(path="${LADDER_DATA}/eval/wikitext2_raw/wiki.valid.raw", max_tokens=8192)
# Overrides that make each trained condition from the recipe.
TRAINED = {
    "ladder+lm": [],
    "ladder+kd": ["objective.name=kd"],
    "original+lm": ["model.ladder_layers=0", "trainable.mode=layers", "trainable.layers={ladder_layers}"],
}
CONDITIONS = ["original", "ladder", *TRAINED]


def heldout_sets(recipe, tokenizer) -> dict[str, np.ndarray]:
    cache, seq_len = Path(recipe.data.cache_dir), recipe.data.seq_len
    return {
        "books": np.asarray(load_blocks(recipe.data.eval, tokenizer, seq_len, cache, "eval").ids),
        "wikitext": np.asarray(load_blocks([WIKITEXT], tokenizer, seq_len, cache, "eval").ids),
    }


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, blocks: np.ndarray, batch: int) -> float:
    model.eval()
    losses = [block_losses(model, torch.from_numpy(blocks[i : i + batch].astype(np.int64)))
              for i in range(0, len(blocks), batch)]
    return float(torch.cat(losses).mean())


def run_condition(name: str, recipe, overrides: list[str], out: Path) -> dict:
    started = time.perf_counter()
    result = {"condition": name}
    if name in TRAINED:
        extra = [o.format(ladder_layers=recipe.model.ladder_layers) for o in TRAINED[name]]
        run_recipe = load_recipe(RECIPE, [*overrides, *extra, f"output_dir={out / name}", "eval_every=100000",
                                          "data.eval_blocks=0", "resume=true"])
        final = train(run_recipe)
        steps = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
        result.update(train_seconds=time.perf_counter() - started, tokens=steps[-1]["tokens"],
                      overrides=[*overrides, *extra])
        model, tokenizer = load_model(final)
    else:
        model, tokenizer = load_model(model_path(recipe.model.path))
        if name == "ladder":
            layers = parse_ladder_layers(recipe.model.ladder_layers, model.config.num_hidden_layers)
            model = ladder.to_ladder(model, layers)
    for set_name, blocks in heldout_sets(recipe, tokenizer).items():
        result[f"{set_name}_loss"] = heldout_loss(model, blocks, recipe.batch.micro_batch)
        result[f"{set_name}_tokens"] = int(blocks.size)
    return result


def report(results: dict[str, dict]) -> str:
    if "original" not in results:
        return "(no result for `original` yet: the gaps need it)"
    base = results["original"]
    lines = [
        "| model | books ppl | gap to original | wikitext ppl | gap to original | training |",
        "|---|---|---|---|---|---|",
    ]
    for name in CONDITIONS:
        if name not in results:
            continue
        row = results[name]
        cells = [name]
        for set_name in ("books", "wikitext"):
            loss = row[f"{set_name}_loss"]
            cells += [f"{math.exp(loss):.2f}", f"{math.exp(loss - base[f'{set_name}_loss']) - 1:+.1%}"]
        cells.append(f"{row['tokens']} tokens, {row['train_seconds']:.0f} s" if row.get("tokens") else "none")
        lines.append("| " + " | ".join(cells) + " |")
    notes = []
    for name in ("ladder+lm", "ladder+kd"):
        if "ladder" in results and name in results:
            closed = []
            for set_name in ("books", "wikitext"):
                before = results["ladder"][f"{set_name}_loss"] - base[f"{set_name}_loss"]
                after = results[name][f"{set_name}_loss"] - base[f"{set_name}_loss"]
                closed.append(f"{set_name} {1 - after / before:.0%}")
            notes.append(f"{name} closes this share of the rewiring's loss gap to the original: " + ", ".join(closed))
    if "original+lm" in results:
        control = results["original+lm"]
        for name in ("ladder+lm", "ladder+kd"):
            if name in results:
                gaps = [f"{set_name} {math.exp(results[name][f'{set_name}_loss'] - control[f'{set_name}_loss']) - 1:+.1%}"
                        for set_name in ("books", "wikitext")]
                notes.append(f"{name} against the control original+lm (same tokens): " + ", ".join(gaps))
    held = f"held-out tokens: books {base['books_tokens']}, wikitext {base['wikitext_tokens']}"
    return "\n".join(lines + [""] + [f"- {n}" for n in notes + [held]])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conditions", nargs="+", choices=CONDITIONS, default=CONDITIONS)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench" / "recovery")
    parser.add_argument("--report", action="store_true", help="only print the table of finished conditions")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    recipe = load_recipe(RECIPE, args.overrides)
    for name in [] if args.report else args.conditions:
        path = args.out / f"{name}.json"
        if path.exists():
            print(f"{name}: done before ({path})")
            continue
        result = run_condition(name, recipe, args.overrides, args.out)
        path.write_text(json.dumps(result, indent=1))
        print(f"{name}: books loss {result['books_loss']:.4f}, wikitext loss {result['wikitext_loss']:.4f}", flush=True)
    results = {p.stem: json.loads(p.read_text()) for p in sorted(args.out.glob("*.json"))}
    table = report(results)
    (args.out / "report.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
