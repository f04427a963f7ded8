"""lm-eval's side of a run: the task manager over our task folder, each suite task built once
(configs, sizes, metric aggregations, the code and data files that define it), one
`simple_evaluate` call per (model, suite task), and the per-item values the report pairs."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import logging
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import lm_eval
import lm_eval.evaluator
from lm_eval.api.registry import AGGREGATION_REGISTRY
from lm_eval.tasks import TaskManager
from lm_eval.utils import handle_non_serializable

from ladder.errors import UsageError, first_line
from ladder.io.files import atomic_write

from .models import file_name
from .report import BOOTSTRAP_DRAWS
from .runtime import Runtime
from .suite import TASKS_DIR, Suite, SuiteTask
from .tasks.utils import data_file


def _functions(value) -> Iterator[Callable]:
    """Every function in a task config (process_docs, custom_dataset, doc_to_target, ...)."""
    if isinstance(value, (dict, list, tuple)):
        for item in value.values() if isinstance(value, dict) else value:
            yield from _functions(item)
    elif callable(value) and hasattr(value, "__code__"):
        yield value


@contextlib.contextmanager
def hub_offline(datasets_cache: Path) -> Iterator[None]:
    """No Hub access and a private `datasets` cache for the duration (local suites); the libraries'
    module flags too, since they read the environment when first imported."""
    import datasets.config
    import huggingface_hub.constants

    switches = {"HF_HUB_OFFLINE": True, "HF_DATASETS_OFFLINE": True, "HF_DATASETS_CACHE": datasets_cache}
    with (
        mock.patch.dict(os.environ, {key: "1" if value is True else str(value) for key, value in switches.items()}),
        mock.patch.object(huggingface_hub.constants, "HF_HUB_OFFLINE", True),
        mock.patch.multiple(datasets.config, **switches),
    ):
        yield


def task_manager(suite: Suite, data_dir: Path | None = None) -> TaskManager:
    """A TaskManager over our task folder; lm-eval's own task configs are indexed (about 10 s) only
    when the suite names a task that is not ours."""
    data_dir = str(data_dir.resolve()) if data_dir is not None else None
    ours = _task_manager(data_dir, include_defaults=False)
    return ours if all(task.task in ours.all_tasks for task in suite.tasks) else _task_manager(data_dir)


@functools.cache  # an index is of installed files: built once per process
def _task_manager(data_dir: str | None, include_defaults: bool = True) -> TaskManager:
    metadata = {"data_dir": data_dir} if data_dir is not None else {}
    return TaskManager(include_path=str(TASKS_DIR), include_defaults=include_defaults, metadata=metadata)


def task_configs(suite: Suite, manager: TaskManager) -> dict[str, dict]:
    """Every suite task built once, before any model loads (unknown names and missing data files fail
    here): its leaf tasks' configs, sizes and aggregations, and what its cache key hashes."""
    unknown = [task.task for task in suite.tasks if task.task not in manager.all_tasks]
    if unknown:
        raise UsageError(
            f"unknown task(s) {', '.join(unknown)}; "
            f"ours are {', '.join(sorted(t for t in manager.all_subtasks if t.startswith('ladder_')))}, "
            "stock names are listed by `lm_eval ls tasks`"
        )
    names = {function: name for name, function in AGGREGATION_REGISTRY.items()}
    configs = {}
    for suite_task in suite.tasks:
        try:
            loaded = manager.load([suite_task.task])
        except FileNotFoundError as error:
            raise UsageError(first_line(error)) from None
        sources, data_files = set(), {}
        for task in loaded["tasks"].values():
            # dump_config() below has each function's own source; hash its whole module too (the
            # helpers it calls), from the live config.
            for function in _functions(vars(task.config)):
                file = Path(function.__code__.co_filename)
                if file.is_file():
                    sources.add(hashlib.sha256(file.read_bytes()).hexdigest())
            if callable(task.config.custom_dataset):
                data_dir = (task.config.metadata or {}).get("data_dir")
                files = (task.config.dataset_kwargs or {}).get("data_files") or {}
                data_files.update({relative: str(data_file(relative, data_dir)) for relative in sorted(files.values())})
        configs[suite_task.task] = {
            "sources": sorted(sources),  # SHA-256 of each module file its functions come from
            "data_files": data_files,  # the files it reads: path in the data folder -> file
            "configs": {name: task.dump_config() for name, task in loaded["tasks"].items()},
            "sizes": {name: len(task.eval_docs) for name, task in loaded["tasks"].items()},
            "aggregations": {
                name: {metric: names.get(function, "") for metric, function in task.aggregation().items()}
                for name, task in loaded["tasks"].items()
            },
        }
    return configs


def _plain(value):
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return float(value) if isinstance(value, (int, float)) else value  # a bool too: 1.0 or 0.0


def per_item_values(output: dict) -> dict[str, dict[str, dict]]:
    """{task: {"metric,filter": {"doc_id": [...], "value": [...]}}} from lm-eval's logged samples."""
    values: dict[str, dict[str, dict]] = {}
    for task, samples in output.get("samples", {}).items():
        metrics = {key.split(",")[0] for key in output["results"].get(task, {}) if "," in key and "_stderr" not in key}
        columns: dict[str, dict] = {}
        for sample in sorted(samples, key=lambda s: s["doc_id"]):
            for metric in metrics & set(sample):
                column = columns.setdefault(f"{metric},{sample.get('filter', 'none')}", {"doc_id": [], "value": []})
                column["doc_id"].append(sample["doc_id"])
                column["value"].append(_plain(sample[metric]))
        values[task] = columns
    return values


def evaluate_task(
    lm, suite_task: SuiteTask, manager: TaskManager, sizes: dict[str, int], runtime: Runtime
) -> tuple[dict, dict] | None:
    """One `simple_evaluate` call: (lm-eval's results dict with `per_item` metric values, its samples);
    None on the processes other than 0."""
    # `every` and `fraction` pick items by index (lm-eval's `samples`), which excludes `limit`: all here.
    samples = None
    if suite_task.every > 1 or suite_task.fraction is not None:
        samples = {name: suite_task.item_indices(size) for name, size in sizes.items()}
    # lm-eval prints some progress ("bootstrapping for stddev: perplexity"): to its log, not stdout.
    with (
        contextlib.redirect_stdout(io.StringIO()) as printed,
        mock.patch.multiple(
            lm_eval.evaluator,
            add_env_info=lambda storage: storage.update(_environment()),
            get_git_commit_hash=lambda: _environment()["git_hash"],
        ),
    ):
        output = lm_eval.simple_evaluate(
            model=lm,
            tasks=[suite_task.task],
            num_fewshot=suite_task.num_fewshot,
            limit=suite_task.limit if samples is None else None,
            samples=samples,
            task_manager=manager,
            bootstrap_iters=BOOTSTRAP_DRAWS,
            log_samples=True,
            # Recorded in lm-eval's `config` (the model is already placed: these do not move it).
            device=runtime.describe()["device"],
            batch_size=lm.batch_size_per_gpu,
            **suite_task.chat_options(),
        )
    for line in filter(None, printed.getvalue().splitlines()):
        logging.getLogger("lm_eval").info(line)
    if output is None:
        return None
    record = {key: value for key, value in output.items() if key != "samples"}
    record["config"] = {**record.get("config", {}), **runtime.describe(), "chat": suite_task.chat_options()}
    record["per_item"] = per_item_values(output)
    # Round-trip through JSON so that a fresh record and a cached one are the same objects.
    record = json.loads(json.dumps(record, default=str))
    return record, json.loads(json.dumps(output["samples"], default=handle_non_serializable, ensure_ascii=False))


@functools.cache
def _environment() -> dict:
    """What lm-eval records of the environment, once per process (about 2 s, which simple_evaluate
    spent on every task), with the git commit of this checkout rather than of the working folder."""
    from lm_eval.loggers.utils import add_env_info

    environment: dict = {}
    add_env_info(environment)
    git = subprocess.run(["git", "describe", "--always"], cwd=TASKS_DIR, capture_output=True, text=True)
    environment["git_hash"] = git.stdout.strip() or None
    return environment


def write_samples(directory: Path, samples: dict) -> None:
    """lm-eval's per-item records, one file per leaf task, as `lm_eval --log_samples` writes them."""
    directory.mkdir(parents=True, exist_ok=True)
    for task, records in samples.items():
        lines = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
        atomic_write(directory / f"{file_name(task)}.jsonl", lines)
