"""Weight files read, written and copied (ladder/io/tensors.py, fs.py): the tensor IO against the
safetensors library, and the one-pass hashing copy in each way a filesystem allows it."""

from __future__ import annotations

import errno
import fcntl
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from ladder.io import fs as fs_io
from ladder.io.files import sha256_file
from ladder.io.fs import copy_file
from ladder.io.tensors import SafetensorsWriter, TensorSpec, read_chunks, read_shard


def test_tensor_io_round_trip_against_the_safetensors_library(tmp_path):
    tensors = {
        "weight": torch.randn(7, 5),
        "half": torch.randn(3, 4).to(torch.bfloat16),
        "ids": torch.arange(6),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
    }
    save_file(tensors, tmp_path / "library.safetensors")
    shard = read_shard(tmp_path / "library.safetensors")
    assert {spec.name for spec in shard.tensors} == set(tensors)
    seen = bytearray()
    blocks: dict[str, list[torch.Tensor]] = {}
    for spec, block in read_chunks(shard, seen.extend, chunk_bytes=20):  # a few rows at a time
        blocks.setdefault(spec.name, []).append(block.clone())  # blocks share one buffer
    assert bytes(seen) == (tmp_path / "library.safetensors").read_bytes()
    for name, tensor in tensors.items():
        rebuilt = torch.cat(blocks[name]) if tensor.dim() else blocks[name][0]
        assert rebuilt.dtype == tensor.dtype and torch.equal(rebuilt, tensor), name
        assert len(blocks[name]) > 1 or tensor.numel() * tensor.element_size() <= 20 or tensor.dim() == 0

    # Written back in pieces, floating tensors cast to float16 by the writer.
    as_float16 = {name: t.to(torch.float16) if t.is_floating_point() else t for name, t in tensors.items()}
    writer = SafetensorsWriter(
        tmp_path / "ours.safetensors", [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in as_float16.items()]
    )
    for name, tensor in tensors.items():
        if tensor.dim() and len(tensor) > 1:
            writer.write(name, tensor[:1])
            writer.write(name, tensor[1:])
        else:
            writer.write(name, tensor)
    writer.close()
    written = load_file(tmp_path / "ours.safetensors")
    assert all(torch.equal(written[name], tensor) for name, tensor in as_float16.items())


def _refuse(errno_: int, what: str):
    def refuse(*args, **kwargs):
        raise OSError(errno_, what)

    return refuse


COPY_WAYS = {
    # where the filesystem has direct I/O (ext4, XFS, btrfs): whole pages straight from the map
    "direct": lambda patch, writes: None,
    # it takes the O_DIRECT flag but refuses the write (some FUSE filesystems)
    "direct-refused": lambda patch, writes: writes.append("refuse direct"),
    # no direct I/O (tmpfs before Linux 6.6, not Linux): the kernel copies (copy_file_range)
    "kernel-copy": lambda patch, writes: patch.setattr(fs_io, "O_DIRECT", 0),
    # nor copy_file_range between the two files (EXDEV, as between some filesystems): written from the map
    "written-from-map": lambda patch, writes: (
        patch.setattr(fs_io, "O_DIRECT", 0),
        patch.setattr(os, "copy_file_range", _refuse(18, "cross-device")),
    ),
}


@pytest.mark.parametrize("way", list(COPY_WAYS))
def test_copy_file_hashes_what_it_copies_in_one_pass(tmp_path, monkeypatch, way):
    source = tmp_path / "source"
    source.write_bytes(os.urandom((3 << 20) + 12345))  # 13 chunks of 256 KiB, the last not whole pages
    writes, pwrite = [], os.pwrite

    def recorded_pwrite(descriptor, data, offset):
        direct = bool(fcntl.fcntl(descriptor, fcntl.F_GETFL) & fs_io.O_DIRECT)
        if direct and "refuse direct" in writes:
            raise OSError(errno.EINVAL, "Invalid argument")
        writes.append((direct, len(data)))
        return pwrite(descriptor, data, offset)

    monkeypatch.setattr(os, "pwrite", recorded_pwrite)
    COPY_WAYS[way](monkeypatch, writes)
    progress = []
    digest = copy_file(source, tmp_path / "copy", progress.append, chunk_bytes=1 << 18)
    assert (tmp_path / "copy").read_bytes() == source.read_bytes()
    assert digest == sha256_file(source) and sum(progress) == source.stat().st_size and len(progress) == 13
    written = [write for write in writes if write != "refuse direct"]
    if way == "direct":
        # whole pages direct, the last page's part buffered
        assert written[:-1] == [(True, 1 << 18)] * 12 + [(True, 12288)] and written[-1] == (False, 57)
    else:
        assert not any(direct for direct, _ in written)
        # the kernel copies unless it cannot; then every byte is written from the map
        assert sum(size for _, size in written) == (source.stat().st_size if way == "written-from-map" else 0)
    (tmp_path / "empty").write_bytes(b"")
    assert copy_file(tmp_path / "empty", tmp_path / "empty-copy", progress.append) == sha256_file(tmp_path / "empty")
