"""A fake vLLM OpenAI server for call-sequence tests: a real HTTP server on loopback
that answers the routes ``VllmServers`` calls (0.32's names and parameters, dev-mode
ones included) and records every call in order.

It keeps the engine state those routes change, as vLLM 0.32 does: ``/pause`` and
``/sleep`` pause the scheduler, ``/sleep?level>=1`` offloads ``weights`` and
``kv_cache``, ``/wake_up?tags=...`` brings those tags back and resumes the scheduler
once nothing sleeps, ``/resume`` resumes it. It refuses (409) what a sleeping vLLM
cannot do: a weight update (``/collective_rpc``) while the weights are offloaded.
No model, no generation: what it proves is the order of the calls.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

TAGS = ("weights", "kv_cache")


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    params: dict[str, list[str]]  # the query string, as parse_qs reads it
    body: Any = None  # the JSON body, if any

    def __str__(self) -> str:
        """``POST /sleep?level=1&mode=wait``, or ``POST /collective_rpc reload_weights``."""
        query = "&".join(f"{k}={v}" for k, values in self.params.items() for v in values)
        rpc = (
            f" {self.body['method']}"
            if isinstance(self.body, dict) and "method" in self.body
            else ""
        )
        return f"{self.method} {self.path}{'?' + query if query else ''}{rpc}"


@dataclass
class FakeVllm:
    """One replica's state and its recorded calls (``calls``, in arrival order)."""

    model: str
    calls: list[Call] = field(default_factory=list)
    paused: bool = False
    asleep: set[str] = field(default_factory=set)
    url: str = ""  # http://127.0.0.1:<port> once serving
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def sequence(
        self, *, skip: tuple[str, ...] = ("/health", "/v1/models", "/metrics")
    ) -> list[str]:
        """The recorded calls as strings, less the monitoring routes ``skip`` names."""
        with self._lock:
            return [str(c) for c in self.calls if c.path not in skip]

    def clear(self) -> None:
        with self._lock:
            self.calls.clear()

    def answer(self, call: Call) -> tuple[int, Any]:
        """The status and JSON body vLLM would answer; the state changes it makes."""
        with self._lock:
            self.calls.append(call)
            return self._route(call)

    def _route(self, call: Call) -> tuple[int, Any]:
        route = (call.method, call.path)
        if route == ("GET", "/health"):
            return 200, {}
        if route == ("GET", "/v1/models"):
            return 200, {"object": "list", "data": [{"id": self.model, "object": "model"}]}
        if route == ("GET", "/metrics"):
            return 200, ""
        if route == ("GET", "/is_sleeping"):
            return 200, {"is_sleeping": bool(self.asleep) or self.paused}
        if route == ("POST", "/pause"):
            self.paused = True
            return 200, {"status": "paused"}
        if route == ("POST", "/resume"):
            self.paused = False
            return 200, {"status": "resumed"}
        if route == ("POST", "/sleep"):
            level = int(call.params.get("level", ["1"])[0])
            self.paused = True
            if level >= 1:
                self.asleep = set(TAGS)
            return 200, {"status": "sleeping", "level": level}
        if route == ("POST", "/wake_up"):
            tags = call.params.get("tags") or list(TAGS)
            self.asleep -= set(tags)
            if not self.asleep:
                self.paused = False  # vLLM resumes its scheduler once fully awake
            return 200, {"status": "sleeping" if self.asleep else "awake", "tags": tags}
        if route == ("POST", "/collective_rpc"):
            if "weights" in self.asleep:
                return 409, {"error": "the weights are offloaded (asleep): wake them first"}
            return 200, {"results": [None]}
        if route == ("POST", "/reset_prefix_cache"):
            return 200, {"success": True}
        if route == ("POST", "/update_weight_version"):
            return 200, {"status": "ok"}
        return 404, {"error": f"no route {call.method} {call.path}"}


def _handler(fake: FakeVllm) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

        def _serve(self, method: str) -> None:
            parts = urlsplit(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            body = json.loads(raw) if raw else None
            status, payload = fake.answer(Call(method, parts.path, parse_qs(parts.query), body))
            data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # the calls are recorded; stderr stays quiet

    return Handler


@contextmanager
def fake_vllm(model: str) -> Iterator[FakeVllm]:
    """A ``FakeVllm`` serving on a free loopback port until the block ends."""
    fake = FakeVllm(model)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(fake))
    fake.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, name="fake-vllm", daemon=True)
    thread.start()
    try:
        yield fake
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
