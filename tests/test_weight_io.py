"""Weight files read and written (ladder/io/tensors.py) through the safetensors library: headers
and slices as they are, shards written with a cast and an index, and a file's hash computed once
per process."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from ladder.errors import UsageError
from ladder.io import files
from ladder.io.tensors import LazyTensorLoader, ShardedTensorIndex, TensorSpec, cut_into_shards, write_shards


def test_headers_slices_and_shards_round_trip(tmp_path):
    tensors = {
        "weight": torch.randn(7, 5),
        "half": torch.randn(3, 4).to(torch.bfloat16),
        "ids": torch.arange(6),
        "scalar": torch.tensor(2.5),
    }
    source = tmp_path / "source"
    source.mkdir()
    save_file(tensors, source / "model.safetensors")
    index = ShardedTensorIndex.from_directory(source)
    assert {name: (spec.dtype, spec.shape) for name, spec in index.tensors.items()} == {
        "weight": ("float32", (7, 5)),
        "half": ("bfloat16", (3, 4)),
        "ids": ("int64", (6,)),
        "scalar": ("float32", ()),
    }
    with LazyTensorLoader(index) as loader:
        assert torch.equal(loader.read("weight", rows=range(2, 4)), tensors["weight"][2:4])
        assert torch.equal(loader.read("weight", columns=range(1, 3)), tensors["weight"][:, 1:3])

    # Floating tensors cast to float16 as the layout says, cut into shards of at most 64 bytes.
    specs = [
        TensorSpec(n, torch.float16 if t.is_floating_point() else t.dtype, tuple(t.shape)) for n, t in tensors.items()
    ]
    out = tmp_path / "out"
    out.mkdir()
    shards = cut_into_shards(specs, 64)
    write_shards(out, shards, tensors.__getitem__)
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(shards) > 1 and set(weight_map.values()) == {shard.filename for shard in shards}
    written = ShardedTensorIndex.from_directory(out)
    for name, tensor in tensors.items():
        expected = tensor.to(torch.float16) if tensor.is_floating_point() else tensor
        assert torch.equal(load_file(written.shard_of(name).path)[name], expected), name


@pytest.mark.parametrize(
    "header, message",
    [
        (b"not json at all", "invalid JSON in header"),
        (b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', "incomplete metadata"),
        (b'{"w":{"dtype":"F32","shape":[3],"data_offsets":[0,4]}}', "invalid shape"),
    ],
)
def test_a_corrupt_header_is_one_line_naming_the_file(tmp_path, header, message):
    (tmp_path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 4)
    with pytest.raises(UsageError, match=f"model.safetensors is not a valid safetensors file: .*{message}"):
        ShardedTensorIndex.from_directory(tmp_path)


def test_a_file_is_hashed_once_per_process_until_it_changes(tmp_path, monkeypatch):
    path = tmp_path / "weights"
    path.write_bytes(b"abc")
    reads = []
    real_digest = files.hashlib.file_digest
    monkeypatch.setattr(files.hashlib, "file_digest", lambda *args: reads.append(1) or real_digest(*args))
    abc = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert files.sha256_file(path) == files.sha256_file(tmp_path / "." / "weights") == abc
    assert len(reads) == 1
    status = path.stat()
    path.write_bytes(b"abd")  # same size; the mtime put back: the ctime still tells
    os.utime(path, ns=(status.st_atime_ns, status.st_mtime_ns))
    assert files.sha256_file(path) != abc and len(reads) == 2
