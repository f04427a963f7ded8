"""The tokenizer files of a checkpoint folder, checked before any command uses or copies them:
convert (which copies them into its output), adapt, eval, sample and serve (through
`ladder.io.loading.check_llama_checkpoint`). A tokenizer.json that is not JSON, whose BPE merges
are malformed, or whose token ids reach past the model's embedding rows used to end in a traceback
deep in transformers or tokenizers, in an index error in the middle of a run, or (convert) in a copy
that verification then passed over with random ids."""

from __future__ import annotations

import json
from pathlib import Path

from ladder.errors import UsageError, first_line

TOKENIZER_JSON = "tokenizer.json"
# The other JSON files of a Hugging Face tokenizer: each must be a JSON object where it is present.
TOKENIZER_CONFIGS = ("tokenizer_config.json", "special_tokens_map.json")


def read_json_object(path: Path, what: str) -> dict:
    """The JSON object in `path`; anything else (unreadable, not JSON, nested past Python's recursion
    limit, a list) is one UsageError line naming the file as `what`."""
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
    """Refuse the tokenizer files of `directory` unless each present one is a JSON object, the
    tokenizers library reads tokenizer.json (its model, merges and added tokens), and every token
    id it holds is below `vocab_size`, the model's embedding rows (None: a config whose vocab_size
    is refused elsewhere)."""
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
    largest = max(vocabulary.values(), default=-1)
    if vocab_size is not None and largest >= vocab_size:
        token = next(token for token, index in vocabulary.items() if index == largest)
        raise UsageError(
            f"tokenizer file {path} gives the token {token[:40]!r} the id {largest}, past the model's "
            f"{vocab_size} embedding rows (config.json vocab_size)"
        )


__all__ = ["check_tokenizer_files", "read_json_object"]
