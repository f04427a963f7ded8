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
from ladder.log import log
from ladder.plan.speed import device_names, device_profile
from ladder.units import parse_size

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
    plan.add_argument(
        "--hardware",
        help=f"the device, as `ladder plan` names it: {', '.join(device_names())} (this machine), "
        "FLOPS,BANDWIDTH,MEMORY (e.g. 989e12,3.35e12,80GB) or a `ladder plan --calibrate` .json "
        "(default: this machine)",
    )
    plan.add_argument(
        "--devices", "--gpus", type=int, default=None, help="how many (FSDP over them when more than one; default 1)"
    )
    plan.add_argument(
        "--gpu-memory", help="bytes per device, e.g. 80GB, 80GiB or 8e10 (default: --hardware's, else this machine's)"
    )
    plan.add_argument(
        "--gpu-flops", type=float, default=None, help="peak FLOP/s per device (default: --hardware's, else this CPU's)"
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
    planning = (args.hardware, args.devices, args.gpu_memory, args.gpu_flops, args.utilisation)
    if any(value is not None for value in planning) or args.json:
        raise UsageError("--hardware, --devices, --gpu-memory, --gpu-flops, --utilisation and --json go with --plan")
    return train(recipe, args.recipe, args.overrides)


def print_plan(recipe: Recipe, args: argparse.Namespace) -> int:
    """The plan of the recipe's training (adapt/plan.py), as text or one JSON object."""
    from .plan import format_plan, plan_json, recipe_plan

    if args.devices is not None and args.devices < 1:
        raise UsageError("--devices must be at least 1")
    if args.gpu_flops is not None and not args.gpu_flops > 0:
        raise UsageError("--gpu-flops must be positive")
    if args.utilisation is not None and not 0 < args.utilisation <= 1:
        raise UsageError("--utilisation must be in (0, 1]")
    memory, flops, accelerator = plan_device(args)
    plan = recipe_plan(recipe, args.devices or 1, memory, flops, args.utilisation, accelerator)
    print(plan_json(plan) if args.json else format_plan(plan, recipe))
    return 0


def plan_device(args: argparse.Namespace) -> tuple[float | None, float | None, bool | None]:
    """(memory, FLOP/s, accelerator) of the devices the plan trains on: --hardware's figures, each
    overridden by --gpu-memory or --gpu-flops; without --hardware, both of those or neither (this
    machine). A partial description is refused: it would price GPUs at this CPU's rate."""
    from .plan import device_figures

    memory = parse_size(args.gpu_memory, "--gpu-memory") if args.gpu_memory is not None else None
    if args.hardware is not None:
        hardware_memory, hardware_flops, accelerator = device_figures(device_profile(args.hardware, "--hardware"))
        return memory or hardware_memory, args.gpu_flops or hardware_flops, accelerator
    given = {"--devices": args.devices, "--gpu-memory": memory, "--gpu-flops": args.gpu_flops}
    if (memory is None) != (args.gpu_flops is None) or (args.devices is not None and memory is None):
        named = " and ".join(flag for flag, value in given.items() if value is not None)
        raise UsageError(
            f"{named} describe the devices only in part (the rest would be this CPU's): name them with "
            f"--hardware ({', '.join(device_names())}: `--hardware cpu` is this machine), or give both --gpu-memory "
            "and --gpu-flops"
        )
    return memory, args.gpu_flops, None


def prepare_data(recipe: Recipe) -> int:
    """Tokenize and cache the recipe's data, loading no weights."""
    # torch, transformers and accelerate load here, after the recipe is checked: a bad recipe fails fast.
    from .train import prepare

    splits = prepare(recipe)
    log.info(
        f"{len(splits.train)} training and {len(splits.eval)} evaluation blocks of {recipe.data.seq_len} tokens "
        f"cached under {recipe.data.cache_folder()}; {splits.train.masked_share():.1%} of the training tokens are "
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
