"""A static file server on 127.0.0.1 and a data manifest that points at it, for `ladder data`'s tests."""

from __future__ import annotations

import functools
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from ladder.io.data_fetch import DataFile


class Server:
    """A static file server on 127.0.0.1 that records the paths it was asked for."""

    def __init__(self, root: Path):
        self.requests: list[str] = []
        server = self

        class Handler(SimpleHTTPRequestHandler):
            def log_message(self, *args):  # quiet; record instead
                server.requests.append(self.path)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(root)))
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def write_manifest(path: Path, entries: list[DataFile]) -> Path:
    lines = ["# a test manifest", "path\tsize\tsha256\turl"]
    lines += [f"{e.path}\t{e.size}\t{e.sha256}\t{e.url}" for e in entries]
    path.write_text("\n".join(lines) + "\n")
    return path
