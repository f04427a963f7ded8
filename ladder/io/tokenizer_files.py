"""The tokenizer files of a checkpoint folder, checked before any command uses or copies them: a
malformed one, or one whose token ids reach past the embedding rows, otherwise fails deep in a run."""

from __future__ import annotations

import json
from pathlib import Path

from ladder.errors import UsageError, first_line

TOKENIZER_JSON = "tokenizer.json"
# The other JSON files of a Hugging Face tokenizer: each must be a JSON object where it is present.
TOKENIZER_CONFIGS = ("tokenizer_config.json", "special_tokens_map.json")


def read_json_object(path: Path, what: str) -> dict:
    """The JSON object in `path`; anything else is one UsageError line naming the file as `what`."""
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UsageError(f"{what} {path} is not readable JSON: {first_line(error)}") from None
    except RecursionError:
        raise UsageError(f"{what} {path} nests its values too deeply to read") from None
    if not isinstance(value, dict):
        raise UsageError(f"{what} {path} must hold a JSON object, not a {type(value).__name__}")
    return value


def check_tokenizer_files(directory: Path, vocab_size: int | None) -> None:
    """Refuse tokenizer files that are not JSON objects, a tokenizer.json the tokenizers library does
    not read, or a token id at or past `vocab_size` (None: not checked)."""
    for name in TOKENIZER_CONFIGS:
        if (directory / name).is_file():
            read_json_object(directory / name, "tokenizer file")
    path = directory / TOKENIZER_JSON
    if not path.is_file():
        return
    from tokenizers import Tokenizer  # reads the JSON itself: not JSON is one of its errors

    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as error:  # the Rust library raises plain Exception for every malformed part
        raise UsageError(f"tokenizer file {path} is malformed: {first_line(error)}") from None
    vocabulary = tokenizer.get_vocab(with_added_tokens=True)
    token, largest = max(vocabulary.items(), key=lambda item: item[1], default=("", -1))
    if vocab_size is not None and largest >= vocab_size:
        raise UsageError(
            f"tokenizer file {path} gives the token {token[:40]!r} the id {largest}, past the model's "
            f"{vocab_size} embedding rows (config.json vocab_size)"
        )
