"""`evaluate_models`, the eval stage as one library function (`ladder eval` and the demo call it;
under `accelerate launch` every process calls it and process 0 writes the results)."""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ladder.errors import UsageError, first_line
from ladder.io.files import atomic_directory, atomic_write
from ladder.io.outputs import check_output

from .runtime import Runtime, resolve_runtime
from .suite import Suite


@dataclass(frozen=True)
class Evaluation:
    out: Path  # the results folder
    table: str  # the side-by-side table (markdown), as printed
    wall_seconds: float


def evaluate_models(
    models: list[str],
    suite: Suite,
    out: Path,
    runtime: Runtime | None = None,
    force: bool = False,
    data_dir: Path | None = None,
    cache_dir: Path | None = None,
    verbose: bool = False,
    log_samples: bool = False,
) -> Evaluation | None:
    """Score `models` (`resolve_models` names; the first is the reference column) on `suite`, and
    write the results folder `out` atomically: lm-eval's JSON per model, the report, and with
    `log_samples` lm-eval's per-item records. `data_dir`: the folder our offline tasks read;
    `cache_dir`: scores kept and reused (None: scored again). None on processes other than 0."""
    # lm-eval is slow to import: not until something is scored (`ladder eval --help` stays fast).
    import lm_eval

    from . import report
    from .backends import get_backend
    from .models import check_chat_templates, file_name, lm_eval_json, resolve_models

    refs = resolve_models(models)
    check_outputs(refs, out, cache_dir, data_dir, force)  # atomic_directory checks a replaced folder again at the end
    check_chat_templates(refs, suite)
    runtime = runtime or resolve_runtime()
    get_backend(runtime.backend).check(runtime, refs)
    quiet_libraries(verbose)
    if runtime.rank != 0:
        # The other processes score their share of the items and write nothing.
        with tempfile.TemporaryDirectory(prefix="ladder-eval-") as scratch:
            _score(refs, suite, data_dir, runtime, cache_dir=None, samples_dir=None, datasets_cache=Path(scratch))
        return None
    started = time.monotonic()
    with atomic_directory(out, force=force, command="eval") as staging:
        datasets_cache = staging / ".datasets-cache"
        samples_dir = staging / "samples" if log_samples else None
        results = _score(refs, suite, data_dir, runtime, cache_dir, samples_dir, datasets_cache)
        shutil.rmtree(datasets_cache, ignore_errors=True)
        for model_results in results:
            record = json.dumps(lm_eval_json(model_results), indent=2, default=str, ensure_ascii=False)
            atomic_write(staging / f"{file_name(model_results.model.label)}.json", record + "\n")
        header = {
            "suite": suite.name,
            "tasks": ", ".join(task.describe() for task in suite.tasks),
            **runtime.describe(),
            "lm_eval": lm_eval.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "wall_seconds": round(time.monotonic() - started, 1),
        }
        table = report.write_report(results, header, staging)
    return Evaluation(out, table, header["wall_seconds"])


def check_outputs(refs: list, out: Path, cache_dir: Path | None, data_dir: Path | None, force: bool) -> None:
    """The results folder and the cache under the output rule (ladder/io/outputs.py)."""
    inputs = [ref.path for ref in refs] + [data_dir]
    check_output(out, "eval", inputs, force=force)
    if cache_dir is not None:
        check_output(cache_dir, "eval", inputs, existing="add", what="--cache")


def quiet_libraries(verbose: bool) -> None:
    if not verbose:
        import datasets

        logging.getLogger("lm_eval").setLevel(logging.ERROR)
        datasets.disable_progress_bars()


def _score(refs, suite: Suite, data_dir, runtime, cache_dir, samples_dir, datasets_cache: Path) -> list:
    from .harness import run_suite
    from .lm_tasks import hub_offline

    with hub_offline(datasets_cache) if suite.offline else contextlib.nullcontext():
        manager, prepared = _prepare_tasks(suite, data_dir, runtime.processes)
        return run_suite(refs, suite, manager, prepared, runtime, cache_dir=cache_dir, samples_dir=samples_dir)


def check_tasks(suite: Suite, data_dir: Path | None, processes: int) -> None:
    """`_prepare_tasks`' checks, before a launcher starts `processes`."""
    from .lm_tasks import hub_offline

    with tempfile.TemporaryDirectory(prefix="ladder-eval-") as scratch:
        with hub_offline(Path(scratch)) if suite.offline else contextlib.nullcontext():
            _prepare_tasks(suite, data_dir, processes)


def _prepare_tasks(suite: Suite, data_dir: Path | None, processes: int):
    """lm-eval's task manager and each suite task built once, after checking what fails late otherwise:
    the Hub reachable for stock tasks, and an item of every task for each process (one with none
    fails only after the models load)."""
    from .lm_tasks import task_configs, task_manager

    if not suite.offline:
        _check_hub()
    manager = task_manager(suite, data_dir)
    try:
        prepared = task_configs(suite, manager)
    except ConnectionError as error:  # datasets' own: a Hub dataset neither reachable nor cached
        raise UsageError(
            f"{first_line(error)}: a stock lm-eval task reads its dataset from the Hub (or, offline, "
            "from the datasets cache); our offline tasks are the ladder_* ones"
        ) from None
    for suite_task in suite.tasks:
        for leaf, size in prepared[suite_task.task]["sizes"].items():
            items = len(suite_task.item_indices(size))
            if items < processes:
                raise UsageError(
                    f"--processes {processes}: {leaf} scores {items} item(s), fewer than one per process; "
                    f"use at most {items} process(es) or more items (--limit, the suite's limit)"
                )
    return manager, prepared


def _check_hub(timeout: float = 10.0) -> None:
    """The Hub answers, unless switched off: probed with a short timeout, not found out after
    datasets' own retries (about 40 s) in a long traceback."""
    import urllib.error
    import urllib.request

    import huggingface_hub.constants

    if huggingface_hub.constants.HF_HUB_OFFLINE:
        return
    endpoint = huggingface_hub.constants.ENDPOINT
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout).close()
    except urllib.error.HTTPError:
        return  # it answered
    except OSError as error:  # URLError, timeouts
        reason = getattr(error, "reason", error)
        raise UsageError(
            f"the Hugging Face Hub ({endpoint}) is not reachable ({reason}): stock lm-eval tasks read their "
            "data from it; score our offline tasks (--suite offline, ladder_* tasks), or set HF_HUB_OFFLINE=1 "
            "to read datasets already in the cache"
        ) from None
