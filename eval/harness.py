"""Score models on a suite with lm-evaluation-harness, one (model, task) at a time, with a cache
(eval/cache.py): each model loaded once by its backend, each suite task one `simple_evaluate` call.
Under `accelerate launch` lm-eval splits the items between the processes and gathers the results on
process 0, which alone reads and writes the cache.
"""

from __future__ import annotations

import gc
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path

from lm_eval.api.model import CacheHook
from lm_eval.tasks import TaskManager
from tqdm import tqdm

from ladder.chat_template import TemplateWorker
from ladder.log import log as ladder_log

from .backends import get_backend
from .cache import (
    FILE_HASHES,
    FileHashes,
    cache_key,
    code_digest,
    fingerprint,
    model_class,
    read_cache,
    scoring_digest,
    task_identity,
    write_cache,
)
from .lm_tasks import evaluate_task, write_samples
from .models import ModelRef, ModelResults, bound_chat_template, file_name
from .runtime import Runtime, share
from .suite import Suite


def run_suite(
    models: list[ModelRef],
    suite: Suite,
    manager: TaskManager,
    prepared: dict[str, dict],
    runtime: Runtime,
    *,
    cache_dir: Path | None = None,
    samples_dir: Path | None = None,
) -> list[ModelResults]:
    """Score every model on every suite task; a model whose tasks are all cached is not loaded.
    `samples_dir`: each model's per-item samples go to samples_dir/<label>/<task>.jsonl.
    On the processes other than 0 of a multi-process run (given no cache_dir), returns an empty list."""
    main = runtime.rank == 0
    log = lambda message: _write(message, logging.INFO) if main else None  # process 0 speaks for all
    backend = get_backend(runtime.backend)
    hashes = FileHashes(cache_dir / FILE_HASHES if cache_dir is not None else None)  # weights' and data files'
    identities, scoring_code = {}, ""
    if cache_dir is not None:
        identities = {task.task: task_identity(task, prepared[task.task], hashes) for task in suite.tasks}
        scoring_code = scoring_digest()  # hashed once per run
    # The run's batch size, but 1 for rolling windows: a window is already max_length tokens, and
    # batching them only multiplies the logits' memory (8 x 8192 x 49152 floats for SmolLM2 is 13 GB).
    rolling = {task: {c.get("output_type") for c in prepared[task]["configs"].values()} for task in prepared}
    batch_sizes = {
        task: 1 if "loglikelihood_rolling" in types else runtime.batch_size for task, types in rolling.items()
    }
    items = {
        task.task: sum(len(task.item_indices(n)) for n in prepared[task.task]["sizes"].values()) for task in suite.tasks
    }
    everything = []
    progress = tqdm(total=len(models) * sum(items.values()), unit="item", file=sys.stderr, disable=not main)
    with progress:
        for number, ref in enumerate(models, 1):
            progress.set_description(f"model {number}/{len(models)} {ref.label}")
            results, keys = ModelResults(ref, ""), {}
            if main:
                log(f"hashing {ref.path}")
                results.fingerprint = fingerprint(ref.path, hashes)
                hashes.save()
            if cache_dir is not None:  # the weights, the code that runs them and the code that scores them
                code = code_digest([model_class(ref.path), *backend.code_classes()])
                model = {"weights": results.fingerprint, "code": code, "scoring_code": scoring_code}
                keys = {
                    task: cache_key(model, identity, runtime, batch_sizes[task])
                    for task, identity in identities.items()
                }
            warn = lambda message: _write(message, logging.WARNING)
            found = {task: hit for task, key in keys.items() if (hit := read_cache(cache_dir / f"{key}.json", warn))}
            results.cached = share(runtime, list(found))
            progress.total -= sum(items[task] for task in results.cached)  # the time left counts what is scored
            progress.refresh()
            missing = [task for task in suite.tasks if task.task not in results.cached]
            expected = progress.n  # the bar moves by items as they are scored, and by a task's items in all
            if missing:  # the model loaded once, and not at all when every task is cached
                where = f"{runtime.dtype} on {runtime.describe()['device']}, {runtime.processes} process(es)"
                log(f"loading {ref.label} ({where})")
                lm = backend.load_lm(ref, runtime)
                counter = ItemProgress(lm, progress)
                with TemplateWorker(f"{ref.label} ({ref.path})") as worker:  # started by the first chat, if any
                    for number, task in enumerate(missing, 1):
                        if task.apply_chat_template:
                            bound_chat_template(lm, worker, task.apply_chat_template)
                        progress.set_postfix_str(f"task {number}/{len(missing)} {task.task}")
                        log(f"scoring {ref.label} on {task.describe()}")
                        lm.batch_size_per_gpu = batch_sizes[task.task]
                        started = time.monotonic()
                        counter.items = items[task.task]
                        scored = evaluate_task(lm, task, manager, prepared[task.task]["sizes"], runtime)
                        log(f"scored {ref.label} on {task.task} in {time.monotonic() - started:.0f} s")
                        if scored is None:  # the processes other than 0
                            continue
                        found[task.task] = scored
                        expected += items[task.task]
                        progress.update(expected - progress.n)
                        if cache_dir is not None:  # as each task is scored: a failure later keeps it
                            write_cache(cache_dir / f"{keys[task.task]}.json", *scored)
                del lm
                gc.collect()
            if main:
                if results.cached:
                    log(f"{ref.label}: cached results for {', '.join(results.cached)}")
                for task in suite.tasks:  # suite order
                    record, samples = found[task.task]
                    record["aggregations"] = prepared[task.task]["aggregations"]
                    results.tasks[task.task] = record
                    if samples_dir is not None:
                        write_samples(samples_dir / file_name(ref.label), samples)
                everything.append(results)
    return everything


def _write(message: str, level: int) -> None:
    """A line of the `ladder` logger's, written around the progress bar."""
    if ladder_log.isEnabledFor(level):
        tqdm.write(message, file=sys.stdout if level < logging.WARNING else sys.stderr)


class ItemProgress(CacheHook):
    """lm-eval's cache hook, told of each request scored (and by the hf backend's scorer, of each
    batch): the run's bar moves by items, an item being one request or several (its choices)."""

    def __init__(self, lm, progress: tqdm):
        super().__init__(None)
        self.progress, self.items, self.per_request, self.pending = progress, 0, 0.0, 0.0
        lm.set_cache_hook(self)
        for name in ("loglikelihood", "loglikelihood_rolling", "generate_until"):
            setattr(lm, name, self.counting(getattr(lm, name)))

    def counting(self, method: Callable) -> Callable:
        def counted(requests, *args, **kwargs):
            self.per_request, self.pending = self.items / max(len(requests), 1), 0.0
            return method(requests, *args, **kwargs)

        return counted

    def add_partial(self, attr, req, res) -> None:
        self.scored(1)

    def scored(self, count: int) -> None:
        self.pending += count * self.per_request
        self.progress.update(int(self.pending))  # whole items: the bar shows counts
        self.pending -= int(self.pending)
