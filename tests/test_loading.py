"""Opening model paths: checkpoint directories, GGUF files, the embedded default, bad paths."""

import pytest

from ladder.errors import UsageError
from ladder.loading import embedded_model_path, resolve_model_path


def test_empty_path_means_the_embedded_model():
    path = resolve_model_path(None)
    assert path == embedded_model_path() == resolve_model_path("")
    assert path.suffix == ".gguf" and path.stat().st_size > 50_000_000


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: d / "missing", "does not exist"),
        (lambda d: (d / "weights.bin").write_bytes(b"x") and d / "weights.bin", "not a .gguf file"),
        (lambda d: d, "has no config.json"),
    ],
    ids=["missing", "not-gguf", "no-config"],
)
def test_bad_model_paths_are_named(tmp_path, make, message):
    path = make(tmp_path)
    with pytest.raises(UsageError, match=message) as error:
        resolve_model_path(path)
    assert str(path) in str(error.value)
