"""The training plan (adapt/plan.py) against measurements on this machine, for the CPU recipe at
three micro-batch / seq_len settings: the plan's peak memory against the peak RSS of a short real
adapt run (each in its own process, one at a time), and the plan's saved activations per trained
layer against what saved-tensor hooks count in a real forward.

The plan's peak includes the process's runtime (adapt/plan.py CPU_RUNTIME_BYTES), which is measured
here too, beside it: the peak RSS of a process that imports adapt, loads the tokenizer and reads the
run's tokenized data from its cache, loading no model (what every run holds whatever its batch).
Goals (issue 29): peak within 15%, saved activations within 10%.

    .venv/bin/python -m benchmarks.plan_memory [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.train_speed import REPO, recipe_for

SETTINGS = [(2, 512), (4, 512), (4, 1024)]  # (micro_batch, seq_len)


def overrides_for(micro_batch: int, seq_len: int) -> list[str]:
    return [f"batch.micro_batch={micro_batch}", f"data.seq_len={seq_len}"]


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child(kind: str, steps: int, overrides: list[str]) -> None:
    with tempfile.TemporaryDirectory(prefix="plan-memory-") as out:
        recipe = recipe_for(steps, overrides, Path(out) / "run")
        if kind == "fixed":
            import ladder.adapt.train  # noqa: F401  (everything a run imports)
            from ladder.adapt.train import prepare

            prepare(recipe)
        else:
            from ladder.adapt.train import train

            train(recipe)
    print(json.dumps({"peak_rss": peak_rss()}))


def measure(kind: str, steps: int, overrides: list[str]) -> int:
    command = [sys.executable, "-m", "benchmarks.plan_memory", "--child", kind, "--steps", str(steps), *overrides]
    output = subprocess.run(command, check=True, capture_output=True, text=True, cwd=REPO).stdout
    return json.loads(output.strip().splitlines()[-1])["peak_rss"]


def counted_saved_bytes(recipe) -> tuple[int, int]:
    """(counted, planned) bytes one trained layer saves, on a random model of the recipe's shape."""
    import torch
    from transformers import AutoModelForCausalLM

    import ladder
    from ladder.adapt.memory import keep_fewer_activations
    from ladder.adapt.plan import layer_saved_bytes, model_shape, read_model_config
    from ladder.adapt.preflight import source_path
    from ladder.layers import parse_ladder_layers

    config = read_model_config(source_path(recipe.model.path))
    config.num_hidden_layers = 2  # the per-layer count does not depend on the depth
    model = AutoModelForCausalLM.from_config(config)
    model = ladder.to_ladder(model, parse_ladder_layers(1, 2)).train()
    model.set_attn_implementation(recipe.model.attn_implementation)
    keep_fewer_activations(model)
    model.requires_grad_(False)
    model.model.layers[1].requires_grad_(True)
    ids = torch.randint(0, config.vocab_size, (recipe.batch.micro_batch, recipe.data.seq_len))
    from ladder.adapt.plan import measured_saved_bytes

    counted = measured_saved_bytes(model, ids, 1)
    planned = layer_saved_bytes(model_shape(config), ids.numel(), "none", 4, 4)
    return counted, planned


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="steps of each real run")
    parser.add_argument("--child", choices=["fixed", "adapt"], help=argparse.SUPPRESS)
    parser.add_argument(
        "--setting", action="append", help="MICRO_BATCH,SEQ_LEN to measure (repeatable; default: the three above)"
    )
    parser.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.steps, args.overrides)
        return 0
    from ladder.adapt.plan import CPU_RUNTIME_BYTES, recipe_plan

    mib = 2**20
    print(f"machine: {platform.processor() or platform.machine()}, CPU recipe, {args.steps} steps per run")
    print(
        "micro_batch seq_len | runtime: plan MiB | measured MiB | plan MiB | of which runtime | peak RSS MiB | ratio | "
        "saved/layer plan MiB | counted MiB | ratio"
    )
    worst_peak = worst_saved = 0.0
    settings = [tuple(map(int, text.split(","))) for text in args.setting] if args.setting else SETTINGS
    for micro_batch, seq_len in settings:
        overrides = overrides_for(micro_batch, seq_len)
        recipe = recipe_for(args.steps, overrides, Path("unused"))
        plan = recipe_plan(recipe, device_flops=1.0, accelerator=False)  # flops unused here
        measured = measure("adapt", args.steps, overrides)
        fixed = measure("fixed", args.steps, overrides)  # after the run: the data is read from its cache
        predicted = plan.peak_bytes_per_device
        counted, planned = counted_saved_bytes(recipe)
        worst_peak = max(worst_peak, abs(predicted / measured - 1))
        worst_saved = max(worst_saved, abs(planned / counted - 1))
        print(
            f"{micro_batch:11} {seq_len:7} | {CPU_RUNTIME_BYTES / mib:17.0f} | {fixed / mib:12.0f} | "
            f"{predicted / mib:8.0f} | {plan.memory['runtime'] / mib:16.0f} | {measured / mib:12.0f} | {predicted / measured:5.2f} | "
            f"{planned / mib:20.1f} | {counted / mib:11.1f} | {planned / counted:5.2f}"
        )
    print(f"largest error: peak {worst_peak:.1%} (goal <= 15%), saved activations {worst_saved:.1%} (goal <= 10%)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
