"""Cache identity: a (model, suite task) score is reused only when nothing that made it changed.

The key (`cache_key`) covers the weights (`fingerprint`), the code that runs them and scores them
(`code_digest`: the model classes' modules; `scoring_digest`: every module of the packages on the
scoring path, `SCORING_PACKAGES`; computed from their source, not a number bumped by hand), the task
(`task_identity`: suite entry, configs, task code, data files' content), the library versions and
the run's numerics. Entries are a JSON record beside its gzipped per-item samples; an entry that
does not read back as one, or whose content does not match the digest it carries (a flipped byte,
a half-written file, an edited score), is a miss, said in one line.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import importlib
import inspect
import json
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import lm_eval
import torch
import transformers

from ladder.io.files import atomic_write, sha256_file
from ladder.io.loading import load_config

from .runtime import DEFAULT_BACKEND, Runtime
from .suite import SuiteTask

# What `ladder convert` and `ladder adapt` write beside a model to say how it was made (with times).
PROVENANCE_FILES = ("conversion.json", "recipe.yaml")
# The packages whose every module is on the scoring path (import names): this stage's harness,
# task plumbing, backends and scorers, the model classes, and the loading that turns a checkpoint
# or GGUF file into weights. An edit to any of their files changes the key. (A backend's engine
# code outside them is keyed by its model classes' sources, `code_classes`.)
SCORING_PACKAGES = ("ladder.eval", "ladder.model", "ladder.io")
# The key of a cache record that holds the SHA-256 of the record and its samples.
DIGEST_KEY = "ladder_content_sha256"
# Where the content hashes of weights and data files are remembered, by path and file status (in the cache folder).
FILE_HASHES = "file-hashes.json"
# A temporary of a cache write (atomic_write's `.NAME.tmp-...`) older than this is a killed write's:
# writing an entry takes well under a second.
STALE_TEMPORARY_SECONDS = 3600


def fingerprint(path: Path, hashes: FileHashes) -> str:
    """SHA-256 over the files that make the model: a GGUF file, or every top-level file of a
    checkpoint folder (weights, config with the ladder layers, tokenizer, modeling code) but its
    docs and provenance records, so that converting the same weights again hits the cache. Each
    file's hash comes from `hashes`: a file unchanged since is not read again."""
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
        digest.update(f"{file.name}\0{hashes.digest(file)}\n".encode())
    return digest.hexdigest()


def model_class(path: Path) -> type:
    """The class that will run a model's weights: the installed one (ladder's own for a ladder
    checkpoint, not the copy of its code inside the checkpoint; transformers' Llama for a GGUF)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM._model_mapping[type(load_config(path))]


def code_digest(classes: list[type]) -> str:
    """SHA-256 over the source files of the modules that define `classes` and their base classes
    (torch's and Python's own excepted: the torch version is in the key)."""
    files = {}
    for cls in classes:
        for base in inspect.getmro(cls):
            if base.__module__.split(".")[0] in ("builtins", "torch", "typing"):
                continue
            with contextlib.suppress(TypeError, OSError):
                files[base.__module__] = Path(inspect.getsourcefile(base))
    return _files_digest(files)


def scoring_digest(packages: dict[str, Path] | None = None) -> str:
    """SHA-256 over every Python file under each folder of `packages` (import name -> folder;
    default `SCORING_PACKAGES` where they are imported from), each named by its place in its
    package, so that an unchanged copy of the project keys the same and an edited one does not."""
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
    """SHA-256 over (label, content hash) of each file, in label order."""
    digest = hashlib.sha256()
    for label, file in sorted(files.items()):
        digest.update(f"{label}\0{hashlib.sha256(file.read_bytes()).hexdigest()}\n".encode())
    return digest.hexdigest()


class FileHashes:
    """Content hashes of files (weights, data), remembered by path and file status in this process
    (every instance shares the memo) and in a small JSON index (the cache's), so that a large file
    is hashed once and not on every run. The status holds the inode and the ctime besides the size
    and mtime: any write or rename sets the ctime to now, and no call sets it back (`os.utime`
    restores an mtime, not a ctime), so an edit is seen whatever it restores."""

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
        path = path.resolve()
        status = path.stat()
        identity = [status.st_size, status.st_mtime_ns, status.st_ctime_ns, status.st_ino]
        entry = next(
            (
                known
                for known in (self.process.get(str(path)), self.known.get(str(path)))
                if isinstance(known, list) and known[:-1] == identity
            ),
            None,
        ) or [*identity, sha256_file(path)]
        self.process[str(path)] = entry
        if self.known.get(str(path)) != entry:
            self.known[str(path)] = entry
            self.changed = True
        return entry[-1]

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
    return {"suite_task": suite_task.model_dump(), "configs": configs, "sources": prepared["sources"], "data": data}


def cache_key(model: dict, task: dict, runtime: Runtime, batch_size: int | str) -> str:
    """The key of one (model, suite task) score: `model` (the weights' `fingerprint`, the
    `code_digest` of the classes that run them, the `scoring_digest`), `task_identity`, the
    library versions, and the run's numerics: dtype, device class, batch size (padding changes the
    float sums) and process count (so does the batches' composition)."""
    identity = {
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
    if runtime.backend != DEFAULT_BACKEND:  # other kernels, other scores
        identity["backend"] = runtime.backend
        # The all-reduces' order, and each engine's batches: float sums in another order.
        identity["parallel"] = [runtime.tensor_parallel, runtime.data_parallel]
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


def read_cache(path: Path, warn: Callable[[str], None]) -> tuple[dict, dict] | None:
    """A cached (record, samples), or None when either file is missing; None too, with one line to
    `warn`, when they do not read back as the record and samples written (flipped bytes, bad UTF-8,
    another JSON type, an edited score: the record carries the SHA-256 of both, `_content_digest`):
    the entry is scored again and replaced."""
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


def remove_stale_temporaries(cache_dir: Path) -> None:
    """Remove what killed cache writes left: atomic_write temporaries older than an hour (a live
    write's is seconds old, also one of another run that shares the cache)."""
    if not cache_dir.is_dir():
        return
    cutoff = time.time() - STALE_TEMPORARY_SECONDS
    for leftover in cache_dir.glob(".*.tmp-*"):
        with contextlib.suppress(OSError):  # another run may clean it at the same moment
            if leftover.is_file() and leftover.lstat().st_mtime < cutoff:
                leftover.unlink()


def write_cache(path: Path, record: dict, samples: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # The samples first: a record without them would not count as cached.
    samples_json = json.dumps(samples, ensure_ascii=False).encode()
    atomic_write(path.with_suffix(".samples.json.gz"), gzip.compress(samples_json, compresslevel=6, mtime=0))
    atomic_write(path, json.dumps({**record, DIGEST_KEY: _content_digest(record, samples)}))
