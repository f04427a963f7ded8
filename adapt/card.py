"""The final model's README.md: what was rewired, how it was trained and the held-out loss before and
after (from the run's metrics.jsonl); the front matter is `ladder.io.model_card`'s."""

from __future__ import annotations

import json
from pathlib import Path

from tabulate import tabulate

from ladder.io.model_card import loading_section, origin_line, render_card
from ladder.layers import format_layers

from .checkpoint import METRICS_FILE
from .recipe import RECIPE_FILE


def model_card(run, licences: list[str]) -> str:
    """README.md of the final model of `run` (adapt/train.py's AdaptRun), made from its source model."""
    recipe, source, state = run.recipe, run.source_facts, run.state
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
        f"- {state.tokens_seen:,} tokens in {state.step} steps of {run.budget.tokens_per_step:,} "
        f"({recipe.data.seq_len}-token packed blocks), {run.accelerator.num_processes} process(es)",
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
            f"On {len(run.data.eval)} held-out blocks of {recipe.data.seq_len} tokens; every "
            f"evaluation is in `metrics.jsonl` of the run ({run_dir}).",
        ]
    lines += ["", loading_section()]
    if licences:
        lines += [
            "",
            f"The source's licence terms apply: {', '.join(f'`{name}`' for name in licences)} are copied from it.",
        ]
    return render_card(source, f"{recipe.name} (ladder, retrained)", "\n".join(lines), datasets=hub_datasets)
