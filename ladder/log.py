"""What commands say while they run: the `ladder` logger (information to stdout, warnings to stderr),
set by every command's `-q` and `-v`. A command's result goes to stdout with `print`.
"""

from __future__ import annotations

import logging
import re
import sys

log = logging.getLogger("ladder")

# The libraries whose information `-v` shows and `-q` silences (their warnings show by default).
LIBRARIES = ("transformers", "accelerate", "lm-eval", "lm_eval", "peft", "vllm", "datasets", "torch")

# Warnings from libraries that are known to be harmless here, muted at their source by logger and
# message start (never by level, so that their other warnings still show).
HARMLESS = {
    # A ladder model ties lm_head to the embedding: accelerate's save drops the duplicate, and
    # transformers ties it again on load (what the warning asks the user to check).
    "accelerate.utils.other": ("Removed shared tensor",),
}


class _Streams(logging.Handler):
    """Information to stdout, warnings and errors to stderr: whatever sys.stdout and sys.stderr are at
    the time of the record (a test's capture)."""

    def emit(self, record: logging.LogRecord) -> None:
        stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
        try:
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:
            self.handleError(record)


_RANK = re.compile(r"^\[RANK \d+\] ")


def _not_harmless(record: logging.LogRecord) -> bool:
    # accelerate's adapter prefixes "[RANK n] " where several processes run
    return not _RANK.sub("", str(record.msg), count=1).startswith(HARMLESS.get(record.name, ()))


def configure(verbosity: int = 0) -> None:
    """Verbosity -1 (`-q`), 0 (default), 1 or more (`-v`); safe to call again."""
    if not any(isinstance(handler, _Streams) for handler in log.handlers):
        log.addHandler(_Streams())
        log.propagate = False
        for name in HARMLESS:  # a logger's filters see only the records logged on it
            logging.getLogger(name).addFilter(_not_harmless)
    log.setLevel(logging.WARNING if verbosity < 0 else logging.DEBUG if verbosity > 0 else logging.INFO)
    library_level = logging.ERROR if verbosity < 0 else logging.INFO if verbosity > 0 else logging.WARNING
    for library in LIBRARIES:
        logging.getLogger(library).setLevel(library_level)
