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


class _Stream(logging.StreamHandler):
    """Writes to whatever sys.stdout or sys.stderr is at the time of the record (a test's capture)."""

    def __init__(self, stream_name: str, level_below: int | None = None):
        super().__init__()
        self.stream_name = stream_name  # not `name`: logging.Handler's own, the handler's registered name
        if level_below is not None:
            self.addFilter(lambda record: record.levelno < level_below)

    @property
    def stream(self):
        return getattr(sys, self.stream_name)

    @stream.setter
    def stream(self, _value) -> None:
        pass


class _Mute(logging.Filter):
    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        # accelerate's adapter prefixes "[RANK n] " where several processes run
        return not _RANK.sub("", str(record.msg), count=1).startswith(self.starts)


_RANK = re.compile(r"^\[RANK \d+\] ")


def configure(verbosity: int = 0) -> None:
    """Verbosity -1 (`-q`), 0 (default), 1 or more (`-v`); safe to call again."""
    if not any(isinstance(handler, _Stream) for handler in log.handlers):
        out = _Stream("stdout", level_below=logging.WARNING)
        err = _Stream("stderr")
        err.setLevel(logging.WARNING)
        log.addHandler(out)
        log.addHandler(err)
        log.propagate = False
        for name, starts in HARMLESS.items():
            logging.getLogger(name).addFilter(_Mute(starts))
    log.setLevel(logging.WARNING if verbosity < 0 else logging.DEBUG if verbosity > 0 else logging.INFO)
    library_level = logging.ERROR if verbosity < 0 else logging.INFO if verbosity > 0 else logging.WARNING
    for library in LIBRARIES:
        logging.getLogger(library).setLevel(library_level)
