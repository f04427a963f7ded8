"""Writing outputs so that an interrupted run never leaves something that looks complete.

Every stage writes through these: a directory is built under a temporary name beside its final
place and renamed at the end (rename is atomic within one filesystem); a single file is written
to a temporary name, flushed to disk and renamed over the old one. Two runs never silently share
an output: the final rename cannot replace what appeared meanwhile, a run's temporaries are
locked while it lives, and `--force` replaces only an earlier output of the same command.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from ladder.errors import UsageError
from ladder.log import log

# Every output folder carries this file: which command made it (`--force` replaces only an earlier
# output of the same command). While a run builds the folder it holds an exclusive lock on it, so
# the run's temporaries are recognised as live by that lock, not by a PID: flock works across PID
# namespaces, and across machines on shared filesystems that support locks (NFSv4, Lustre, GPFS).
OUTPUT_MARKER = ".ladder-output"
_STAGING_MARK = ".tmp-"  # a run's temporary (folder or file), locked while the run lives
_BIRTH_MARK = ".new-"  # the same, for the instant before its lock is taken (then renamed to .tmp-)
_RETIRED_SUFFIX = "-old"  # an existing output set aside while its replacement moves in
# A `.new-` leftover is a run killed between creating its temporary and locking it (microseconds
# apart): cleared once older than this, so that a run being born is never taken for one.
BIRTH_GRACE_SECONDS = 60
_AT_FDCWD, _RENAME_NOREPLACE = -100, 1  # renameat2's arguments (linux/fcntl.h, linux/fs.h)
_libc = ctypes.CDLL(None, use_errno=True)  # renameat2 is in glibc >= 2.28; without it, see _rename_noreplace


# The descriptors holding this process's locks. A forked child (a tokenizer worker) closes its copies at
# once: an flock belongs to the open file, so a child left behind by a killed run would keep that run's
# lock, and the resumed run would be refused as "another run is writing".
_HELD_LOCKS: set[int] = set()


def _unlock(descriptor: int) -> None:
    _HELD_LOCKS.discard(descriptor)
    os.close(descriptor)


def _close_inherited_locks() -> None:
    for descriptor in _HELD_LOCKS:
        with contextlib.suppress(OSError):
            os.close(descriptor)
    _HELD_LOCKS.clear()


os.register_at_fork(after_in_child=_close_inherited_locks)


def _lock(path: Path, blocking: bool = False) -> int | None:
    """A descriptor holding an exclusive flock on `path` (released when it is closed, also by a
    kill), or None when another process holds the lock or the file is gone."""
    try:
        descriptor = os.open(path, os.O_RDWR)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except BlockingIOError:
        os.close(descriptor)
        return None
    _HELD_LOCKS.add(descriptor)
    return descriptor


def _born_locked(parent: Path, stem: str, directory: bool, command: str | None = None) -> tuple[Path, int]:
    """A new temporary `parent/.STEM.tmp-RANDOM` (a folder with its marker, or a file), already
    locked when it appears under that name: it is created and locked under a `.new-` name, which
    cleanup leaves alone while young, then renamed."""
    token = os.urandom(6).hex()
    birth = parent / f".{stem}{_BIRTH_MARK}{token}"
    lock_path = birth / OUTPUT_MARKER if directory else birth
    if directory:
        birth.mkdir()
    descriptor = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    fcntl.flock(descriptor, fcntl.LOCK_EX)
    _HELD_LOCKS.add(descriptor)
    if directory:
        os.write(descriptor, json.dumps({"command": command}).encode() + b"\n")
    staging = parent / f".{stem}{_STAGING_MARK}{token}"
    os.rename(birth, staging)
    return staging, descriptor


def _claim_if_stale(entry: Path) -> int | None:
    """Lock a leftover temporary when no live run holds it: the descriptor, or None when it is live.
    A temporary folder without a marker was left by a version before locks: stale."""
    lock_path = entry / OUTPUT_MARKER if entry.is_dir() else entry
    if entry.is_dir() and not lock_path.exists():
        return os.open(entry, os.O_RDONLY)  # nothing to lock: a descriptor only to close
    return _lock(lock_path)


def _remove(entry: Path) -> None:
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry, ignore_errors=True)
    else:
        entry.unlink(missing_ok=True)


def _remove_stale_temporaries(final: Path) -> None:
    """Temporary siblings left by runs that were killed: no process holds their lock. A retired
    output (`..-old`) with no `final` beside it means the run died between its two renames: the old
    output goes back into place rather than being deleted with the half-installed new one."""
    now = time.time()
    for leftover in final.parent.glob(f".{final.name}{_BIRTH_MARK}*"):
        with contextlib.suppress(FileNotFoundError):
            if now - leftover.lstat().st_mtime > BIRTH_GRACE_SECONDS:
                _remove(leftover)
    stale = {}
    for leftover in final.parent.glob(f".{final.name}{_STAGING_MARK}*"):
        if (descriptor := _claim_if_stale(leftover)) is not None:
            stale[leftover] = descriptor
    for leftover in stale:
        if leftover.name.endswith(_RETIRED_SUFFIX) and not final.exists():
            os.rename(leftover, final)
            _fsync_directory(final.parent)
    for leftover, descriptor in stale.items():
        if leftover.exists():
            _remove(leftover)
        _unlock(descriptor)


def _fsync_directory(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _rename_noreplace(source: Path, target: Path) -> None:
    """Rename that never replaces: `FileExistsError` when `target` exists (also when it appeared a
    moment ago). renameat2(RENAME_NOREPLACE) makes the check and the rename one step in the kernel;
    on a filesystem without it, a file is hard-linked (link refuses an existing name, atomically) and
    a folder is checked first (rename itself refuses a non-empty folder)."""
    renameat2 = getattr(_libc, "renameat2", None)
    if renameat2 is not None:
        if renameat2(_AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(target), _RENAME_NOREPLACE) == 0:
            return
        code = ctypes.get_errno()
        if code not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise OSError(code, os.strerror(code), str(target))
    if source.is_dir():
        if os.path.lexists(target):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(target))
        os.rename(source, target)
    else:
        os.link(source, target)
        source.unlink()


def output_command(path: str | Path) -> str | None:
    """The command that made an output folder (its marker), or None when it carries no marker."""
    try:
        made = json.loads((Path(path) / OUTPUT_MARKER).read_text())
    except (OSError, ValueError):
        return None
    return made.get("command") if isinstance(made, dict) else None


def check_force_target(path: str | Path, command: str | None, force: bool) -> None:
    """Refuse, in one line, to write `path` when something is there, unless `force` and it is an
    earlier output of `command` (its marker says so). `command` None: a folder the caller owns
    (a cache, a checkpoint), replaced with `force` whatever it holds."""
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


class OutputLock:
    """An exclusive lock on an output folder for a run's life (`lock_output`); released by `close`,
    or by the process's end, however it ends."""

    def __init__(self, descriptor: int):
        self._descriptor: int | None = descriptor

    def close(self) -> None:
        if self._descriptor is not None:
            _unlock(self._descriptor)
            self._descriptor = None

    def __enter__(self) -> OutputLock:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def lock_output(directory: str | Path, command: str) -> OutputLock:
    """Create `directory` if needed and lock it for this run (its marker file, which names `command`):
    a second run into the same folder is refused in one line while this one lives, wherever it runs."""
    directory = Path(directory).absolute()
    directory.mkdir(parents=True, exist_ok=True)
    marker = directory / OUTPUT_MARKER
    with contextlib.suppress(FileExistsError):
        os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    descriptor = _lock(marker)
    if descriptor is None:
        raise UsageError(f"another run is writing {directory} now (it holds {marker}): wait for it or choose another")
    if output_command(directory) is None:
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, json.dumps({"command": command}).encode() + b"\n", 0)
    return OutputLock(descriptor)


def _check_no_live_staging(final: Path) -> None:
    for leftover in final.parent.glob(f".{final.name}{_STAGING_MARK}*"):
        if leftover.is_dir() and not leftover.name.endswith(_RETIRED_SUFFIX):
            raise UsageError(f"another run is writing {final} now (its temporary {leftover.name} is locked)")


def _install(staging: Path, final: Path, force: bool, command: str | None) -> None:
    """Move a complete staging folder into place. The rename refuses to replace an output that
    appeared while the run worked; with `force`, an earlier output of `command` is replaced, kept
    until the new one is in place (a kill between the two renames leaves only `retired`, locked
    by this run until then: the next run's cleanup puts it back)."""
    try:
        _rename_noreplace(staging, final)
        return
    except FileExistsError:
        pass
    kept = final.parent / f"{final.name}.conflict-{os.urandom(3).hex()}"
    try:
        check_force_target(final, command, force)
    except UsageError as error:
        os.rename(staging, kept)
        raise UsageError(f"{error} (it appeared while this run worked; this run's output is kept at {kept})") from None
    marker = final / OUTPUT_MARKER
    with contextlib.suppress(FileExistsError, NotADirectoryError):
        os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    old_lock = _lock(marker, blocking=True) if final.is_dir() else None
    try:
        retired = final.parent / f".{final.name}{_STAGING_MARK}{os.urandom(6).hex()}{_RETIRED_SUFFIX}"
        os.rename(final, retired)
        _rename_noreplace(staging, final)
        _remove(retired)
    finally:
        if old_lock is not None:
            _unlock(old_lock)


def _disk_full(error: BaseException) -> bool:
    """A full disk, as Python raises it (OSError ENOSPC) or as a library reports it in its own
    exception type (safetensors' SafetensorError quotes the OS error: "(os error 28)")."""
    if isinstance(error, OSError):
        return error.errno == errno.ENOSPC
    return f"(os error {errno.ENOSPC})" in str(error) or os.strerror(errno.ENOSPC) in str(error)


@contextlib.contextmanager
def atomic_directory(final: str | Path, force: bool = False, command: str | None = None) -> Iterator[Path]:
    """Yield a temporary directory beside `final` (empty but for its marker file); on success it
    becomes `final`, carrying the marker `OUTPUT_MARKER` that names `command`.

    An existing `final` is refused unless `force` and it is an earlier output of `command`
    (`check_force_target`; `command` None: any folder), and is replaced only once the new one is
    complete; one that appears while the run works is refused the same way at the end (the rename
    cannot replace) and this run's output is kept beside it. A second run writing `final` while
    this one lives is refused at its start. On an exception the temporary is removed; after
    SIGKILL it is left under a hidden name (`.NAME.tmp-...`), no longer locked, and cleared by
    the next run, which first puts back an old output that a kill left set aside (so no point of
    the replacement loses both). A full disk becomes a `UsageError` that says so.
    """
    final = Path(final).absolute()
    check_force_target(final, command, force)
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(final)
    _check_no_live_staging(final)
    temporary, lock = _born_locked(final.parent, final.name, directory=True, command=command)
    try:
        yield temporary
        _fsync_directory(temporary)
        _install(temporary, final, force, command)
        _fsync_directory(final.parent)
    except BaseException as error:
        _remove(temporary)
        if _disk_full(error):
            raise UsageError(f"no space left on the device while writing {final}") from None
        raise
    finally:
        _unlock(lock)


def write_failure(error: BaseException, directory: str | Path) -> str | None:
    """What went wrong, in words, when `error` (raised while writing into `directory`) is the file
    system's doing; None when it is not. Libraries lose the errno on the way: safetensors raises its
    own error, torch.save an "unexpected pos" enforce failure, so a full disk is also recognised by
    the space left (under 1 MiB for an ordinary user) once the write has failed."""
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
    """Write a whole file under a temporary name (locked while it is written), flush it to disk,
    then rename it into place. `replace` False: a file at `path`, also one that appeared while
    this wrote, is refused in one line (the rename cannot replace). Killed writes' temporaries
    are cleared by the next write of the same path."""
    path = Path(path).absolute()
    if not replace and os.path.lexists(path):
        raise UsageError(f"output {path} already exists; pass --force to replace it")
    payload = data.encode() if isinstance(data, str) else data
    _remove_stale_temporaries(path)
    temporary, descriptor = _born_locked(path.parent, path.name, directory=False)
    try:
        with open(descriptor, "wb", closefd=False) as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        if replace:
            os.replace(temporary, path)
        else:
            _rename_noreplace(temporary, path)
    except FileExistsError:
        temporary.unlink(missing_ok=True)
        raise UsageError(f"output {path} appeared while this run wrote it (another run?); not replaced") from None
    except BaseException as error:
        temporary.unlink(missing_ok=True)
        if _disk_full(error):
            raise UsageError(f"no space left on the device while writing {path}") from None
        raise
    finally:
        _unlock(descriptor)


def path_inside(root: str | Path, relative: str, what: str) -> Path:
    """`root / relative`, refused (one-line `UsageError` naming `what`) when it would leave `root`: an
    absolute path, a `..` part, or a symlink on the way whose target lies outside. Checked before
    anything is read, deleted or written there."""
    root = Path(root).absolute()
    parts = Path(relative).parts
    if Path(relative).is_absolute() or ".." in parts or not parts:
        raise UsageError(f"{what}: path {relative!r} leaves the folder {root} (absolute, `..` or empty)")
    target = root.joinpath(*parts)
    if not target.resolve().is_relative_to(root.resolve()):
        raise UsageError(f"{what}: path {relative!r} leaves the folder {root} through a symlink")
    return target


def resolves_inside(path: Path, root: Path) -> bool:
    """Whether `path`, symlinks followed, stays inside the folder `root`; when it does not, one
    warning line on stderr says it is skipped (an input's symlink may point at any file)."""
    target = Path(path).resolve()
    if target.is_relative_to(Path(root).resolve()):
        return True
    log.warning(f"warning: skipping {path}: a symlink to {target}, outside {root}")
    return False


def sha256_file(path: str | Path, chunk_size: int = 1 << 22, on_chunk: Callable[[int], None] | None = None) -> str:
    """Hex SHA-256 of a file, read in chunks (weight files are many GB). `on_chunk(nbytes)` runs
    after each chunk: a progress bar, or a cancellation check that raises."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_size):
            digest.update(chunk)
            if on_chunk is not None:
                on_chunk(len(chunk))
    return digest.hexdigest()


class StreamingSha256:
    """The SHA-256 of bytes that pass by once (a copy, a streamed read), computed on a worker
    thread while the caller goes on reading and writing: hashlib releases the GIL on large
    buffers, so on two cores hashing overlaps the I/O instead of adding to it. `update(buffer)`
    returns at once; the caller must leave the buffer unchanged until the returned future is done.
    Updates run in the order they were given."""

    def __init__(self) -> None:
        self._digest = hashlib.sha256()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sha256")

    def update(self, buffer: memoryview | bytes) -> Future:
        return self._worker.submit(self._digest.update, buffer)

    def hexdigest(self) -> str:
        """Waits for the pending updates; the object takes no more after this."""
        self._worker.shutdown(wait=True)
        return self._digest.hexdigest()

    def close(self) -> None:
        self._worker.shutdown(wait=True, cancel_futures=True)


def ladder_data_dir() -> Path:
    """The data folder (benchmark and training files): `$LADDER_DATA`, else, when the code runs from
    a repository checkout, `../shared/data` beside it. An installed package has no such neighbour,
    so without `$LADDER_DATA` it is a `UsageError` saying so."""
    configured = os.environ.get("LADDER_DATA")
    if configured:
        return Path(configured).expanduser()
    checkout = Path(__file__).resolve().parents[2]
    beside = checkout.parent / "shared" / "data"
    if (checkout / "setup.cfg").is_file() and beside.is_dir():
        return beside
    raise UsageError("no data folder: set LADDER_DATA to the folder that holds the benchmark and training files")


def ladder_cache_dir() -> Path:
    """The cache root that every run shares, from whatever folder it starts (tokenized training
    data in `adapt/`, eval scores in `eval/`): `$LADDER_CACHE`, else `ladder/` in the user's cache
    folder (`$XDG_CACHE_HOME`, else ~/.cache), as huggingface_hub places `HF_HOME`."""
    configured = os.environ.get("LADDER_CACHE")
    if configured:
        return Path(configured).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "ladder"


__all__ = [
    "OUTPUT_MARKER",
    "OutputLock",
    "StreamingSha256",
    "atomic_directory",
    "atomic_write",
    "check_force_target",
    "ladder_cache_dir",
    "ladder_data_dir",
    "lock_output",
    "output_command",
    "path_inside",
    "resolves_inside",
    "sha256_file",
]
