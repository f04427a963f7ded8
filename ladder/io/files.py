"""Writing outputs so that an interrupted run never leaves something that looks complete: built
under a temporary name beside the final place (locked by `filelock` while the run lives) and renamed
at the end. The final rename never replaces what appeared meanwhile, and `--force` replaces only an
earlier output of the same command.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock, Timeout

from ladder.errors import UsageError
from ladder.log import log

# Every output folder carries this file, naming the command that made it; a run holds a lock on it
# (not a PID: flock works across PID namespaces, and machines on NFSv4, Lustre, GPFS).
OUTPUT_MARKER = ".ladder-output"
_STAGING_MARK = ".tmp-"  # a run's temporary (folder or file), locked while the run lives
_BIRTH_MARK = ".new-"  # the same, for the instant before its lock is taken (then renamed to .tmp-)
_RETIRED_SUFFIX = "-old"  # an existing output set aside while its replacement moves in
# A `.new-` leftover is a run killed between creating its temporary and locking it (microseconds
# apart): cleared once older than this, so that a run being born is never taken for one.
BIRTH_GRACE_SECONDS = 60
# The rename errors that mean "something is at the target".
_TARGET_EXISTS = {errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR}


def _lock(path: Path) -> FileLock | None:
    """An exclusive lock on the file `path`, or None when another process holds it or it is gone."""
    if not path.is_file():
        return None
    lock = FileLock(path, timeout=0, fallback_to_soft=False)
    try:
        lock.acquire()
    except (Timeout, FileNotFoundError):
        return None
    return lock


@contextlib.contextmanager
def _staging(final: Path, directory: bool, command: str | None = None) -> Iterator[Path]:
    """A new temporary `.FINAL.tmp-RANDOM` beside `final` (a folder with its marker, or a file), locked
    before it appears under that name (made and locked as `.new-`, which cleanup leaves alone while
    young) and while the block runs; on an exception it is removed (a full disk: one UsageError line)."""
    token = os.urandom(6).hex()
    birth = final.parent / f".{final.name}{_BIRTH_MARK}{token}"
    if directory:
        birth.mkdir()
        (birth / OUTPUT_MARKER).write_text(json.dumps({"command": command}) + "\n")
    else:
        birth.touch(exist_ok=False)
    with FileLock(birth / OUTPUT_MARKER if directory else birth, timeout=0, fallback_to_soft=False):
        temporary = final.parent / f".{final.name}{_STAGING_MARK}{token}"
        os.rename(birth, temporary)
        try:
            yield temporary
        except BaseException as error:
            _remove(temporary)
            if _disk_full(error):
                raise UsageError(f"no space left on the device while writing {final}") from None
            raise


def _remove(entry: Path) -> None:
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry, ignore_errors=True)
    else:
        entry.unlink(missing_ok=True)


def _remove_stale_temporaries(final: Path, refuse_live: bool = False) -> None:
    """Remove killed runs' temporaries (no lock held); a retired output with no `final` beside it (a
    kill between two renames) goes back into place. `refuse_live`: a live run's folder is refused."""
    now = time.time()
    for leftover in final.parent.glob(f".{final.name}{_BIRTH_MARK}*"):
        with contextlib.suppress(FileNotFoundError):
            if now - leftover.lstat().st_mtime > BIRTH_GRACE_SECONDS:
                _remove(leftover)
    for leftover in sorted(final.parent.glob(f".{final.name}{_STAGING_MARK}*")):
        marker = leftover / OUTPUT_MARKER if leftover.is_dir() else leftover
        if (lock := _lock(marker)) is None and marker.exists():  # a live run's
            if refuse_live and leftover.is_dir() and not leftover.name.endswith(_RETIRED_SUFFIX):
                raise UsageError(f"another run is writing {final} now (its temporary {leftover.name} is locked)")
            continue
        try:
            if leftover.name.endswith(_RETIRED_SUFFIX) and not final.exists():
                os.rename(leftover, final)
                _fsync_directory(final.parent)
            else:
                _remove(leftover)
        finally:
            if lock is not None:
                lock.release()


def _fsync_directory(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _rename_noreplace(source: Path, target: Path) -> None:
    """Rename that never replaces (`FileExistsError`): a file by a hard link, a folder by a rename,
    which refuses a non-empty target."""
    try:
        if source.is_dir():
            if os.path.lexists(target):
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(target))
            os.rename(source, target)
        else:
            os.link(source, target)
            source.unlink()
    except OSError as error:
        if error.errno in _TARGET_EXISTS:
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(target)) from None
        raise


def output_command(path: str | Path) -> str | None:
    try:
        made = json.loads((Path(path) / OUTPUT_MARKER).read_text())
    except (OSError, ValueError):
        return None
    return made.get("command") if isinstance(made, dict) else None


def check_force_target(path: str | Path, command: str | None, force: bool) -> None:
    """Refuse to write over `path` unless `force` and it is an earlier output of `command` (None: any)."""
    path = Path(path).absolute()
    if not os.path.lexists(path):
        return
    if not force:
        raise UsageError(f"output {path} already exists; pass --force to replace it")
    if command is not None and output_command(path) != command:
        raise UsageError(
            f"--force replaces only an earlier output of `ladder {command}`, and {path} is not one "
            f"(no {OUTPUT_MARKER} naming it): delete it yourself or choose another folder"
        )


def lock_output(directory: str | Path, command: str) -> FileLock:
    """Create `directory` if needed and lock its marker for this run: a second run into it is refused
    while this one lives."""
    directory = Path(directory).absolute()
    directory.mkdir(parents=True, exist_ok=True)
    marker = directory / OUTPUT_MARKER
    if output_command(directory) is None:
        marker.write_text(json.dumps({"command": command}) + "\n")
    if (lock := _lock(marker)) is None:
        raise UsageError(f"another run is writing {directory} now (it holds {marker}): wait for it or choose another")
    return lock


def _install(staging: Path, final: Path, force: bool, command: str | None) -> None:
    """Move a complete staging folder into place; with `force` an earlier output of `command` is set
    aside until the new one is in place (after a kill, the next run's cleanup puts it back)."""
    with contextlib.suppress(FileExistsError):
        _rename_noreplace(staging, final)
        return
    kept = final.parent / f"{final.name}.conflict-{os.urandom(3).hex()}"
    try:
        check_force_target(final, command, force)
    except UsageError as error:
        os.rename(staging, kept)
        raise UsageError(f"{error} (it appeared while this run worked; this run's output is kept at {kept})") from None
    old_lock = contextlib.nullcontext()
    if final.is_dir():
        (final / OUTPUT_MARKER).touch()
        old_lock = FileLock(final / OUTPUT_MARKER, fallback_to_soft=False)
    with old_lock:  # waits for a run that still writes into it
        retired = final.parent / f".{final.name}{_STAGING_MARK}{os.urandom(6).hex()}{_RETIRED_SUFFIX}"
        os.rename(final, retired)
        _rename_noreplace(staging, final)
        _remove(retired)


def _disk_full(error: BaseException) -> bool:
    """ENOSPC, also as a library quotes it (safetensors: "(os error 28)")."""
    if isinstance(error, OSError):
        return error.errno == errno.ENOSPC
    return f"(os error {errno.ENOSPC})" in str(error) or os.strerror(errno.ENOSPC) in str(error)


@contextlib.contextmanager
def atomic_directory(final: str | Path, force: bool = False, command: str | None = None) -> Iterator[Path]:
    """A temporary directory beside `final` that becomes it on success, with the marker naming
    `command`. An existing `final` (also one that appears meanwhile) is replaced only under
    `check_force_target`, once the new one is complete; on an exception the temporary is removed,
    after SIGKILL the next run clears it."""
    final = Path(final).absolute()
    check_force_target(final, command, force)
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(final, refuse_live=True)
    with _staging(final, directory=True, command=command) as temporary:
        yield temporary
        _fsync_directory(temporary)
        _install(temporary, final, force, command)
        _fsync_directory(final.parent)


def write_failure(error: BaseException, directory: str | Path) -> str | None:
    """The file system's fault behind `error` in words, or None. Libraries lose the errno (torch.save:
    "unexpected pos"), so a full disk is also recognised by the space left."""
    if _disk_full(error):
        return "no space left on the device"
    with contextlib.suppress(OSError):
        stats = os.statvfs(directory)
        if stats.f_bavail * stats.f_frsize < 1 << 20:
            return "no space left on the device"
    if isinstance(error, OSError):
        return os.strerror(error.errno) if error.errno else str(error)
    return None


def atomic_write(path: str | Path, data: bytes | str, replace: bool = True) -> None:
    """Write a whole file under a locked temporary name, fsync it, then rename it into place.
    `replace` False: a file at `path`, also one that appeared meanwhile, is refused."""
    path = Path(path).absolute()
    if not replace and os.path.lexists(path):
        raise UsageError(f"output {path} already exists; pass --force to replace it")
    _remove_stale_temporaries(path)
    with _staging(path, directory=False) as temporary:
        with open(temporary, "wb") as handle:
            handle.write(data.encode() if isinstance(data, str) else data)
            handle.flush()
            os.fsync(handle.fileno())
        try:
            if replace:
                os.replace(temporary, path)
            else:
                _rename_noreplace(temporary, path)
        except FileExistsError:
            raise UsageError(f"output {path} appeared while this run wrote it (another run?); not replaced") from None


def path_inside(root: str | Path, relative: str, what: str) -> Path:
    """`root / relative`, refused when it would leave `root` (absolute, `..`, or through a symlink)."""
    root = Path(root).absolute()
    parts = Path(relative).parts
    if Path(relative).is_absolute() or ".." in parts or not parts:
        raise UsageError(f"{what}: path {relative!r} leaves the folder {root} (absolute, `..` or empty)")
    target = root.joinpath(*parts)
    if not target.resolve().is_relative_to(root.resolve()):
        raise UsageError(f"{what}: path {relative!r} leaves the folder {root} through a symlink")
    return target


def resolves_inside(path: Path, root: Path) -> bool:
    """Whether `path`, symlinks followed, stays inside `root`; when not, a warning says it is skipped."""
    target = Path(path).resolve()
    if target.is_relative_to(Path(root).resolve()):
        return True
    log.warning(f"warning: skipping {path}: a symlink to {target}, outside {root}")
    return False


def file_identity(path: str | Path) -> tuple[str, int, int, int, int]:
    """What says a file is unchanged: with the ctime, which no call sets back (`os.utime` restores an mtime)."""
    path = Path(path).resolve()
    status = path.stat()
    return str(path), status.st_size, status.st_mtime_ns, status.st_ctime_ns, status.st_ino


def sha256_file(path: str | Path) -> str:
    """Hex SHA-256 of a file, remembered by `file_identity` for the life of the process."""
    return _sha256(file_identity(path))


@functools.cache
def _sha256(identity: tuple) -> str:
    with open(identity[0], "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def ladder_data_dir() -> Path:
    """`$LADDER_DATA`, else `../shared/data` beside a repository checkout."""
    if configured := os.environ.get("LADDER_DATA"):
        return Path(configured).expanduser()
    checkout = Path(__file__).resolve().parents[2]
    beside = checkout.parent / "shared" / "data"
    if (checkout / "setup.cfg").is_file() and beside.is_dir():
        return beside
    raise UsageError("no data folder: set LADDER_DATA to the folder that holds the benchmark and training files")


def ladder_cache_dir() -> Path:
    """The cache root every run shares: `$LADDER_CACHE`, else ladder/ in the user's cache folder."""
    if configured := os.environ.get("LADDER_CACHE"):
        return Path(configured).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "ladder"
