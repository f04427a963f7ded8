"""`evaluate_models`, the eval stage as one library function: resolve the models, score the suite
through the harness (with its cache), and write the results folder (lm-eval's JSON per model, and
report.md / report.json / report.png) atomically. `ladder eval` and the demo call it."""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from ladder.files import atomic_directory, atomic_write

from .suite import Suite, SuiteTask

DEFAULT_RUNS = Path("runs/eval")


@dataclass(frozen=True)
class Evaluation:
    out: Path  # the results folder
    table: str  # the side-by-side table (markdown), as printed
    wall_seconds: float


def evaluate_models(
    models: list[str],
    suite: Suite,
    out: Path | None = None,
    force: bool = False,
    data_dir: Path | None = None,
    batch_size: int = 8,
    cache_dir: Path | None = DEFAULT_RUNS / "cache",
    verbose: bool = False,
) -> Evaluation:
    """Score `models` (checkpoint folders, .gguf files or `embedded`, each optionally `LABEL=MODEL`;
    the first is the reference column) on `suite` into `out` (default runs/eval/<time>-<suite>).
    `data_dir`: the folder our offline tasks read; `cache_dir` None scores everything again."""
    # lm-eval is slow to import: not until something is scored (`ladder eval --help` stays fast).
    import lm_eval

    from . import harness, report

    refs = harness.resolve_models(models)
    out = out or DEFAULT_RUNS / f"{time.strftime('%Y%m%d-%H%M%S')}-{suite.name}"
    if not verbose:
        logging.getLogger("lm_eval").setLevel(logging.ERROR)
        import datasets

        datasets.disable_progress_bars()

    started = time.monotonic()
    with atomic_directory(out, force=force) as staging:
        datasets_cache = staging / ".datasets-cache"
        offline = harness.hub_offline(datasets_cache) if suite.offline else contextlib.nullcontext()
        with offline:
            manager = harness.task_manager(suite, data_dir)
            prepared = harness.task_configs(suite, manager)
            results = harness.run_suite(refs, suite, manager, prepared, batch_size=batch_size, cache_dir=cache_dir)
        shutil.rmtree(datasets_cache, ignore_errors=True)
        for model_results in results:
            name = "".join(c if c.isalnum() or c in "-_." else "_" for c in model_results.model.label)
            atomic_write(staging / f"{name}.json", _json(harness.lm_eval_json(model_results)))
        header = {
            "suite": suite.name,
            "tasks": ", ".join(_describe(task) for task in suite.tasks),
            "lm_eval": lm_eval.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "wall_seconds": round(time.monotonic() - started, 1),
        }
        table = report.write_report(results, header, staging)
    return Evaluation(out, table, header["wall_seconds"])


def _describe(task: SuiteTask) -> str:
    settings = []
    if task.num_fewshot:
        settings.append(f"{task.num_fewshot}-shot")
    if task.every > 1:
        settings.append(f"one item in {task.every}")
    if task.limit:
        settings.append(f"at most {task.limit}")
    return f"{task.task} ({', '.join(settings)})" if settings else task.task


def _json(data: object) -> str:
    return json.dumps(data, indent=2, default=str, ensure_ascii=False) + "\n"


__all__ = ["DEFAULT_RUNS", "Evaluation", "evaluate_models"]
