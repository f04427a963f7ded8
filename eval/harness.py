"""Score models on a suite with lm-evaluation-harness, one (model, task) at a time, with a cache.

Each model is loaded once with `ladder.loading.load_model` and handed to lm-eval as an `HFLM`
over the loaded model and tokenizer; each suite task is one `simple_evaluate` call through a
`TaskManager` that has our task folder (eval/tasks/) on its include path. A task's output is
lm-eval's own results dict (results, configs, versions, n-shot, ...) plus the per-item metric
values, which the report needs for paired standard errors. Outputs are cached on disk, keyed by
the model files' SHA-256, the task's config, few-shot, limit and the lm-eval version, so scoring
another ladder variant does not rescore the original.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import inspect
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import lm_eval
from lm_eval.api.registry import AGGREGATION_REGISTRY
from lm_eval.tasks import TaskManager

from ladder.errors import UsageError, first_line
from ladder.files import atomic_write, ladder_data_dir, sha256_file
from ladder.loading import embedded_model_path, load_model, resolve_model_path

from .suite import Suite, SuiteTask

TASKS_DIR = Path(__file__).parent / "tasks"
EMBEDDED = "embedded"
# lm-eval's default (100,000 bootstrap draws) takes minutes for LAMBADA's perplexity on a CPU;
# 1,000 draws estimate a standard error to within a few percent.
BOOTSTRAP_ITERS = 1000
# What `ladder convert` and `ladder adapt` write beside a model to say how it was made (with times).
PROVENANCE_FILES = ("conversion.json", "recipe.yaml")
# Bump when the cached record's layout changes.
CACHE_FORMAT = 1


@dataclass(frozen=True)
class ModelRef:
    """A model as the user named it (`spec`), the file or folder it resolves to, and its column label."""

    spec: str
    path: Path
    label: str


@dataclass
class ModelResults:
    model: ModelRef
    fingerprint: str
    tasks: dict[str, dict] = field(default_factory=dict)  # suite task name -> task record
    cached: list[str] = field(default_factory=list)  # suite task names read from the cache


def resolve_models(specs: list[str]) -> list[ModelRef]:
    """Resolve model names (a checkpoint folder, a .gguf file or `embedded`, each optionally as
    `LABEL=MODEL` to name its column) with distinct labels."""
    refs = []
    for spec in specs:
        label, sep, model = spec.partition("=")
        if not sep or Path(spec).exists():
            label, model = "", spec
        elif not label:
            raise UsageError(f"model {spec!r}: the label before '=' is empty")
        path = embedded_model_path() if model == EMBEDDED else resolve_model_path(model)
        path = path.resolve()
        refs.append(ModelRef(model, path, label or (path.stem if path.is_file() else path.name)))
    labels = [ref.label for ref in refs]
    return [
        ModelRef(ref.spec, ref.path, f"{ref.label} #{i + 1}") if labels.count(ref.label) > 1 else ref
        for i, ref in enumerate(refs)
    ]


def fingerprint(path: Path) -> str:
    """SHA-256 over the files that make the model: a GGUF file, or every top-level file of a
    checkpoint folder (weights, config with the ladder layers, tokenizer, modeling code) but its
    docs and provenance records, so that converting the same weights again hits the cache."""
    files = [path] if path.is_file() else sorted(
        p for p in path.iterdir()
        if p.is_file() and not p.name.startswith(".") and p.suffix != ".md" and p.name not in PROVENANCE_FILES
    )
    digest = hashlib.sha256()
    for file in files:
        digest.update(f"{file.name}\0{sha256_file(file)}\n".encode())
    return digest.hexdigest()


@contextlib.contextmanager
def hub_offline(datasets_cache: Path) -> Iterator[None]:
    """No Hub access and a private `datasets` cache for the duration (local suites).

    huggingface_hub and datasets read these switches from the environment when first imported,
    which has happened by now (transformers imports them), so their module flags are set too.
    """
    import datasets.config
    import huggingface_hub.constants

    patches = [
        (huggingface_hub.constants, "HF_HUB_OFFLINE", True),
        (datasets.config, "HF_HUB_OFFLINE", True),
        (datasets.config, "HF_DATASETS_OFFLINE", True),
        (datasets.config, "HF_DATASETS_CACHE", datasets_cache),
    ]
    saved_env = {key: os.environ.get(key) for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_DATASETS_CACHE")}
    saved_attrs = [(module, name, getattr(module, name)) for module, name, _ in patches]
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_DATASETS_CACHE=str(datasets_cache))
    for module, name, value in patches:
        setattr(module, name, value)
    try:
        yield
    finally:
        for module, name, value in saved_attrs:
            setattr(module, name, value)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def task_manager(suite: Suite, data_dir: Path | None = None) -> TaskManager:
    """A TaskManager over our task folder; lm-eval's own ~15k task configs are indexed (about 10 s)
    only when the suite names a task that is not ours."""
    metadata = {"data_dir": str((data_dir or ladder_data_dir()).resolve())}
    ours = TaskManager(include_path=str(TASKS_DIR), include_defaults=False, metadata=metadata)
    if all(task.task in ours.all_tasks for task in suite.tasks):
        return ours
    return TaskManager(include_path=str(TASKS_DIR), metadata=metadata)


def _aggregation_names() -> dict[Callable, str]:
    return {function: name for name, function in AGGREGATION_REGISTRY.items()}


def task_configs(suite: Suite, manager: TaskManager) -> dict[str, dict]:
    """Build every suite task once, before any model loads: unknown names and missing data files
    fail here. Returns per suite task its leaf tasks' configs and metric aggregations."""
    unknown = [task.task for task in suite.tasks if task.task not in manager.all_tasks]
    if unknown:
        raise UsageError(
            f"suite {suite.name}: unknown task(s) {', '.join(unknown)}; "
            f"ours are {', '.join(sorted(t for t in manager.all_subtasks if t.startswith('ladder_')))}, "
            "stock names are listed by `lm_eval ls tasks`"
        )
    names = _aggregation_names()
    configs = {}
    for suite_task in suite.tasks:
        try:
            loaded = manager.load([suite_task.task])
        except FileNotFoundError as error:
            raise UsageError(first_line(error)) from None
        configs[suite_task.task] = {
            "configs": {name: task.dump_config() for name, task in loaded["tasks"].items()},
            "sizes": {name: len(task.eval_docs) for name, task in loaded["tasks"].items()},
            "aggregations": {
                name: {metric: names.get(function, "") for metric, function in task.aggregation().items()}
                for name, task in loaded["tasks"].items()
            },
        }
    return configs


def cache_key(model_fingerprint: str, suite_task: SuiteTask, prepared: dict, backend: str = "hf") -> str:
    configs = {
        name: {**config, "metadata": {k: v for k, v in config.get("metadata", {}).items() if k != "config_source"}}
        for name, config in prepared["configs"].items()
    }
    identity = {
        "format": CACHE_FORMAT,
        "model": model_fingerprint,
        "task": suite_task.task,
        "num_fewshot": suite_task.num_fewshot,
        "limit": suite_task.limit,
        "every": suite_task.every,
        "configs": configs,
        "lm_eval": lm_eval.__version__,
    }
    if backend != "hf":  # other kernels, other scores; HF keys stay as they were
        identity["backend"] = backend
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=_stable_repr).encode()).hexdigest()


def _stable_repr(value) -> str:
    """A config value as text that is the same in every process: a function (a task's
    `process_docs`, say) by its name and source, not by its memory address as `str` gives it."""
    if callable(value) and hasattr(value, "__qualname__"):
        try:
            source = hashlib.sha256(inspect.getsource(value).encode()).hexdigest()[:16]
        except (OSError, TypeError):
            source = "?"
        return f"{value.__module__}.{value.__qualname__}:{source}"
    return str(value)


def _plain(value):
    """Per-item metric values as JSON types: floats, or lists for (loglikelihood, count) pairs."""
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, bool):
        return float(value)
    return float(value) if isinstance(value, (int, float)) else value


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


def evaluate_task(lm, suite_task: SuiteTask, manager: TaskManager, sizes: dict[str, int]) -> dict:
    """One `simple_evaluate` call; returns lm-eval's results dict without the raw samples, plus
    `per_item` metric values. `sizes`: the number of items of each of the suite task's tasks."""
    # `every` picks items by index (lm-eval's `samples`), which excludes `limit`: apply both here.
    samples = None
    if suite_task.every > 1:
        samples = {name: list(range(0, size, suite_task.every))[: suite_task.limit] for name, size in sizes.items()}
    output = lm_eval.simple_evaluate(
        model=lm,
        tasks=[suite_task.task],
        num_fewshot=suite_task.num_fewshot,
        limit=suite_task.limit if samples is None else None,
        samples=samples,
        task_manager=manager,
        bootstrap_iters=BOOTSTRAP_ITERS,
        log_samples=True,
    )
    record = {key: value for key, value in output.items() if key != "samples"}
    record["per_item"] = per_item_values(output)
    # Round-trip through JSON so that a fresh record and a cached one are the same objects.
    return json.loads(json.dumps(record, default=str))


def _read_cache(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def run_suite(
    models: list[ModelRef],
    suite: Suite,
    manager: TaskManager,
    prepared: dict[str, dict],
    *,
    batch_size: int = 8,
    cache_dir: Path | None = None,
    log: Callable[[str], None] = lambda message: print(message, file=sys.stderr),
    backend: str = "hf",
    tensor_parallel: int = 1,
) -> list[ModelResults]:
    """Score every model on every suite task; a model whose tasks are all cached is not loaded.
    `backend`: "hf" (transformers, in this process) or "vllm" (an engine with `tensor_parallel`
    ranks, see vllm_backend.py)."""
    from lm_eval.models.huggingface import HFLM

    everything = []
    for ref in models:
        log(f"hashing {ref.path}")
        results = ModelResults(ref, fingerprint(ref.path))
        keys = {task.task: cache_key(results.fingerprint, task, prepared[task.task], backend) for task in suite.tasks}
        for task in suite.tasks:
            if cache_dir is not None and (record := _read_cache(cache_dir / f"{keys[task.task]}.json")):
                results.tasks[task.task] = record
                results.cached.append(task.task)
        missing = [task for task in suite.tasks if task.task not in results.tasks]
        if missing:
            log(f"loading {ref.label}")
            model = tokenizer = engine = None
            if backend == "vllm":
                from .vllm_backend import vllm_lm

                engine = vllm_lm(ref.path, tensor_parallel)
            else:
                model, tokenizer = load_model(ref.path)
            for task in missing:
                items = "all items" if task.limit is None else f"at most {task.limit} items"
                items += f", one in {task.every}" if task.every > 1 else ""
                log(f"scoring {ref.label} on {task.task} ({items})")
                # A rolling window is already max_length tokens: batching them only multiplies
                # the logits' memory (8 x 8192 x 49152 floats for SmolLM2 is 13 GB).
                rolling = any(
                    config.get("output_type") == "loglikelihood_rolling"
                    for config in prepared[task.task]["configs"].values()
                )
                lm = engine if engine is not None else HFLM(
                    pretrained=model, tokenizer=tokenizer, batch_size=1 if rolling else batch_size
                )
                started = time.monotonic()
                record = evaluate_task(lm, task, manager, prepared[task.task]["sizes"])
                log(f"scored {ref.label} on {task.task} in {time.monotonic() - started:.0f} s")
                results.tasks[task.task] = record
                if cache_dir is not None:
                    cache_dir.mkdir(parents=True, exist_ok=True)
                    atomic_write(cache_dir / f"{keys[task.task]}.json", json.dumps(record))
            del lm, model, tokenizer, engine
            gc.collect()
        if results.cached:
            log(f"{ref.label}: cached results for {', '.join(results.cached)}")
        results.tasks = {task.task: results.tasks[task.task] for task in suite.tasks}  # suite order
        for task in suite.tasks:
            results.tasks[task.task]["aggregations"] = prepared[task.task]["aggregations"]
        everything.append(results)
    return everything


def lm_eval_json(results: ModelResults) -> dict:
    """One model's results in lm-eval's layout (results, configs, versions, n-shot, ...), merged over
    the suite's tasks; the run-level fields (config, versions, date) are the latest evaluation's."""
    merged: dict = {}
    for record in results.tasks.values():
        for key, value in record.items():
            if key in ("per_item", "aggregations"):
                continue
            if isinstance(value, dict) and key != "config":
                merged.setdefault(key, {}).update(value)
            else:
                merged[key] = value
    merged["ladder"] = {
        "model": results.model.spec,
        "path": str(results.model.path),
        "fingerprint_sha256": results.fingerprint,
        "cached_tasks": results.cached,
    }
    return merged
