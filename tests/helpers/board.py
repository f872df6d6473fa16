"""A notice board on loopback, for agents that tests confine: where a confined attempt,
which can write nothing the test reads and nothing another attempt reads, leaves a mark
(``PUT /name`` with a body) or looks for one (``GET /name``: 200 and the body, or 404).
Agents on this machine share its network, so the board is the one channel a test opens
to them on purpose."""

from __future__ import annotations

import http.server
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager


class _Handler(http.server.BaseHTTPRequestHandler):
    notes: dict[str, bytes]

    def do_PUT(self) -> None:
        size = int(self.headers.get("Content-Length") or 0)
        self.notes[self.path] = self.rfile.read(size)
        self._answer(204, b"")

    def do_GET(self) -> None:
        note = self.notes.get(self.path)
        self._answer(404, b"") if note is None else self._answer(200, note)

    def _answer(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


@contextmanager
def board() -> Iterator[tuple[str, dict[str, bytes]]]:
    """The board's URL and its notes (path to body), while the block runs."""
    notes: dict[str, bytes] = {}
    handler = type("Handler", (_Handler,), {"notes": notes})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", notes
    finally:
        server.shutdown()
        server.server_close()


def put(url: str, body: bytes = b"") -> None:
    urllib.request.urlopen(urllib.request.Request(url, data=body, method="PUT"), timeout=30)


def wait_for(url: str, timeout_s: float = 120.0) -> bytes:
    """The note at ``url`` once it is there (a guard against a partner that never comes,
    not a measure)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=30) as answer:
                return bytes(answer.read())
        except urllib.error.HTTPError as error:
            if error.code != 404 or time.monotonic() > deadline:
                raise
        time.sleep(0.05)
