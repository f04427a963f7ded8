"""Training speed of the adapt loop against a plain `transformers.Trainer`, in one run.

Both train the CPU recipe's model (the same ladder layers and trainable parameters) on the same
blocks with the same batch, fused AdamW and schedule, each in its own process (peak RSS is its own),
the sides alternating round by round. Prints each side's median step time, tokens/s and peak RSS,
and adapt / Trainer (goals: tokens/s >= 1.0x, peak RSS <= 0.7x: adapt's chunked loss never holds
full logits). `--compile` adds adapt with `model.compile=true` (its compiling steps untimed).

    .venv/bin/python -m benchmarks.train_speed [--steps 8] [--rounds 2] [--compile] [key=value ...]
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import REPOSITORY, run_benchmark
from ladder.errors import ArgumentParser

RECIPE = REPOSITORY / "recipes" / "smollm2-135m-ladder-cpu.yaml"


def recipe_for(steps: int, overrides: list[str], out: Path):
    """The recipe of a run of `steps` steps into `out`, and its tokens per step."""
    from ladder.adapt.recipe import load_recipe

    base = load_recipe(RECIPE, overrides)
    tokens = base.batch.micro_batch * base.batch.grad_accum * base.data.seq_len
    settings = [f"budget={steps * tokens}", f"output_dir={out}", f"checkpoint_every={steps + 1}"]
    return load_recipe(RECIPE, [*overrides, *settings, "data.eval_blocks=0", "logging.progress=false"]), tokens


def run_adapt(steps: int, overrides: list[str], out: Path) -> list[float]:
    from ladder.adapt.train import train

    recipe, tokens = recipe_for(steps, overrides, out)
    train(recipe)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [tokens / r["tokens_per_s"] for r in records if "tokens_per_s" in r]


def run_trainer(steps: int, overrides: list[str], out: Path) -> list[float]:
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import ladder
    from ladder.adapt.data import prepare_data
    from ladder.adapt.models import make_trainable
    from ladder.adapt.recipe import model_path
    from ladder.io.loading import load_model
    from ladder.layers import parse_ladder_layers

    recipe, _ = recipe_for(steps, overrides, out)
    model, tokenizer = load_model(model_path(recipe.model.path))
    layers = parse_ladder_layers(recipe.model.ladder_layers, model.config.num_hidden_layers)
    model, _ = make_trainable(ladder.to_ladder(model, layers).train(), recipe.trainable, layers)  # adapt's own
    blocks = prepare_data(recipe.data, tokenizer).train.ids
    rows = [torch.from_numpy(blocks[i].astype("int64")) for i in range(steps * recipe.batch.micro_batch)]
    dataset = [{"input_ids": ids, "labels": ids} for ids in rows]

    seconds: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            seconds.append(time.perf_counter() - self.started)

    arguments = TrainingArguments(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=recipe.batch.micro_batch,
        gradient_accumulation_steps=recipe.batch.grad_accum,
        learning_rate=recipe.optimizer.lr,
        adam_beta1=recipe.optimizer.betas[0],
        adam_beta2=recipe.optimizer.betas[1],
        weight_decay=recipe.optimizer.weight_decay,
        max_grad_norm=recipe.grad_clip,
        lr_scheduler_type="cosine",
        warmup_steps=recipe.schedule.warmup_steps,
        use_cpu=True,
        save_strategy="no",
        report_to=[],
        logging_strategy="no",
        disable_tqdm=True,
        seed=recipe.seed,
    )
    Trainer(model=model, args=arguments, train_dataset=dataset, callbacks=[StepTimer()]).train()
    return seconds


def child(kind: str, steps: int, overrides: list[str]) -> None:
    with tempfile.TemporaryDirectory(prefix=f"train-speed-{kind}-") as out:
        if kind == "trainer":
            seconds = run_trainer(steps, overrides, Path(out) / "run")
        else:
            extra = ["model.compile=true"] if kind == "adapt-compile" else []
            seconds = run_adapt(steps, [*overrides, *extra], Path(out) / "run")
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"seconds": seconds, "peak_rss_mib": peak_mib}))


def measure(argv: list[str]) -> int:
    parser = ArgumentParser(prog="benchmarks.train_speed", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="steps per side; the first is warmup and not timed")
    parser.add_argument("--rounds", type=int, default=2, help="runs per side, alternating")
    parser.add_argument("--compile", action="store_true", help="also time adapt with model.compile=true")
    parser.add_argument("--child", choices=["adapt", "trainer", "adapt-compile"], help="(one side, in its process)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides for both sides")
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.steps, args.overrides)
        return 0
    recipe, tokens = recipe_for(args.steps, args.overrides, Path("unused"))
    kinds = ("adapt", "trainer", "adapt-compile") if args.compile else ("adapt", "trainer")
    results = {kind: {"seconds": [], "peak_rss_mib": 0.0} for kind in kinds}
    for _ in range(args.rounds):
        for kind in results:
            command = [sys.executable, "-m", "benchmarks.train_speed", "--child", kind, f"--steps={args.steps}"]
            command += args.overrides
            done = subprocess.run(command, check=True, capture_output=True, text=True, cwd=REPOSITORY)
            run = json.loads(done.stdout.strip().splitlines()[-1])
            warmup = 2 if kind == "adapt-compile" else 1  # compilation happens in the first steps
            results[kind]["seconds"] += run["seconds"][warmup:]
            results[kind]["peak_rss_mib"] = max(results[kind]["peak_rss_mib"], run["peak_rss_mib"])
    for kind, result in results.items():
        step = statistics.median(result["seconds"])
        result["tokens_per_s"] = tokens / step
        print(
            f"{kind:13} median step {step:.2f} s, {tokens / step:.0f} tokens/s, peak RSS {result['peak_rss_mib']:.0f} MiB"
        )
    ratio = results["adapt"]["tokens_per_s"] / results["trainer"]["tokens_per_s"]
    print(
        f"batch {recipe.batch.micro_batch} x {recipe.data.seq_len} (grad_accum {recipe.batch.grad_accum}), "
        f"trainable {recipe.trainable.mode}, {args.rounds} x {args.steps - 1} timed steps per side"
    )
    memory = results["adapt"]["peak_rss_mib"] / results["trainer"]["peak_rss_mib"]
    print(f"adapt / Trainer tokens/s: {ratio:.2f}  (goal >= 1.0); peak RSS: {memory:.2f}  (goal <= 0.7)")
    if args.compile:
        speedup = results["adapt-compile"]["tokens_per_s"] / results["adapt"]["tokens_per_s"]
        print(f"adapt with compiled decoder layers / adapt tokens/s: {speedup:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(run_benchmark("train_speed", measure))
