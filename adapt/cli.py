"""`ladder adapt RECIPE.yaml [key=value ...]`: retrain a ladder model from a YAML recipe.

Several processes (DDP or FSDP, on GPUs or on CPU over gloo):
    accelerate launch --multi_gpu --num_processes 2 -m ladder.adapt.cli RECIPE.yaml [key=value ...]
    accelerate launch --config_file recipes/accelerate/fsdp-8gpu.yaml -m ladder.adapt.cli RECIPE.yaml
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import sys

from ladder.cli_types import float_in
from ladder.errors import ArgumentParser, UsageError, run_command
from ladder.log import log
from ladder.plan.speed import DEFAULT_HARDWARE, TRAIN_DEVICES, device_names, device_profile

from .recipe import Recipe, dump_recipe, load_recipe


def build_parser() -> ArgumentParser:
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
        help="tokenize and cache the data only (every core, no weights; a killed prepare continues), then exit",
    )
    cost = parser.add_argument_group("--plan (training_cost.py): memory, recompute, FLOPs and cost, reading no weights")
    cost.add_argument("--plan", action="store_true", help="print what the recipe's training costs and exit")
    cost.add_argument(
        "--hardware",
        help=f"the device, as `ladder plan` names it: {', '.join(device_names())} (this machine), "
        "FLOPS,BANDWIDTH,MEMORY (e.g. 989e12,3.35e12,80GB) or a `ladder plan --calibrate` .json "
        f"(default {DEFAULT_HARDWARE}, as `ladder plan`)",
    )
    cost.add_argument(
        "--train-devices", type=TRAIN_DEVICES, help="how many (FSDP over them when more than one; default 1)"
    )
    cost.add_argument(
        "--utilisation", type=float_in(0.01, 1.0), help="share of the peak reached (default 0.35, compiled 0.40)"
    )
    cost.add_argument("--json", action="store_true", help="print the cost as one JSON object")
    return parser


def main(argv: list[str]) -> int:
    if not argv:
        raise UsageError("a recipe is needed: ladder adapt RECIPE.yaml [key=value ...] (see recipes/)")
    # Flags and overrides in any order; an unknown flag is named alone (not with the overrides after it).
    args, unknown = build_parser().parse_known_intermixed_args(argv)
    if unknown:
        flags = [item for item in unknown if item.startswith("-")]
        raise UsageError(f"unrecognized arguments: {' '.join(flags or unknown)}")
    recipe = load_recipe(args.recipe, args.overrides)
    if args.print_recipe:
        print(dump_recipe(recipe), end="")
        return 0
    if args.prepare_data:  # tokenize and cache the recipe's data, loading no weights
        from .train import prepare

        splits = prepare(recipe)
        log.info(
            f"{len(splits.train)} training and {len(splits.eval)} evaluation blocks of {recipe.data.seq_len} tokens "
            f"cached under {recipe.data.cache_folder()}; {splits.train.masked_share():.1%} of the training tokens "
            "are masked from the loss (not assistant turns)"
        )
        return 0
    if args.plan:  # what the recipe's training costs (training_cost.py), as text or one JSON object
        from .training_cost import format_cost, recipe_cost

        device = device_profile(args.hardware or DEFAULT_HARDWARE, "--hardware")
        cost = recipe_cost(recipe, device, args.train_devices or 1, args.utilisation)
        print(json.dumps(dataclasses.asdict(cost), indent=1) if args.json else format_cost(cost, recipe))
        return 0
    if any(value is not None for value in (args.hardware, args.train_devices, args.utilisation)) or args.json:
        raise UsageError("--hardware, --train-devices, --utilisation and --json go with --plan")
    return train(recipe, args.recipe, args.overrides)


def train(recipe: Recipe, recipe_file: str, overrides: list[str]) -> int:
    """Run the recipe: a diverged run, or one whose processes lost touch, is one line and status 1; a run
    stopped by SIGTERM or SIGUSR1 says how to resume, status 0."""
    from .train import Preempted, ProcessesLost, TrainingDiverged
    from .train import train as run_recipe

    try:
        run_recipe(recipe)
    except (TrainingDiverged, ProcessesLost) as error:
        log.error(f"ladder adapt: {error}")
        return 1
    except Preempted as stop:
        if stop.main_process:
            again = [
                "ladder",
                "adapt",
                recipe_file,
                *(o for o in overrides if not o.startswith("resume=")),
                "resume=true",
            ]
            launcher = " (under the same `accelerate launch`)" if stop.processes > 1 else ""
            log.warning(f"ladder adapt: {stop}; resume with: {shlex.join(again)}{launcher}")
    return 0


if __name__ == "__main__":
    sys.exit(run_command("adapt", main, sys.argv[1:]))
