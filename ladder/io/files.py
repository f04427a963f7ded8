"""Writing outputs so that an interrupted run never leaves something that looks complete.

Every stage writes through these: a directory is built under a temporary name beside its final
place and renamed at the end (rename is atomic within one filesystem); a single file is written
to a temporary name, flushed to disk and renamed over the old one.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from ladder.errors import UsageError

_TEMPORARY_MARK = ".tmp-"
_RETIRED_SUFFIX = "-old"  # an existing output set aside while its replacement moves in


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_temporaries(final: Path) -> None:
    """Temporary siblings left by runs that were killed (their process is gone). A retired output
    (`..-old`) with no `final` beside it means the run died between its two renames: the old
    output goes back into place rather than being deleted with the half-installed new one."""
    prefix = f".{final.name}{_TEMPORARY_MARK}"
    stale = [
        leftover
        for leftover in final.parent.glob(prefix + "*")
        if (pid_text := leftover.name[len(prefix) :].split("-", 1)[0]).isdigit() and not _pid_alive(int(pid_text))
    ]
    for leftover in stale:
        if leftover.name.endswith(_RETIRED_SUFFIX) and not final.exists():
            os.replace(leftover, final)
            _fsync_directory(final.parent)
    for leftover in stale:
        if leftover.exists():
            shutil.rmtree(leftover, ignore_errors=True)


def _fsync_directory(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


@contextlib.contextmanager
def atomic_directory(final: str | Path, force: bool = False) -> Iterator[Path]:
    """Yield an empty temporary directory beside `final`; on success it becomes `final`.

    An existing `final` is refused unless `force`, and is replaced only once the new one is
    complete. On an exception the temporary directory is removed; after SIGKILL it is left under
    a hidden name (`.NAME.tmp-PID-...`) and cleared by the next run, which first puts back an
    old output that a kill left set aside (so no point of the replacement loses both). A full disk becomes a
    `UsageError` that says so.
    """
    final = Path(final).absolute()
    if final.exists() and not force:
        raise UsageError(f"output {final} already exists; pass --force to replace it")
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(final)
    temporary = final.parent / f".{final.name}{_TEMPORARY_MARK}{os.getpid()}-{os.urandom(4).hex()}"
    temporary.mkdir()
    try:
        yield temporary
        _fsync_directory(temporary)
        if final.exists():
            # Keep the old output until the new one is in place, so a failure here loses neither.
            # A kill between the two renames leaves only `retired`: the next run's cleanup puts it back.
            retired = final.parent / f".{final.name}{_TEMPORARY_MARK}{os.getpid()}{_RETIRED_SUFFIX}"
            os.replace(final, retired)
            os.replace(temporary, final)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.replace(temporary, final)
        _fsync_directory(final.parent)
    except OSError as error:
        shutil.rmtree(temporary, ignore_errors=True)
        if error.errno == errno.ENOSPC:
            raise UsageError(f"no space left on the device while writing {final}") from None
        raise
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise


def write_failure(error: BaseException, directory: str | Path) -> str | None:
    """What went wrong, in words, when `error` (raised while writing into `directory`) is the file
    system's doing; None when it is not. Libraries lose the errno on the way: safetensors raises its
    own error, torch.save an "unexpected pos" enforce failure, so a full disk is also recognised by
    the space left (under 1 MiB for an ordinary user) once the write has failed."""
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        return "no space left on the device"
    with contextlib.suppress(OSError):
        stats = os.statvfs(directory)
        if stats.f_bavail * stats.f_frsize < 1 << 20:
            return "no space left on the device"
    if isinstance(error, OSError):
        return os.strerror(error.errno) if error.errno else str(error)
    return None


def atomic_write(path: str | Path, data: bytes | str) -> None:
    """Write a whole file under a temporary name, flush it to disk, then rename it into place."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}{_TEMPORARY_MARK}{os.getpid()}")
    payload = data.encode() if isinstance(data, str) else data
    try:
        with open(temporary, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except OSError as error:
        temporary.unlink(missing_ok=True)
        if error.errno == errno.ENOSPC:
            raise UsageError(f"no space left on the device while writing {path}") from None
        raise


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


__all__ = ["StreamingSha256", "atomic_directory", "atomic_write", "ladder_data_dir", "sha256_file"]
