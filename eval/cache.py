"""Cache identity: a (model, suite task) score is reused only when nothing that made it changed.

The key (`cache_key`) covers the weights (`fingerprint`), the code that runs them (`code_digest`),
the task (`task_identity`: suite entry, configs, task code, data files' content), the library
versions and the run's numerics. Entries are a JSON record beside its gzipped per-item samples.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import inspect
import json
from pathlib import Path

import lm_eval
import torch
import transformers

from ladder.errors import UsageError, first_line
from ladder.io.files import atomic_write, sha256_file
from ladder.io.loading import from_pretrained_arguments

from .runtime import DEFAULT_BACKEND, Runtime
from .suite import SuiteTask

# What `ladder convert` and `ladder adapt` write beside a model to say how it was made (with times).
PROVENANCE_FILES = ("conversion.json", "recipe.yaml")
# Bump when the cached record's layout or the scoring code changes.
CACHE_FORMAT = 3
# Where the content hashes of data files are remembered, by path, size and mtime (in the cache folder).
FILE_HASHES = "file-hashes.json"


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
        config = AutoConfig.from_pretrained(location, trust_remote_code=False, **extra)
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


def cache_key(model: dict, task: dict, runtime: Runtime, batch_size: int | str) -> str:
    """The key of one (model, suite task) score: `model` (the weights' `fingerprint` and the
    `code_digest` of the class that runs them), `task_identity`, the library versions, and the
    run's numerics: dtype, device class, batch size (padding changes the float sums) and process
    count (so does the batches' composition)."""
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
    if runtime.backend != DEFAULT_BACKEND:  # other kernels, other scores; HF keys stay as they were
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


def read_cache(path: Path) -> tuple[dict, dict] | None:
    """A cached (record, samples), or None when either file is missing or unreadable."""
    try:
        record = json.loads(path.read_text())
        with gzip.open(path.with_suffix(".samples.json.gz"), "rt", encoding="utf-8") as handle:
            return record, json.load(handle)
    except (OSError, EOFError, json.JSONDecodeError):
        return None


def write_cache(path: Path, record: dict, samples: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # The samples first: a record without them would not count as cached.
    samples_json = json.dumps(samples, ensure_ascii=False).encode()
    atomic_write(path.with_suffix(".samples.json.gz"), gzip.compress(samples_json, compresslevel=6, mtime=0))
    atomic_write(path, json.dumps(record))
