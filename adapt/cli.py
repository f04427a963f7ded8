"""`ladder adapt RECIPE.yaml [key=value ...]`: retrain a ladder model from a YAML recipe.

Several processes (DDP or FSDP, on GPUs or on CPU over gloo):
    accelerate launch --multi_gpu --num_processes 2 -m ladder.adapt.cli RECIPE.yaml [key=value ...]
    accelerate launch --config_file recipes/accelerate/fsdp-8gpu.yaml -m ladder.adapt.cli RECIPE.yaml
"""

from __future__ import annotations

import argparse
import shlex
import sys

from ladder.errors import ArgumentParser, UsageError, run_command

from .recipe import Recipe, dump_recipe, load_recipe


def build_parser() -> ArgumentParser:
    """The recipe, its overrides and the flags, in any order (`parse_intermixed_args`)."""
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
    plan = parser.add_argument_group("plan (adapt/plan.py): memory, recompute, FLOPs and cost, reading no weights")
    plan.add_argument("--plan", action="store_true", help="print the plan of the recipe's training and exit")
    plan.add_argument("--gpus", type=int, default=None, help="devices (FSDP over them when more than one)")
    plan.add_argument("--gpu-memory", type=float, default=None, help="bytes per device (default: this machine's RAM)")
    plan.add_argument(
        "--gpu-flops", type=float, default=None, help="peak FLOP/s per device (default: this CPU's measured peak)"
    )
    plan.add_argument(
        "--utilisation", type=float, default=None, help="share of the peak reached (default 0.35, compiled 0.40)"
    )
    plan.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    return parser


def parse_arguments(parser: ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Flags and overrides in any order; an unknown flag is named alone (argparse would also name
    the overrides after it, which it leaves unparsed)."""
    args, unknown = parser.parse_known_intermixed_args(argv)
    if unknown:
        flags = [item for item in unknown if item.startswith("-")]
        parser.error(f"unrecognized arguments: {' '.join(flags or unknown)}")
    return args


def main(argv: list[str]) -> int:
    if not argv:
        raise UsageError("a recipe is needed: ladder adapt RECIPE.yaml [key=value ...] (see recipes/)")
    args = parse_arguments(build_parser(), argv)
    recipe = load_recipe(args.recipe, args.overrides)
    if args.print_recipe:
        print(dump_recipe(recipe), end="")
        return 0
    if args.prepare_data:
        return prepare_data(recipe)
    if args.plan:
        return print_plan(recipe, args)
    if any(value is not None for value in (args.gpus, args.gpu_memory, args.gpu_flops, args.utilisation)) or args.json:
        raise UsageError("--gpus, --gpu-memory, --gpu-flops, --utilisation and --json go with --plan")
    return train(recipe, args.recipe, args.overrides)


def print_plan(recipe: Recipe, args: argparse.Namespace) -> int:
    """The plan of the recipe's training (adapt/plan.py), as text or one JSON object."""
    from .plan import format_plan, plan_json, recipe_plan

    if args.gpus is not None and args.gpus < 1:
        raise UsageError("--gpus must be at least 1")
    for name in ("gpu_memory", "gpu_flops"):
        if getattr(args, name) is not None and not getattr(args, name) > 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive")
    if args.utilisation is not None and not 0 < args.utilisation <= 1:
        raise UsageError("--utilisation must be in (0, 1]")
    plan = recipe_plan(recipe, args.gpus or 1, args.gpu_memory, args.gpu_flops, args.utilisation)
    print(plan_json(plan) if args.json else format_plan(plan, recipe))
    return 0


def prepare_data(recipe: Recipe) -> int:
    """Tokenize and cache the recipe's data, loading no weights."""
    # torch, transformers and accelerate load here, after the recipe is checked: a bad recipe fails fast.
    from .train import prepare

    splits = prepare(recipe)
    print(
        f"{len(splits.train)} training and {len(splits.eval)} evaluation blocks of {recipe.data.seq_len} tokens "
        f"cached under {recipe.data.cache_dir}; {splits.train.masked_share():.1%} of the training tokens are "
        "masked from the loss (not assistant turns)"
    )
    return 0


def train(recipe: Recipe, recipe_file: str, overrides: list[str]) -> int:
    """Run the recipe; a diverged run, or one whose processes lost touch, is one line on stderr and
    status 1; a run stopped by SIGTERM or SIGUSR1 (a scheduler's preemption) says how to resume
    and ends with status 0."""
    from .train import Preempted, ProcessesLost, TrainingDiverged
    from .train import train as run_recipe

    try:
        run_recipe(recipe)
    except (TrainingDiverged, ProcessesLost) as error:
        print(f"ladder adapt: {error}", file=sys.stderr)
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
            print(f"ladder adapt: {stop}; resume with: {shlex.join(again)}{launcher}")
    return 0


if __name__ == "__main__":
    sys.exit(run_command("adapt", main, sys.argv[1:]))
