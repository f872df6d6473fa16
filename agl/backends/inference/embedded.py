"""The embedded inference server inside the trainer's process: the ``Engine`` and its
OpenAI-compatible app (``server/``) on a uvicorn thread, sharing the trainer's model.

Sharing the module (not a copy) is what makes a weight update free: the trainer changes
the parameters in place while the engine is paused, then bumps ``policy_version``. For
the same reason the trainer never calls the server over HTTP: only the gateway does,
with the run's inference key (``api_key``), which every route but ``/health`` requires.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from contextlib import AbstractContextManager
from typing import Any

import torch
import uvicorn

from agl.backends.inference.engine import Engine, EngineStats
from agl.backends.inference.server.app import create_app

log = logging.getLogger(__name__)


class EmbeddedServer:
    """``model`` served as ``name`` on ``host:port`` (0: a free port) until ``close``.

    ``api_key`` is required on every route but ``/health`` (``Authorization: Bearer``);
    None serves anyone who can connect, so it has no default: the trainer passes its
    run's key (``agl.core.run.build.inference_key``). ``kv_cache_gib`` bounds the engine's
    KV cache (None: unbounded); ``paused()`` frees it while the trainer trains."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        name: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_batch_size: int = 64,
        max_context: int | None = None,
        seed: int = 0,
        num_threads: int | None = None,
        tool_parser: str | None = "hermes",
        api_key: str | None,
        kv_cache_gib: float | None = None,
    ) -> None:
        self.engine = Engine(
            model,
            tokenizer,
            max_batch_size=max_batch_size,
            max_context=max_context,
            seed=seed,
            num_threads=num_threads,
            kv_cache_gib=kv_cache_gib,
        )
        self.name = name
        self.api_key = api_key
        # Bind here, so "port in use" fails at once and port=0 gets a free port.
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._socket.bind((host, port))
        except OSError as error:
            self.engine.close()
            raise OSError(f"cannot serve the model on {host}:{port}: {error.strerror}") from None
        self.host, self.port = self._socket.getsockname()[:2]
        config = uvicorn.Config(
            create_app(self.engine, tokenizer, name, tool_parser, api_key=api_key),
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=2,
            server_header=False,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [self._socket]},
            daemon=True,
            name="agl-inference-http",
        )

    @property
    def url(self) -> str:
        """The OpenAI base URL."""
        return f"http://{self.host}:{self.port}/v1"

    @property
    def endpoints(self) -> list[str]:
        return [self.url]

    @property
    def stats(self) -> EngineStats:
        return self.engine.stats

    def paused(self) -> AbstractContextManager[None]:
        return self.engine.paused()

    def start(self, timeout_s: float = 30.0) -> EmbeddedServer:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the embedded inference server did not start")
            time.sleep(0.01)
        log.info("serving %s on %s", self.name, self.url)
        return self

    def publish(self, policy_version: int) -> None:
        """The weights (changed in place by the trainer) now serve as ``policy_version``."""
        self.engine.update_weights(None, policy_version)

    def close(self) -> None:
        # The engine first: requests still waiting on it are answered (with an error)
        # instead of being cancelled mid-handler by uvicorn's shutdown timeout.
        self.engine.close()
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self._socket.close()
