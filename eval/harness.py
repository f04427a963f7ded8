"""Score models on a suite with lm-evaluation-harness, one (model, task) at a time, with a cache.

Each model is loaded once (`load_lm`: `ladder.io.loading.load_model` in the run's dtype, onto its
device) and handed to lm-eval as an `HFLM` over the loaded model and tokenizer (whose model calls
for log-likelihoods run each shared context once: eval/shared_prefix.py); each suite task
is one `simple_evaluate` call through a `TaskManager` that has our task folder (eval/tasks/) on
its include path. Under `accelerate launch` with several processes each process holds a copy of
the model and lm-eval splits the items between them (data parallel), gathering the results on
process 0, which alone reads and writes the cache and the results folder.

A task's output is lm-eval's own results dict (results, configs, versions, n-shot, ...) plus the
per-item metric values, which the report needs for paired standard errors; its per-item samples
(prompts, targets, outputs) are kept beside it. Outputs are cached on disk under a key that covers
everything that can change a score (`cache_key`), so scoring another ladder variant does not
rescore the original, and no edit to a task, its data, the model code or the run's settings can
return a stale score.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import gzip
import hashlib
import inspect
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import lm_eval
import torch
import transformers
from lm_eval.api.registry import AGGREGATION_REGISTRY
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
from lm_eval.utils import handle_non_serializable

from ladder.errors import UsageError, first_line
from ladder.io.files import atomic_write, sha256_file
from ladder.io.loading import (
    DTYPES,
    from_pretrained_arguments,
    load_model,
    load_tokenizer,
    model_name,
    resolve_model_path,
)

from .shared_prefix import score_continuations
from .suite import Suite, SuiteTask
from .tasks.utils import data_paths

TASKS_DIR = Path(__file__).parent / "tasks"
# lm-eval's default (100,000 bootstrap draws) takes minutes for LAMBADA's perplexity on a CPU;
# 1,000 draws estimate a standard error to within a few percent.
BOOTSTRAP_ITERS = 1000
# What `ladder convert` and `ladder adapt` write beside a model to say how it was made (with times).
PROVENANCE_FILES = ("conversion.json", "recipe.yaml")
# Bump when the cached record's layout or the scoring code changes.
CACHE_FORMAT = 3
# `--device` values; `cuda:N` names one GPU.
DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")
# Where the content hashes of data files are remembered, by path, size and mtime (in the cache folder).
FILE_HASHES = "file-hashes.json"


@dataclass(frozen=True)
class Runtime:
    """Where and how the weights run: one device and dtype per process, lm-eval's batch size, and
    the accelerate state when `accelerate launch` started several processes."""

    device: str  # a torch device: "cpu", "cuda:0"
    dtype: str  # a key of ladder.io.loading.DTYPES
    batch_size: int | str = 8  # or "auto": lm-eval finds the largest that fits
    parallelize: bool = False  # split one model over every visible GPU (device_map="auto")
    accelerator: object | None = None  # an accelerate.Accelerator when processes > 1
    backend: str = "hf"  # "hf": transformers in this process; "vllm": a vLLM engine (eval/vllm_backend.py)
    tensor_parallel: int = 1  # the vllm backend's tensor-parallel ranks

    @property
    def processes(self) -> int:
        return self.accelerator.num_processes if self.accelerator is not None else 1

    @property
    def rank(self) -> int:
        return self.accelerator.process_index if self.accelerator is not None else 0

    @property
    def device_type(self) -> str:
        return torch.device(self.device).type

    def describe(self) -> dict:
        """What the report and lm-eval's JSON record about the run."""
        return {
            "device": "auto (device_map)" if self.parallelize else self.device,
            "dtype": self.dtype,
            "batch_size": self.batch_size,
            "processes": self.processes,
            **({"backend": self.backend, "tensor_parallel": self.tensor_parallel} if self.backend != "hf" else {}),
        }


def resolve_runtime(
    device: str = "auto",
    dtype: str = "auto",
    batch_size: int | str = 8,
    parallelize: bool = False,
    backend: str = "hf",
    tensor_parallel: int = 1,
) -> Runtime:
    """`auto` picks the GPU in bfloat16 where one is present (float16 on GPUs without bf16), else
    the CPU in float32. Under `accelerate launch` with several processes each takes the device
    accelerate gives it (its own GPU, or the CPU over gloo when there is none)."""
    if not DEVICE_PATTERN.fullmatch(device):
        raise UsageError(f"--device {device!r}: choose auto, cpu, cuda or cuda:N")
    if dtype != "auto" and dtype not in DTYPES:
        raise UsageError(f"--dtype {dtype!r}: choose auto, {', '.join(DTYPES)}")
    if not (batch_size == "auto" or (isinstance(batch_size, int) and batch_size >= 1)):
        raise UsageError(f"--batch-size {batch_size!r}: a positive integer or auto")
    cuda = torch.cuda.is_available()
    accelerator = None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        if device.startswith("cuda:"):
            raise UsageError(f"--device {device} names one GPU; under accelerate launch each process takes its own")
        if parallelize:
            raise UsageError("--parallelize splits one model over all GPUs: run it in a single process")
        from accelerate import Accelerator, InitProcessGroupKwargs

        # Process 0 hashes the models and reads the cache while the others wait (a large model
        # takes a while): a generous timeout for the first collective.
        accelerator = Accelerator(
            cpu=device == "cpu" or not cuda,
            kwargs_handlers=[InitProcessGroupKwargs(timeout=datetime.timedelta(hours=6))],
        )
        device = "cpu" if accelerator.device.type == "cpu" else str(accelerator.device)
    elif device == "auto":
        device = "cuda:0" if cuda else "cpu"
    elif device.startswith("cuda"):
        index = int(device.partition(":")[2] or 0)
        if not cuda:
            raise UsageError(f"--device {device}: no CUDA GPU is visible (torch {torch.__version__})")
        if index >= torch.cuda.device_count():
            raise UsageError(f"--device {device}: only {torch.cuda.device_count()} GPU(s) are visible")
        device = f"cuda:{index}"
    if parallelize and not device.startswith("cuda"):
        raise UsageError("--parallelize splits a model over GPUs: it needs --device cuda")
    if dtype == "auto":
        if device.startswith("cuda"):
            dtype = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
        else:
            dtype = "float32"
    if backend not in ("hf", "vllm"):
        raise UsageError(f"--backend {backend!r}: choose hf or vllm")
    if backend == "hf" and tensor_parallel != 1:
        raise UsageError("--tp is for --backend vllm")
    if backend == "vllm" and (accelerator is not None or parallelize):
        raise UsageError(
            "--backend vllm runs one engine per model (its own --tp ranks): drop --processes and --parallelize"
        )
    return Runtime(device, dtype, batch_size, parallelize, accelerator, backend, tensor_parallel)


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
        path = resolve_model_path(model)
        path = path.resolve()
        refs.append(ModelRef(model, path, label or model_name(path)))
    labels = [ref.label for ref in refs]
    return [
        ModelRef(ref.spec, ref.path, f"{ref.label} #{i + 1}") if labels.count(ref.label) > 1 else ref
        for i, ref in enumerate(refs)
    ]


def fingerprint(path: Path) -> str:
    """SHA-256 over the files that make the model: a GGUF file, or every top-level file of a
    checkpoint folder (weights, config with the ladder layers, tokenizer, modeling code) but its
    docs and provenance records, so that converting the same weights again hits the cache."""
    files = (
        [path]
        if path.is_file()
        else sorted(
            p
            for p in path.iterdir()
            if p.is_file() and not p.name.startswith(".") and p.suffix != ".md" and p.name not in PROVENANCE_FILES
        )
    )
    digest = hashlib.sha256()
    for file in files:
        digest.update(f"{file.name}\0{sha256_file(file)}\n".encode())
    return digest.hexdigest()


def model_class(path: Path) -> type:
    """The class that will run a model's weights: the installed one (ladder's own for a ladder
    checkpoint, not the copy of its code inside the checkpoint; transformers' Llama for a GGUF)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import ladder.model.auto  # noqa: F401  (the ladder model's Auto registration, as load_model does)

    location, extra = from_pretrained_arguments(path)
    try:
        config = AutoConfig.from_pretrained(location, **extra)
    except (OSError, ValueError, KeyError) as error:
        raise UsageError(f"cannot read the config of {path}: {first_line(error)}") from None
    return AutoModelForCausalLM._model_mapping[type(config)]


def code_digest(classes: list[type]) -> str:
    """SHA-256 over the source files of the modules that define `classes` and their base classes
    (torch's and Python's own excepted: the torch version is in the key)."""
    files = set()
    for cls in classes:
        for base in inspect.getmro(cls):
            if base.__module__.split(".")[0] in ("builtins", "torch", "typing"):
                continue
            with contextlib.suppress(TypeError, OSError):
                files.add(Path(inspect.getsourcefile(base)))
    digest = hashlib.sha256()
    for file in sorted(files):
        digest.update(f"{file.name}\0{hashlib.sha256(file.read_bytes()).hexdigest()}\n".encode())
    return digest.hexdigest()


class FileHashes:
    """Content hashes of data files, remembered in a small JSON index by path, size and mtime, so a
    large file is hashed once and not on every run (an edit changes the mtime; as for make and
    rsync, a change that keeps both size and mtime goes unseen)."""

    def __init__(self, index: Path | None):
        self.index = index
        self.known: dict[str, list] = {}
        if index is not None:
            with contextlib.suppress(OSError, json.JSONDecodeError):
                self.known = json.loads(index.read_text())
        self.changed = False

    def digest(self, path: Path) -> str:
        path = path.resolve()
        status = path.stat()
        known = self.known.get(str(path))
        if known and known[:2] == [status.st_size, status.st_mtime_ns]:
            return known[2]
        digest = sha256_file(path)
        self.known[str(path)] = [status.st_size, status.st_mtime_ns, digest]
        self.changed = True
        return digest

    def save(self) -> None:
        if self.index is not None and self.changed:
            self.index.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(self.index, json.dumps(self.known, indent=0, sort_keys=True))
            self.changed = False


def _functions(value) -> Iterator[Callable]:
    """Every function in a task config (process_docs, custom_dataset, doc_to_target, ...)."""
    if isinstance(value, dict):
        for item in value.values():
            yield from _functions(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _functions(item)
    elif callable(value) and hasattr(value, "__code__"):
        yield value


def task_identity(suite_task: SuiteTask, prepared: dict, hashes: FileHashes) -> dict:
    """What defines a suite task's scores apart from the model: the suite entry (items, few-shot,
    chat options), each leaf task's config, the full source of every module its functions come
    from (helpers they call included), and the content of every data file it reads."""
    configs = {}
    for name, config in prepared["configs"].items():
        metadata = config.get("metadata", {})
        # Where the YAML and the data folder sit does not change a score; their content does.
        configs[name] = {
            **config,
            "metadata": {k: v for k, v in metadata.items() if k not in ("config_source", "data_dir")},
        }
    data = {relative: hashes.digest(Path(path)) for relative, path in sorted(prepared["data_files"].items())}
    return {"suite_task": suite_task.as_dict(), "configs": configs, "sources": prepared["sources"], "data": data}


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
    # Our tasks read their files from here (eval/tasks/utils.py; without it, from `ladder_data_dir()`).
    metadata = {"data_dir": str(data_dir.resolve())} if data_dir is not None else {}
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
        sources, data_files = set(), {}
        for task in loaded["tasks"].values():
            # dump_config() below has each function's own source; hash its whole module too (the
            # helpers it calls), from the live config.
            for function in _functions(vars(task.config)):
                file = Path(function.__code__.co_filename)
                if file.is_file():
                    sources.add(hashlib.sha256(file.read_bytes()).hexdigest())
            if callable(task.config.custom_dataset):
                metadata = task.config.metadata or {}
                paths = data_paths(task.config.dataset_kwargs, metadata.get("data_dir"))
                data_files.update({relative: str(path) for relative, path in paths.items()})
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


def cache_key(model: dict, task: dict, runtime: Runtime, batch_size: int | str) -> str:
    """The key of one (model, suite task) score: `model` (the weights' `fingerprint` and the
    `code_digest` of the class that runs them), `task_identity`, the library versions, and the run's numerics: dtype, device class, batch size (padding changes the float
    sums) and process count (so does the batches' composition)."""
    identity = {
        "format": CACHE_FORMAT,
        "model": model,
        "task": task,
        "versions": {
            "lm_eval": lm_eval.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        },
        "dtype": runtime.dtype,
        "device": "auto" if runtime.parallelize else runtime.device_type,
        "batch_size": batch_size,
        "processes": runtime.processes,
    }
    if runtime.backend != "hf":  # other kernels, other scores; HF keys stay as they were
        identity["backend"] = runtime.backend
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=_stable_repr).encode()).hexdigest()


def _stable_repr(value) -> str:
    """A config value as text that is the same in every process: a function (a task's
    `process_docs`, say) by its name and source, not by its memory address as `str` gives it."""
    if callable(value) and hasattr(value, "__qualname__"):
        try:
            source = hashlib.sha256(inspect.getsource(value).encode()).hexdigest()[:16]
        except (OSError, TypeError):
            source = "?"
        # lm-eval names a task folder's module by its file path: the name alone, so that the key
        # does not depend on where the repository sits.
        return f"{value.__module__.rsplit('/', 1)[-1]}.{value.__qualname__}:{source}"
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


class _HFLM(HFLM):
    """lm-eval's HFLM over a model loaded here, sharing the items between the processes of an
    `accelerate launch` as HFLM does when it loads a model itself: HFLM sets its rank and world
    size only when it loads a `pretrained` path and counts more than one GPU, so a loaded model
    (our GGUF and ladder loading) and CPU processes over gloo would each score every item."""

    def __init__(self, model, tokenizer, runtime: Runtime):
        super().__init__(pretrained=model, tokenizer=tokenizer, batch_size=runtime.batch_size)
        if runtime.accelerator is not None and runtime.processes > 1:
            # The attributes HFLM's all_gather, gather_object and barrier use.
            self.accelerator = runtime.accelerator
            self._rank = runtime.accelerator.process_index
            self._world_size = runtime.accelerator.num_processes

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        """Llama-family models score with each shared context run once (eval/shared_prefix.py).
        lm-eval's own path stays for rolling windows (no request string: nothing is shared, every
        position is read), `--batch-size auto` (its detection) and other architectures."""
        batch_size = override_bs or self.batch_size
        shared = (
            isinstance(self.model, transformers.LlamaForCausalLM)
            and isinstance(batch_size, int)
            and all(request is not None for request, _, _ in requests)
        )
        if not shared:
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
        answers = score_continuations(
            self.model.model,
            self.model.lm_head,
            [(context, continuation) for _, context, continuation in requests],
            max_length=self.max_length,
            batch_size=batch_size,
        )
        for (request, _, _), answer in zip(requests, answers):
            self.cache_hook.add_partial("loglikelihood", request, answer)
        return answers


def load_lm(ref: ModelRef, runtime: Runtime) -> HFLM:
    """The one place where a model becomes an lm-eval LM: lm-eval's vLLM model for the vllm backend,
    else HFLM over the weights loaded in the run's dtype straight onto its device (or split over the GPUs)."""
    if runtime.backend == "vllm":
        from .vllm_backend import vllm_lm

        return vllm_lm(ref.path, runtime.tensor_parallel, runtime.dtype)
    device_map = "auto" if runtime.parallelize else None if runtime.device == "cpu" else {"": runtime.device}
    model, tokenizer = load_model(ref.path, dtype=DTYPES[runtime.dtype], device_map=device_map)
    return _HFLM(model, tokenizer, runtime)


def check_chat_templates(models: list[ModelRef], suite: Suite) -> None:
    """A suite task with apply_chat_template needs a tokenizer with a chat template: say so before
    anything is scored, not after the first model."""
    if not any(task.apply_chat_template for task in suite.tasks):
        return
    for ref in models:
        if not load_tokenizer(ref.path).chat_template:
            raise UsageError(
                f"{ref.label} ({ref.path}) has no chat template: drop --apply-chat-template (or the suite's "
                "apply_chat_template) for a base model"
            )


def evaluate_task(
    lm, suite_task: SuiteTask, manager: TaskManager, sizes: dict[str, int], runtime: Runtime
) -> tuple[dict, dict] | None:
    """One `simple_evaluate` call; returns lm-eval's results dict without the raw samples, plus
    `per_item` metric values, and the samples ({leaf task: [lm-eval sample records]}). None on
    the other processes of a multi-process run (lm-eval gathers the results on process 0).
    `sizes`: the number of items of each of the suite task's tasks."""
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
        # Recorded in lm-eval's `config` (the model is already placed: these do not move it).
        device=runtime.describe()["device"],
        batch_size=lm.batch_size_per_gpu,
        **suite_task.chat_options(),
    )
    if output is None:
        return None
    record = {key: value for key, value in output.items() if key != "samples"}
    record["config"] = {**record.get("config", {}), **runtime.describe(), "chat": suite_task.chat_options()}
    record["per_item"] = per_item_values(output)
    # Round-trip through JSON so that a fresh record and a cached one are the same objects.
    record = json.loads(json.dumps(record, default=str))
    return record, json.loads(json.dumps(output["samples"], default=handle_non_serializable, ensure_ascii=False))


def _read_cache(path: Path) -> tuple[dict, dict] | None:
    """A cached (record, samples), or None when either file is missing or unreadable."""
    try:
        record = json.loads(path.read_text())
        with gzip.open(path.with_suffix(".samples.json.gz"), "rt", encoding="utf-8") as handle:
            return record, json.load(handle)
    except (OSError, EOFError, json.JSONDecodeError):
        return None


def _write_cache(path: Path, record: dict, samples: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # The samples first: a record without them would not count as cached.
    samples_json = json.dumps(samples, ensure_ascii=False).encode()
    atomic_write(path.with_suffix(".samples.json.gz"), gzip.compress(samples_json, compresslevel=6, mtime=0))
    atomic_write(path, json.dumps(record))


def write_samples(directory: Path, samples: dict) -> None:
    """lm-eval's per-item records, one JSON line each, one file per leaf task (as `lm_eval
    --log_samples` writes them): prompt and arguments, target, the model's responses (generated
    text or log-likelihoods), the filtered answer and the item's metrics."""
    directory.mkdir(parents=True, exist_ok=True)
    for task, records in samples.items():
        lines = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
        atomic_write(directory / f"{_file_name(task)}.jsonl", lines)


def _file_name(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)


def _share(runtime: Runtime, value):
    """Process 0's `value` on every process (the cache decisions: only process 0 reads the cache)."""
    if runtime.processes == 1:
        return value
    from accelerate.utils import broadcast_object_list

    return broadcast_object_list([value], from_process=0)[0]


def run_suite(
    models: list[ModelRef],
    suite: Suite,
    manager: TaskManager,
    prepared: dict[str, dict],
    runtime: Runtime,
    *,
    cache_dir: Path | None = None,
    samples_dir: Path | None = None,
    log: Callable[[str], None] = lambda message: print(message, file=sys.stderr),
) -> list[ModelResults]:
    """Score every model on every suite task; a model whose tasks are all cached is not loaded.
    `samples_dir`: write each model's per-item samples to samples_dir/<label>/<task>.jsonl.
    On the processes other than 0 of a multi-process run, returns an empty list."""
    main = runtime.rank == 0
    if not main:
        log = lambda message: None  # process 0 speaks for all
    hashes = FileHashes(cache_dir / FILE_HASHES if cache_dir is not None else None)
    tasks = {}
    if main and cache_dir is not None:
        tasks = {task.task: task_identity(task, prepared[task.task], hashes) for task in suite.tasks}
        hashes.save()
    everything = []
    for ref in models:
        results = ModelResults(ref, "")
        keys, found = {}, {}
        # A rolling window is already max_length tokens: batching them only multiplies the
        # logits' memory (8 x 8192 x 49152 floats for SmolLM2 is 13 GB).
        batch_sizes = {
            task.task: 1
            if any(
                config.get("output_type") == "loglikelihood_rolling"
                for config in prepared[task.task]["configs"].values()
            )
            else runtime.batch_size
            for task in suite.tasks
        }
        if main:
            log(f"hashing {ref.path}")
            results.fingerprint = fingerprint(ref.path)
            if cache_dir is not None:
                classes = [model_class(ref.path)]
                if runtime.backend == "vllm":  # the code that runs the weights is the vLLM model's
                    from ladder.serving.model import LadderLlamaForCausalLM as VLLMLadderLlama

                    classes.append(VLLMLadderLlama)
                model = {"weights": results.fingerprint, "code": code_digest(classes)}
                for task in suite.tasks:
                    keys[task.task] = cache_key(model, tasks[task.task], runtime, batch_sizes[task.task])
                    if (hit := _read_cache(cache_dir / f"{keys[task.task]}.json")) is not None:
                        found[task.task] = hit
                        results.cached.append(task.task)
        cached = _share(runtime, list(found))
        missing = [task for task in suite.tasks if task.task not in cached]
        if missing:
            log(
                f"loading {ref.label} ({runtime.dtype} on {runtime.describe()['device']}, {runtime.processes} process(es))"
            )
            lm = load_lm(ref, runtime)
            for task in missing:
                items = "all items" if task.limit is None else f"at most {task.limit} items"
                items += f", one in {task.every}" if task.every > 1 else ""
                log(f"scoring {ref.label} on {task.task} ({items})")
                lm.batch_size_per_gpu = batch_sizes[task.task]
                started = time.monotonic()
                scored = evaluate_task(lm, task, manager, prepared[task.task]["sizes"], runtime)
                log(f"scored {ref.label} on {task.task} in {time.monotonic() - started:.0f} s")
                if scored is not None:
                    found[task.task] = scored
                    if cache_dir is not None:
                        _write_cache(cache_dir / f"{keys[task.task]}.json", *scored)
            del lm
            gc.collect()
        if not main:
            continue
        if results.cached:
            log(f"{ref.label}: cached results for {', '.join(results.cached)}")
        for task in suite.tasks:  # suite order
            record, samples = found[task.task]
            record["aggregations"] = prepared[task.task]["aggregations"]
            results.tasks[task.task] = record
            if samples_dir is not None:
                write_samples(samples_dir / _file_name(ref.label), samples)
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
        # Per suite task: they may differ between tasks, unlike the rest of lm-eval's `config`.
        "chat_options": {task: record.get("config", {}).get("chat") for task, record in results.tasks.items()},
    }
    return merged
