"""Cache identity: a (model, suite task) score is reused only when nothing that made it changed: the
weights, the code that runs and scores them (hashed from source, not a number bumped by hand), the
task with its code and data, the library versions and the run's numerics (`cache_key`). An entry
whose content does not match the digest it carries is a miss, said in one line.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import importlib
import inspect
import json
import zlib
from collections.abc import Callable
from pathlib import Path

import lm_eval
import torch
import transformers

from ladder.io.files import atomic_write, file_identity, sha256_file
from ladder.io.loading import load_config

from .runtime import DEFAULT_BACKEND, Runtime
from .suite import SuiteTask

# What `ladder convert` and `ladder adapt` write beside a model to say how it was made (with times).
PROVENANCE_FILES = ("conversion.json", "recipe.yaml")
# The packages whose every module is on the scoring path (a backend's engine code outside them is
# keyed by its model classes' sources, `code_classes`).
SCORING_PACKAGES = ("ladder.eval", "ladder.model", "ladder.io")
DIGEST_KEY = "ladder_content_sha256"
FILE_HASHES = "file-hashes.json"


def fingerprint(path: Path, hashes: FileHashes) -> str:
    """SHA-256 over a GGUF file, or a checkpoint folder's top-level files but its docs and provenance
    records (converting the same weights again hits the cache)."""
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    digest = hashlib.sha256()
    for file in files:
        if file != path and (file.name.startswith(".") or file.suffix == ".md" or file.name in PROVENANCE_FILES):
            continue
        digest.update(f"{file.name}\0{hashes.digest(file)}\n".encode())
    return digest.hexdigest()


def model_class(path: Path) -> type:
    """The installed class that will run a model's weights (never the code copy in a checkpoint)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM._model_mapping[type(load_config(path))]


def code_digest(classes: list[type]) -> str:
    """SHA-256 over the modules that define `classes` and their bases (torch's version is in the key)."""
    files = {}
    for cls in classes:
        for base in inspect.getmro(cls):
            if base.__module__.split(".")[0] in ("builtins", "torch", "typing"):
                continue
            with contextlib.suppress(TypeError, OSError):
                files[base.__module__] = Path(inspect.getsourcefile(base))
    return _files_digest(files)


def scoring_digest(packages: dict[str, Path] | None = None) -> str:
    """SHA-256 over every Python file of `packages` (default `SCORING_PACKAGES`), each named by its
    place in its package, so that an unchanged copy of the project keys the same."""
    if packages is None:
        packages = {name: Path(importlib.import_module(name).__file__).parent for name in SCORING_PACKAGES}
    return _files_digest(
        {
            f"{name}/{file.relative_to(folder).as_posix()}": file
            for name, folder in packages.items()
            for file in folder.rglob("*.py")
        }
    )


def _files_digest(files: dict[str, Path]) -> str:
    digest = hashlib.sha256()
    for label, file in sorted(files.items()):
        digest.update(f"{label}\0{hashlib.sha256(file.read_bytes()).hexdigest()}\n".encode())
    return digest.hexdigest()


class FileHashes:
    """Content hashes of files (weights, data), remembered by `file_identity` in this process (every
    instance shares the memo) and in a JSON index in the cache, so that a file is hashed once."""

    process: dict[str, list] = {}  # path -> [size, mtime_ns, ctime_ns, inode, sha256]

    def __init__(self, index: Path | None):
        self.index = index
        self.known: dict[str, list] = {}
        if index is not None:
            with contextlib.suppress(OSError, ValueError):
                known = json.loads(index.read_text())
                self.known = known if isinstance(known, dict) else {}
        self.changed = False

    def digest(self, path: Path) -> str:
        name, *identity = file_identity(path)  # [size, mtime_ns, ctime_ns, inode]
        known = [entry for entry in (self.process.get(name), self.known.get(name)) if isinstance(entry, list)]
        entry = next((entry for entry in known if entry[:-1] == identity), None) or [*identity, sha256_file(path)]
        self.process[name] = entry
        if self.known.get(name) != entry:
            self.known[name], self.changed = entry, True
        return entry[-1]

    def save(self) -> None:
        if self.index is not None and self.changed:
            self.index.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(self.index, json.dumps(self.known, indent=0, sort_keys=True))
            self.changed = False


def task_identity(suite_task: SuiteTask, prepared: dict, hashes: FileHashes) -> dict:
    """What defines a suite task's scores apart from the model."""
    # Where the YAML and the data folder sit does not change a score; their content does.
    placed = ("config_source", "data_dir")
    configs = {
        name: {**config, "metadata": {k: v for k, v in config.get("metadata", {}).items() if k not in placed}}
        for name, config in prepared["configs"].items()
    }
    data = {relative: hashes.digest(Path(path)) for relative, path in sorted(prepared["data_files"].items())}
    return {"suite_task": suite_task.model_dump(), "configs": configs, "sources": prepared["sources"], "data": data}


def cache_key(model: dict, task: dict, runtime: Runtime, batch_size: int | str) -> str:
    """The key of one (model, suite task) score; batch size and process count change float sums."""
    identity = {
        "model": model,
        "task": task,
        "versions": {module.__name__: module.__version__ for module in (lm_eval, transformers, torch)},
        "dtype": runtime.dtype,
        "device": "auto" if runtime.parallelize else runtime.device.partition(":")[0],
        "batch_size": batch_size,
        "processes": runtime.processes,
    }
    if runtime.backend != DEFAULT_BACKEND:  # other kernels, other scores
        identity["backend"] = runtime.backend
        # The all-reduces' order, and each engine's batches: float sums in another order.
        identity["parallel"] = [runtime.tensor_parallel, runtime.data_parallel]
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=_stable_repr).encode()).hexdigest()


def _stable_repr(value) -> str:
    """A config value as the same text in every process: a function by its name and source."""
    if callable(value) and hasattr(value, "__qualname__"):
        try:
            source = hashlib.sha256(inspect.getsource(value).encode()).hexdigest()[:16]
        except (OSError, TypeError):
            source = "?"
        # lm-eval names a task folder's module by its file path: the name alone, so that the key
        # does not depend on where the repository sits.
        return f"{value.__module__.rsplit('/', 1)[-1]}.{value.__qualname__}:{source}"
    return str(value)


def read_cache(path: Path, warn: Callable[[str], None]) -> tuple[dict, dict] | None:
    """A cached (record, samples), or None: missing, or, with one line to `warn`, not as written."""
    samples_path = path.with_suffix(".samples.json.gz")
    if not (path.is_file() and samples_path.is_file()):
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        with gzip.open(samples_path, "rt", encoding="utf-8") as handle:
            samples = json.load(handle)
    except (OSError, EOFError, ValueError, zlib.error) as error:  # ValueError: bad JSON or UTF-8
        warn(f"warning: ignoring the unreadable cache entry {path} ({type(error).__name__}); scoring it again")
        return None
    if not (isinstance(record, dict) and isinstance(samples, dict)) or (
        record.pop(DIGEST_KEY, None) != _content_digest(record, samples)
    ):
        warn(f"warning: ignoring the cache entry {path}: its content does not match its digest; scoring it again")
        return None
    return record, samples


def _content_digest(record: dict, samples: dict) -> str:
    return hashlib.sha256(json.dumps([record, samples], sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def write_cache(path: Path, record: dict, samples: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # The samples first: a record without them would not count as cached. atomic_write also removes
    # a killed write's temporaries of the entry (no lock held), never a live run's.
    samples_json = json.dumps(samples, ensure_ascii=False).encode()
    atomic_write(path.with_suffix(".samples.json.gz"), gzip.compress(samples_json, compresslevel=6, mtime=0))
    atomic_write(path, json.dumps({**record, DIGEST_KEY: _content_digest(record, samples)}))
