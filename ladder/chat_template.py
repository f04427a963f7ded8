"""Chat templates rendered in a worker process that the operating system bounds. A template is code
that comes with the model: jinja's sandbox stops it reaching Python's internals but not using the
machine up (`'x'.center(2*10**9)`), and counting inside jinja is a race the next filter wins.
`TemplateWorker` renders with transformers' own `render_jinja_template` in a process capped by
`RLIMIT_AS`, for at most MAX_RENDER_SECONDS a chat; past either it fails in one line."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import Any

from jinja2.exceptions import TemplateError

from ladder.errors import UsageError, first_line

# Far above what a chat template needs for one chat (a few kB of markup around its messages); the
# worker's own Python with transformers' template code takes about 200 MB of address space.
MAX_RENDER_BYTES = 1 << 30
MAX_RENDER_SECONDS = 10.0
# The worker's start (Python and transformers' template module): not counted in a chat's time.
START_SECONDS = 120.0

# A short chat that any chat template renders.
PROBE_CHAT = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]


class TemplateLimitExceeded(UsageError):
    """A render went past MAX_RENDER_BYTES or MAX_RENDER_SECONDS (its worker was stopped)."""


class TemplateWorker:
    """Started on the first render, and again after a limit stopped it; `owner` names the template
    in the messages."""

    def __init__(self, owner: str = "the tokenizer") -> None:
        self.owner, self.process = owner, None

    def __enter__(self) -> TemplateWorker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def render(self, template: str, messages: list[dict], **options: Any) -> str:
        """The text `tokenizer.apply_chat_template(messages, tokenize=False, **options)` gives; the
        template's own failure is a TemplateError with its first line."""
        if self.process is None:
            self._start()
        try:
            self.requests.send_bytes(
                json.dumps({"template": template, "messages": messages, "options": options}).encode()
            )
            if not self.replies.poll(self.seconds):
                self.close()
                raise self._limit(f"ran past {self.seconds:g} s on one chat (its time limit)")
            reply = json.loads(self.replies.recv_bytes())
        except (EOFError, OSError):
            reply = {"limit": "memory"}  # the worker died: only a limit ends it
        if "limit" in reply:
            self.close()
            raise self._limit(f"went past {self.memory >> 20:,} MB of memory (its memory limit)")
        if "error" in reply:
            raise TemplateError(reply["error"])
        return reply["text"]

    def _limit(self, what: str) -> TemplateLimitExceeded:
        return TemplateLimitExceeded(f"the chat template of {self.owner} failed on this chat: it {what}")

    def _start(self) -> None:
        self.memory, self.seconds = MAX_RENDER_BYTES, MAX_RENDER_SECONDS
        self.process = subprocess.Popen(
            [sys.executable, "-c", f"from ladder.chat_template import serve; serve({self.memory})"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # a dying interpreter's last words are not the user's line
        )
        self.requests = Connection(os.dup(self.process.stdin.fileno()), readable=False)
        self.replies = Connection(os.dup(self.process.stdout.fileno()), writable=False)
        if not self.replies.poll(START_SECONDS) or json.loads(self.replies.recv_bytes()) != "ready":
            self.close()
            raise OSError("the chat template worker did not start")

    def close(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            for stream in (self.requests, self.replies, self.process.stdin, self.process.stdout):
                stream.close()
            self.process = None


def serve(memory: int) -> None:
    from transformers.utils.chat_template_utils import render_jinja_template

    requests, replies = Connection(os.dup(0), writable=False), Connection(os.dup(1), readable=False)
    os.dup2(2, 1)  # whatever a library prints stays out of the replies
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    replies.send_bytes(json.dumps("ready").encode())
    while True:
        try:
            request = json.loads(requests.recv_bytes())
        except EOFError:
            return
        try:
            text = render_jinja_template([request["messages"]], chat_template=request["template"], **request["options"])
            reply = json.dumps({"text": text[0][0]})
        except MemoryError:
            reply = json.dumps({"limit": "memory"})
        except Exception as error:  # the template's own failure (raise_exception, a type error, ...)
            reply = json.dumps({"error": first_line(error)})
        replies.send_bytes(reply.encode())
