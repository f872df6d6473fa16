"""``LogServer``: the kubelet's container-log endpoint, for the node simulator's pods.

The API server answers ``GET /api/v1/namespaces/NS/pods/POD/log?container=C`` by
streaming ``GET http://NODE:PORT/containerLogs/NS/POD/C`` from the pod's node (the
Node's InternalIP and ``status.daemonEndpoints.kubeletEndpoint.port``), as
kube-apiserver does from a kubelet. This server is that endpoint: it serves the bytes a
container wrote, with the kubelet's ``tailLines`` (the last N lines) and ``limitBytes``
(then at most N bytes from the start of those). ``follow`` is not supported: it answers
what there is.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

log = logging.getLogger("agl.testing.k8s")

# (namespace, pod, container) -> the container's output so far; None: no such container
Logs = Callable[[str, str, str], bytes | None]


def select(data: bytes, tail_lines: int | None, limit_bytes: int | None) -> bytes:
    """What the kubelet sends of ``data``: its last ``tail_lines`` lines, then at most
    ``limit_bytes`` of those from their start."""
    if tail_lines is not None:
        lines = data.splitlines(keepends=True)
        data = b"".join(lines[max(len(lines) - tail_lines, 0) :] if tail_lines > 0 else [])
    if limit_bytes is not None:
        data = data[:limit_bytes]
    return data


class LogServer:
    def __init__(self, logs: Logs) -> None:
        self._logs = logs
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="k8s-kubelet", daemon=True
        )

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> LogServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        logs = self._logs

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                url = urlsplit(self.path)
                parts = [unquote(p) for p in url.path.split("/")]
                if len(parts) != 5 or parts[1] != "containerLogs":
                    return self._answer(404, b"not a containerLogs path\n")
                namespace, pod, container = parts[2:]
                data = logs(namespace, pod, container)
                if data is None:
                    return self._answer(404, f"no container {container} in pod {pod}\n".encode())
                query = parse_qs(url.query)
                try:
                    tail, limit = (
                        int(query[k][0]) if k in query else None
                        for k in ("tailLines", "limitBytes")
                    )
                except ValueError:
                    return self._answer(400, b"tailLines and limitBytes take integers\n")
                self._answer(200, select(data, tail, limit))

            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                log.debug("kubelet: " + format, *args)

        return Handler
