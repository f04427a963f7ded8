"""The side-by-side report (markdown, JSON and a chart): each model's score per task and metric, and
its difference from the reference (the first model) with a standard error, paired over the same
items where they match (STDERR_NOTE says how), else sqrt(se_a^2 + se_b^2), which overstates it.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import scipy.stats
from lm_eval.api.registry import AGGREGATION_REGISTRY
from tabulate import tabulate

from .models import ModelResults

# Bootstrap draws of every standard error that is not a mean's, lm-eval's (`bootstrap_iters`) and the
# report's: lm_eval's default of 100,000 takes minutes for LAMBADA's perplexity on a CPU, and 1,000
# estimate a standard error within a few percent (±22.01 against ±22.47 on the same items).
BOOTSTRAP_DRAWS = 1000

STDERR_NOTE = (
    "Scores are lm-eval's, ± its standard error (for aggregations other than a mean, such as LAMBADA's "
    f"perplexity, from {BOOTSTRAP_DRAWS:,} bootstrap draws: lm_eval's default is 100,000; where lm-eval "
    f"gives none, as for WikiText's perplexities, a bootstrap over documents, {BOOTSTRAP_DRAWS:,} draws). "
    "Differences are against the first model, ± the standard error of the difference: paired over the "
    f"same items (mean metrics: sd of per-item differences / sqrt(n); other aggregations: {BOOTSTRAP_DRAWS:,}-draw "
    "paired bootstrap); `independent` rows use sqrt(se_a² + se_b²), which overstates it."
)


@dataclass
class Estimate:
    value: float | None
    stderr: float | None
    method: str = ""  # for differences: "paired" or "independent"


@dataclass
class Row:
    task: str
    metric: str  # "acc", or "exact_match,strict-match" when a filter other than `none` applies
    n: int | None
    higher_is_better: bool | None
    scores: list[Estimate]  # one per model, reference first
    differences: list[Estimate]  # one per model after the reference


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


# lm-eval's aggregations of per-item sums, vectorised so that scipy draws all resamples at once;
# others (f1, bleu, ...) run lm-eval's own function once per resample.
_VECTORISED = {
    "mean": lambda values, axis: np.mean(values, axis=axis),
    "perplexity": lambda loglikelihoods, axis: np.exp(-np.mean(loglikelihoods, axis=axis)),
    "weighted_perplexity": lambda ll, count, axis: np.exp(-np.sum(ll, axis=axis) / np.sum(count, axis=axis)),
    "bits_per_byte": lambda ll, count, axis: -np.sum(ll, axis=axis) / np.sum(count, axis=axis) / math.log(2),
}


def _bootstrap(name: str, aggregate, items_a: list, items_b: list | None) -> float:
    """Bootstrap standard error of aggregate(a), or of aggregate(a) - aggregate(b) (paired)."""
    vectorised = _VECTORISED.get(name)
    if vectorised is not None:
        # Each model's items as columns: one (values) or two (log-likelihood, words or bytes).
        columns = [np.asarray(items, dtype=float).T.reshape(-1, len(items_a)) for items in (items_a, items_b or [])]
        width = len(columns[0])

        def statistic(*samples, axis=-1):
            value = vectorised(*samples[:width], axis=axis)
            return value - vectorised(*samples[width:], axis=axis) if items_b is not None else value

        data = (*columns[0], *columns[1])
    else:

        def statistic(index):
            value = aggregate([items_a[i] for i in index])
            return value - aggregate([items_b[i] for i in index]) if items_b is not None else value

        data = (np.arange(len(items_a)),)
    result = scipy.stats.bootstrap(
        data,
        statistic,
        n_resamples=BOOTSTRAP_DRAWS,
        batch=100,  # memory: 100 x items per sample at a time
        vectorized=vectorised is not None,
        paired=True,
        method="percentile",  # only the standard error is used: no BCa jackknife (n statistics)
        rng=np.random.default_rng(0),
    )
    return float(result.standard_error)


def _items(record: dict, task: str, key: str) -> dict | None:
    column = record.get("per_item", {}).get(task, {}).get(key)
    return column if column and column["doc_id"] else None


def _aggregation(record: dict, task: str, metric: str):
    name = record.get("aggregations", {}).get(task, {}).get(metric, "")
    return name, AGGREGATION_REGISTRY.get(name, None)


def _score(record: dict, task: str, key: str) -> Estimate:
    metric, _, filter_name = key.partition(",")
    results = record["results"].get(task, {})
    value = _number(results.get(key))
    stderr = _number(results.get(f"{metric}_stderr,{filter_name}"))
    items = _items(record, task, key)
    name, aggregate = _aggregation(record, task, metric)
    if value is not None and stderr is None and items and aggregate and len(items["value"]) > 1:
        stderr = _bootstrap(name, aggregate, items["value"], None)
    return Estimate(value, stderr)


def _difference(reference: dict, other: dict, task: str, key: str, ref: Estimate, score: Estimate) -> Estimate:
    if ref.value is None or score.value is None:
        return Estimate(None, None)
    value = score.value - ref.value
    metric = key.partition(",")[0]
    items_ref, items_other = _items(reference, task, key), _items(other, task, key)
    name, aggregate = _aggregation(reference, task, metric)
    if items_ref and items_other and items_ref["doc_id"] == items_other["doc_id"] and len(items_ref["doc_id"]) > 1:
        if name == "mean":
            per_item = np.asarray(items_other["value"], dtype=float) - np.asarray(items_ref["value"], dtype=float)
            return Estimate(value, float(per_item.std(ddof=1) / math.sqrt(len(per_item))), "paired")
        if aggregate is not None:
            return Estimate(value, _bootstrap(name, aggregate, items_other["value"], items_ref["value"]), "paired")
    if ref.stderr is not None and score.stderr is not None:
        return Estimate(value, math.hypot(ref.stderr, score.stderr), "independent")
    return Estimate(value, None)


def build_rows(models: list[ModelResults]) -> list[Row]:
    reference = models[0]
    rows = []
    for suite_task, record in reference.tasks.items():
        for task, results in record["results"].items():
            for key in results:
                metric, comma, _ = key.partition(",")
                if not comma or metric.endswith("_stderr"):
                    continue
                scores = []
                for model in models:
                    other = model.tasks[suite_task]
                    scores.append(_score(other, task, key) if task in other["results"] else Estimate(None, None))
                differences = [
                    _difference(record, model.tasks[suite_task], task, key, scores[0], score)
                    for model, score in zip(models[1:], scores[1:])
                ]
                samples = record.get("n-samples", {}).get(task, {})
                rows.append(
                    Row(
                        task=task,
                        metric=key.removesuffix(",none"),
                        n=samples.get("effective"),
                        higher_is_better=record.get("higher_is_better", {}).get(task, {}).get(metric),
                        scores=scores,
                        differences=differences,
                    )
                )
    return rows


def _format(estimate: Estimate, like: float | None, signed: bool = False) -> str:
    if estimate.value is None:
        return "—"
    magnitude = 0 if like is None else abs(like)
    decimals = 4 if magnitude < 10 else 2 if magnitude < 1000 else 1
    text = f"{estimate.value:{'+' if signed else ''}.{decimals}f}"
    if estimate.stderr is not None:
        text += f" ± {estimate.stderr:.{decimals}f}"
    return text


def _arrow(row: Row) -> str:
    return {True: " ↑", False: " ↓"}.get(row.higher_is_better, "")


def markdown_table(labels: list[str], rows: list[Row]) -> str:
    header = ["task", "metric", "n", labels[0]]
    for label in labels[1:]:
        header += [label, f"Δ {label}"]
    cells = []
    for row in rows:
        like = row.scores[0].value
        line = [row.task, row.metric + _arrow(row), "" if row.n is None else str(row.n), _format(row.scores[0], like)]
        for score, difference in zip(row.scores[1:], row.differences):
            method = f" ({difference.method})" if difference.method == "independent" else ""
            line += [_format(score, like), _format(difference, like, signed=True) + method]
        cells.append(line)
    align = ["left", "left"] + ["right"] * (len(header) - 2)
    return tabulate(cells, header, tablefmt="pipe", colalign=align, disable_numparse=True)


def _bar_label(row: Row, series: int, compare: bool) -> str:
    like = row.scores[0].value
    if not compare:
        return _format(row.scores[0], like)
    reference, score = (_format(Estimate(e.value, None), like) for e in (row.scores[0], row.scores[series + 1]))
    return f"{_format(row.differences[series], like, signed=True)}  ({reference} → {score})"


def figure(models: list[ModelResults], rows: list[Row]):
    """Per-metric panels of bars: each model's difference from the reference (the score, for one
    model) per task, with 95% error bars."""
    from matplotlib.figure import Figure  # the Agg canvas, without pyplot's global state

    compare = len(models) > 1
    series = models[1:] if compare else models[:1]
    panels: dict[str, list[Row]] = {}
    for row in rows:
        panels.setdefault(row.metric, []).append(row)
    heights = [max(1.0, 0.45 * len(panel_rows) * len(series) + 0.8) for panel_rows in panels.values()]
    canvas = Figure(figsize=(11, sum(heights) + 0.6), layout="constrained")
    axes = canvas.subplots(len(panels), 1, squeeze=False, height_ratios=heights)[:, 0]
    bar = 0.8 / len(series)
    for ax, (metric, panel_rows) in zip(axes, panels.items()):
        for s, model in enumerate(series):
            estimates = [row.differences[s] if compare else row.scores[0] for row in panel_rows]
            positions = np.arange(len(panel_rows)) + (s - (len(series) - 1) / 2) * bar
            values = [e.value if e.value is not None else np.nan for e in estimates]
            errors = [1.96 * e.stderr if e.stderr is not None else 0.0 for e in estimates]
            bars = ax.barh(positions, values, height=bar, xerr=errors, capsize=3, label=model.model.label)
            labels = [_bar_label(row, s, compare) for row in panel_rows]
            ax.bar_label(bars, labels, padding=4, fontsize=7)
        ax.set_yticks(
            np.arange(len(panel_rows)), [f"{row.task}\nn={'?' if row.n is None else row.n}" for row in panel_rows]
        )
        ax.invert_yaxis()
        ax.margins(x=0.35)  # room for the labels beside the bars
        ax.axvline(0, color="black", linewidth=0.8)
        direction = _arrow(panel_rows[0]).strip()
        what = f"difference from {models[0].model.label} ({models[0].model.label} → model)" if compare else "score"
        ax.set_title(f"{metric} {direction} — {what} (±1.96 se)", fontsize=10)
    axes[0].legend(fontsize=8, loc="best")
    return canvas


def write_report(models: list[ModelResults], header: dict, directory: Path) -> str:
    """report.md, report.json and report.png; returns the markdown table."""
    rows = build_rows(models)
    table = markdown_table([m.model.label for m in models], rows)
    lines = [f"# Evaluation: suite `{header['suite']}`", ""]
    lines += [f"- {key}: {value}" for key, value in header.items() if key != "suite"]
    lines += [
        f"- model `{m.model.label}`: {m.model.path}" + (" (reference)" if i == 0 else "") for i, m in enumerate(models)
    ]
    lines += ["", table, "", STDERR_NOTE, ""]
    (directory / "report.md").write_text("\n".join(lines))
    summary = {
        **header,
        "reference": models[0].model.label,
        "models": [{"label": m.model.label, **m.provenance()} for m in models],
        "stderr": STDERR_NOTE,
        "rows": [
            asdict(row)
            | {
                "scores": {m.model.label: asdict(s) for m, s in zip(models, row.scores)},
                "differences": {m.model.label: asdict(d) for m, d in zip(models[1:], row.differences)},
            }
            for row in rows
        ],
    }
    (directory / "report.json").write_text(json.dumps(summary, indent=2) + "\n")
    figure(models, rows).savefig(directory / "report.png", dpi=110)
    return table
