"""The final model's README.md: what was rewired, how it was trained and the held-out loss before and
after (from the run's metrics.jsonl); the front matter is `ladder.io.model_card`'s."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tabulate import tabulate

from ladder.io.model_card import SourceFacts, loading_section, origin_line, render_card
from ladder.layers import format_layers

from .checkpoint import METRICS_FILE, TrainState
from .recipe import RECIPE_FILE, Recipe


@dataclass(frozen=True)
class TrainingFacts:
    """What the card says about the run besides its recipe."""

    ladder_layers: list[int]
    num_hidden_layers: int
    state: TrainState
    tokens_per_step: int
    processes: int
    eval_blocks: int


def model_card(recipe: Recipe, source: SourceFacts, licences: list[str], run: TrainingFacts) -> str:
    """README.md of the final model of a run of `recipe`, made from `source`."""
    run_dir = recipe.run_dir()
    evals = [
        r for r in (json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()) if "eval_loss" in r
    ]
    hub_datasets = [s.path.removeprefix("hf:") for s in recipe.data.train if s.path.startswith("hf:")]
    sources = ", ".join(f"`{Path(s.path).name if not s.path.startswith('hf:') else s.path}`" for s in recipe.data.train)
    lines = [
        origin_line(source),
        "",
        f"Layers {format_layers(run.ladder_layers)} of {run.num_hidden_layers} are ladder layers "
        "(each module reads the residual stream from before the previous module's output was added, so under "
        "tensor parallelism one module's all-reduce overlaps the next module's compute), and the model was "
        "retrained to win back the accuracy the rewiring costs.",
        "",
        "## Training",
        "",
        f"- recipe `{recipe.name}` (`{RECIPE_FILE}` beside the weights holds all of it)",
        f"- {run.state.tokens_seen:,} tokens in {run.state.step} steps of {run.tokens_per_step:,} "
        f"({recipe.data.seq_len}-token packed blocks), {run.processes} process(es)",
        f"- data: {sources}",
        f"- trainable: {recipe.trainable.mode}; objective: {recipe.objective.name}; AdamW lr "
        f"{recipe.optimizer.lr:g}, {recipe.schedule.decay} decay; precision {recipe.precision}",
    ]
    if evals:
        shown = evals if len(evals) <= 2 else [evals[0], evals[-1]]
        cells = [[r["step"], f"{r['tokens']:,}", f"{r['eval_loss']:.4f}", f"{r['eval_perplexity']:.2f}"] for r in shown]
        header = ["step", "tokens", "loss", "perplexity"]
        table = tabulate(cells, header, tablefmt="pipe", colalign=["right"] * 4, disable_numparse=True)
        lines += ["", "## Held-out loss", "", table]
        lines += [
            "",
            f"On {run.eval_blocks} held-out blocks of {recipe.data.seq_len} tokens; every "
            f"evaluation is in `metrics.jsonl` of the run ({run_dir}).",
        ]
    lines += ["", loading_section()]
    if licences:
        lines += [
            "",
            f"The source's licence terms apply: {', '.join(f'`{name}`' for name in licences)} are copied from it.",
        ]
    return render_card(source, f"{recipe.name} (ladder, retrained)", "\n".join(lines), datasets=hub_datasets)
