"""`ladder adapt RECIPE.yaml [key=value ...]`: retrain a ladder model from a YAML recipe.

Several processes (DDP or FSDP, on GPUs or on CPU over gloo):
    accelerate launch --multi_gpu --num_processes 2 -m ladder.adapt.cli RECIPE.yaml [key=value ...]
    accelerate launch --config_file recipes/accelerate/fsdp-8gpu.yaml -m ladder.adapt.cli RECIPE.yaml
"""

from __future__ import annotations

import sys

from ladder.errors import ArgumentParser, UsageError, run_command

from .recipe import dump_recipe, load_recipe


def main(argv: list[str]) -> int:
    parser = ArgumentParser(
        prog="ladder adapt",
        description="Retrain a ladder model from a YAML recipe; key=value arguments override recipe keys "
        "(e.g. optimizer.lr=1e-4 budget=2e5 resume=true).",
    )
    parser.add_argument("recipe", help="recipe YAML file (see recipes/)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides, dotted keys")
    parser.add_argument("--print-recipe", action="store_true", help="print the resolved recipe and exit")
    parser.add_argument(
        "--prepare-data",
        action="store_true",
        help="tokenize and cache the data only (one process, no weights), then exit",
    )
    if not argv:
        raise UsageError("a recipe is needed: ladder adapt RECIPE.yaml [key=value ...] (see recipes/)")
    args = parser.parse_args(argv)
    recipe = load_recipe(args.recipe, args.overrides)
    if args.print_recipe:
        print(dump_recipe(recipe), end="")
        return 0

    # torch, transformers and accelerate load here, after the recipe is checked: a bad recipe fails fast.
    from .train import TrainingDiverged, prepare, train

    if args.prepare_data:
        splits = prepare(recipe)
        print(
            f"{len(splits.train)} training and {len(splits.eval)} evaluation blocks of {recipe.data.seq_len} tokens "
            f"cached under {recipe.data.cache_dir}; {splits.train.masked_share():.1%} of the training tokens are "
            "masked from the loss (not assistant turns)"
        )
        return 0

    try:
        train(recipe)
    except TrainingDiverged as error:
        print(f"ladder adapt: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(run_command("adapt", main, sys.argv[1:]))
