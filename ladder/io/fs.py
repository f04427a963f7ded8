"""File-system plumbing for weight files (Linux first, portable fallbacks): copies that read each
byte once and hash it on the way (direct I/O, `copy_file_range`, early write-back), hard links and
reflinks, and the final fsync. `ladder.io.tensors` owns the safetensors format; this module never
parses a file.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import mmap
import os
from collections.abc import Callable
from pathlib import Path

from ladder.errors import UsageError
from ladder.io.files import StreamingSha256

# A copy proceeds (and is hashed) in chunks of this size.
COPY_CHUNK_BYTES = 16 << 20
# Linux's FICLONE ioctl (fcntl.FICLONE from Python 3.12): share the blocks of a file on btrfs/XFS.
FICLONE = getattr(fcntl, "FICLONE", 0x40049409)
# sync_file_range(2)'s "start writing these pages back, do not wait" (Linux; Python has no binding).
SYNC_FILE_RANGE_WRITE = 2
# Direct I/O (Linux; 0 elsewhere, where copies take the other way).
O_DIRECT = getattr(os, "O_DIRECT", 0)
# Errors meaning "this filesystem cannot link, reflink or copy_file_range here".
UNSUPPORTED_LINK_ERRNOS = {
    errno.EOPNOTSUPP,
    errno.ENOTTY,
    errno.EXDEV,
    errno.EINVAL,
    errno.ENOSYS,
    errno.EBADF,
    errno.EPERM,
}


def copy_file(
    source: Path, destination: Path, on_chunk: Callable[[int], None], chunk_bytes: int = COPY_CHUNK_BYTES
) -> str:
    """Copy a file and return its SHA-256, each byte read from the disk once and never copied
    through Python. The source is memory-mapped read-only; a worker thread hashes each chunk from
    the map (`StreamingSha256`) while the same chunk is written with direct I/O (`O_DIRECT`), so
    that the disk takes the bytes from the source's cached pages: no copy into the page cache, and
    no write-back left for the final fsync. Where the filesystem refuses direct I/O (tmpfs before
    Linux 6.6), the kernel copies the chunk (`copy_file_range`) and its write-back starts at once.
    Each chunk is unmapped once written and hashed, so that the RSS holds one chunk per file.
    `on_chunk(nbytes)` reports progress (and may raise to cancel); `chunk_bytes` must be a multiple
    of the page size."""
    digest = StreamingSha256()
    with open(source, "rb") as reader, open(destination, "wb") as writer:
        size = os.fstat(reader.fileno()).st_size
        if size == 0:
            return digest.hexdigest()
        direct = _set_direct(writer.fileno(), True)
        with mmap.mmap(reader.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            mapped.madvise(mmap.MADV_SEQUENTIAL)
            chunks = [memoryview(mapped)[offset : offset + chunk_bytes] for offset in range(0, size, chunk_bytes)]
            try:
                for index, chunk in enumerate(chunks):
                    hashed = digest.update(chunk)  # while the chunk is written
                    offset = index * chunk_bytes
                    if not (direct and _write_direct(writer.fileno(), offset, chunk)):
                        direct = False
                        _write_range(reader, writer, offset, chunk)
                        _start_writeback(writer.fileno(), offset, len(chunk))
                    hashed.result()
                    # Unmap the chunk (its pages stay in the page cache): a mapped page counts in
                    # the process's RSS, which would grow to the file's size.
                    mapped.madvise(mmap.MADV_DONTNEED, offset, len(chunk))
                    on_chunk(len(chunk))
                return digest.hexdigest()
            finally:
                digest.close()  # the worker is done with the map before it closes
                for chunk in chunks:
                    chunk.release()


def _set_direct(descriptor: int, on: bool) -> bool:
    """Turn direct I/O on or off for an open file; False where the filesystem has none."""
    flags = fcntl.fcntl(descriptor, fcntl.F_GETFL)
    try:
        fcntl.fcntl(descriptor, fcntl.F_SETFL, flags | O_DIRECT if on else flags & ~O_DIRECT)
    except OSError as error:
        if error.errno != errno.EINVAL:
            raise
        return False
    return on and O_DIRECT != 0


def _write_direct(descriptor: int, offset: int, chunk: memoryview) -> bool:
    """Write a chunk with direct I/O, which moves whole blocks from page-aligned memory: its whole
    pages, then (buffered) the part of the file's last page. False, with nothing written and direct
    I/O turned off, where the filesystem took the flag but refuses the write."""
    aligned = len(chunk) - len(chunk) % mmap.PAGESIZE
    done = 0
    try:
        while done < aligned:
            done += os.pwrite(descriptor, chunk[done:aligned], offset + done)
    except OSError as error:
        if error.errno != errno.EINVAL or done:
            raise
        _set_direct(descriptor, False)
        return False
    if aligned < len(chunk):
        _set_direct(descriptor, False)
        os.pwrite(descriptor, chunk[aligned:], offset + aligned)
    return True


@functools.cache
def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    try:
        import ctypes

        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # not Linux
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return function


def _start_writeback(descriptor: int, offset: int, nbytes: int) -> None:
    """Have the kernel start writing a copied chunk to the disk now, without waiting for it. Left to
    itself it holds gigabytes of dirty pages until the final fsync, so the disk idles while the
    copy is hashed and then works alone; this way the writes overlap the hashing."""
    if (sync_file_range := _sync_file_range()) is not None:
        sync_file_range(descriptor, offset, nbytes, SYNC_FILE_RANGE_WRITE)  # advisory: a failure changes nothing


def _write_range(reader, writer, offset: int, chunk: memoryview) -> None:
    """Bytes [offset, offset + len(chunk)) of `reader` into `writer` at the same offset: the kernel
    copies them where it can, else they are written from the map."""
    done = 0
    try:
        while done < len(chunk):
            step = os.copy_file_range(reader.fileno(), writer.fileno(), len(chunk) - done, offset + done, offset + done)
            if step == 0:
                raise UsageError(f"{reader.name} became shorter while it was being copied")
            done += step
    except OSError as error:
        if error.errno not in UNSUPPORTED_LINK_ERRNOS:
            raise
        os.pwrite(writer.fileno(), chunk[done:], offset + done)


def link_file(source: Path, destination: Path, kind: str) -> None:
    """`destination` as a hard link to `source` (`kind` "link": one file under two names) or a
    reflink ("reflink": a copy that shares the source's blocks until either is written; btrfs,
    XFS). Raises OSError where the filesystem cannot (EXDEV between filesystems, EOPNOTSUPP)."""
    if kind == "link":
        os.link(source, destination)
        return
    with open(source, "rb") as reader, open(destination, "wb") as writer:
        fcntl.ioctl(writer.fileno(), FICLONE, reader.fileno())


def flush_to_disk(directory: Path) -> None:
    """fsync every file once at the end (not each as it is written, which would make the writes
    wait for the disk one file at a time), before the directory is renamed into place."""
    for path in directory.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
