"""A long-lived worker process that runs Python harness attempts for ``LocalExecutor``.

``python -m agl.backends.execution.worker HARNESS CONCURRENCY`` imports ``HARNESS``
(``module:function``, an ``async def function(env: Mapping[str, str]) -> None``) once,
then runs up to ``CONCURRENCY`` attempts at a time in one asyncio loop, so an attempt
costs no interpreter start and no imports.

Protocol (JSON lines, parent ↔ worker). The worker moves the pipes it was started with
(fd 0 and fd 1) to private descriptors before any harness code runs, points fd 0 at
/dev/null and fd 1 at fd 2 (the worker's log file), so whatever a harness prints lands
in the log and can never corrupt the protocol:

- worker → parent, once: ``{"ready": true, "pid": N}`` or ``{"ready": false, "error": "..."}``
  (then the worker exits with code 2);
- parent → worker, per attempt: ``{"rollout_id", "attempt", "timeout_s", "env",
  "report_key"}`` (the report key apart from the harness's ``env``);
- worker → parent, per attempt: ``{"rollout_id", "attempt", "error"}``, ``error`` None when
  the harness returned, else one line: ``"timed out after N s"`` or ``"Type: message"``;
- parent → worker: ``{"stop": true, "rollout_id", "attempt"}`` cancels that attempt; its
  reply's ``error`` says it was stopped (``ORPHANED``);
- EOF on the parent's pipe: the worker cancels what runs and exits 0.

The worker makes one HTTP pool that all its attempts share (``agl.agent.sharing_http``;
a harness gets it from ``agl.agent.shared_http``).

A harness reads its variables from ``env``, not ``os.environ``: attempts share the
process. It must not block the loop (run blocking work with ``asyncio.to_thread``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import inspect
import logging
import os
import re
import sys
import traceback
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import orjson

from agl.agent import holding_report_key, sharing_http, undumpable
from agl.core.contracts.execution import ENV_ATTEMPT, ENV_ROLLOUT, ORPHANED

log = logging.getLogger(__name__)

Harness = Callable[[Mapping[str, str]], Awaitable[object]]

_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
READ_LIMIT = 1 << 26  # one launch line may carry a large input


def split_harness(spec: str) -> tuple[str, str]:
    """``"module:function"`` or ``"python:module:function"`` → (module, function);
    ValueError (one line) when ``spec`` is not of that form."""
    body = spec.removeprefix("python:")
    module, sep, function = body.partition(":")
    if not sep or not _MODULE.match(module) or not _NAME.match(function):
        raise ValueError(
            f"harness {spec!r} is not 'module:function', 'python:module:function' "
            "or 'command:<shell command>'"
        )
    return module, function


def load_harness(spec: str) -> Harness:
    """Import the harness named by ``spec``; ValueError (one line) saying what is wrong."""
    module_name, function_name = split_harness(spec)
    try:
        module = importlib.import_module(module_name)
    except Exception as error:
        raise ValueError(
            f"harness {spec!r}: cannot import module {module_name!r}: {one_line(error)}"
        ) from None
    function = getattr(module, function_name, None)
    if function is None:
        raise ValueError(f"harness {spec!r}: module {module_name!r} has no {function_name!r}")
    if not inspect.iscoroutinefunction(function):
        raise ValueError(
            f"harness {spec!r}: {function_name!r} is not an async function "
            f"(want: async def {function_name}(env: Mapping[str, str]) -> None)"
        )
    return function


def one_line(error: BaseException) -> str:
    """``"Type: first line of the message"``, at most 500 characters."""
    text = str(error).strip().splitlines()
    name = type(error).__name__
    return (f"{name}: {text[0]}" if text else name)[:500]


def _timeout_text(timeout_s: float) -> str:
    return f"timed out after {timeout_s:g} s"


async def run_attempt(
    harness: Harness, env: Mapping[str, str], timeout_s: float | None, report_key: str = ""
) -> str | None:
    """Run one attempt; None when the harness returned, else why it did not (one line).
    ``report_key`` is held for the harness's ``AgentContext.from_env`` (never put in
    ``env``, which the harness hands to its tools).

    Only the worker's own deadline reads as a timeout: a ``TimeoutError`` the harness
    raises itself is reported as the exception it is."""
    deadline = asyncio.timeout(timeout_s)
    held = (
        holding_report_key(env.get(ENV_ROLLOUT, ""), env.get(ENV_ATTEMPT, ""), report_key)
        if report_key
        else contextlib.nullcontext()
    )
    try:
        async with deadline:
            with held:
                await harness(env)
    except TimeoutError as error:
        return _timeout_text(timeout_s or 0) if deadline.expired() else one_line(error)
    except asyncio.CancelledError:
        raise
    except (Exception, SystemExit, KeyboardInterrupt) as error:  # sys.exit() must not end us
        rollout = env.get("AGL_ROLLOUT_ID", "?")
        attempt = env.get("AGL_ATTEMPT", "?")
        tb = "".join(traceback.format_exception(error))
        log.error("rollout %s attempt %s: harness raised\n%s", rollout, attempt, tb.rstrip())
        return one_line(error)
    return None


class _Worker:
    """The worker's loop: read launches, run them as tasks, write one reply each."""

    def __init__(self, harness: Harness, out: asyncio.WriteTransport) -> None:
        self.harness = harness
        self.out = out
        self.tasks: dict[tuple[str, int], asyncio.Task[None]] = {}
        self.stopped: set[tuple[str, int]] = set()

    def send(self, message: dict[str, Any]) -> None:
        # A transport write never blocks; the parent always reads, so the buffer stays small.
        self.out.write(orjson.dumps(message) + b"\n")

    def _forget(self, key: tuple[str, int], _: asyncio.Task[None]) -> None:
        self.tasks.pop(key, None)

    async def attempt(self, message: dict[str, Any]) -> None:
        key = (message["rollout_id"], message["attempt"])
        try:
            error = await run_attempt(
                self.harness,
                message["env"],
                message.get("timeout_s"),
                message.get("report_key") or "",
            )
        except asyncio.CancelledError:
            if key not in self.stopped:
                raise
            self.stopped.discard(key)
            error = ORPHANED
        self.send(
            {"rollout_id": message["rollout_id"], "attempt": message["attempt"], "error": error}
        )

    async def serve(self, reader: asyncio.StreamReader) -> None:
        while line := await reader.readline():
            try:
                message = orjson.loads(line)
            except orjson.JSONDecodeError:
                log.error("ignoring a malformed launch line: %.200r", line)
                continue
            key = (message.get("rollout_id"), message.get("attempt"))
            if message.get("stop"):
                if (task := self.tasks.get(key)) is not None:
                    self.stopped.add(key)
                    task.cancel()
                continue
            task = asyncio.create_task(self.attempt(message))
            self.tasks[key] = task
            task.add_done_callback(functools.partial(self._forget, key))
        # EOF: the parent is gone or closing; nothing we run can be reported any more.
        for task in list(self.tasks.values()):
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)


async def _main(spec: str, concurrency: int, fd_in: int, fd_out: int) -> int:
    loop = asyncio.get_running_loop()
    out, _ = await loop.connect_write_pipe(asyncio.BaseProtocol, os.fdopen(fd_out, "wb", 0))
    reader = asyncio.StreamReader(limit=READ_LIMIT)
    await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd_in, "rb", 0)
    )
    try:
        harness = load_harness(spec)
    except ValueError as error:
        out.write(orjson.dumps({"ready": False, "error": str(error)}) + b"\n")
        log.error("%s", error)
        return 2
    # Made before "ready" so the first attempts do not pay for it.
    async with sharing_http(concurrency):
        worker = _Worker(harness, out)
        worker.send({"ready": True, "pid": os.getpid()})
        log.info("worker %d ready: harness %s, up to %d attempts", os.getpid(), spec, concurrency)
        await worker.serve(reader)
    return 0


def _private_pipes() -> tuple[int, int]:
    """Move the protocol pipes off fd 0/1; fd 0 reads /dev/null, fd 1 writes the log."""
    fd_in, fd_out = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.stdout.flush()
    os.dup2(2, 1)
    return fd_in, fd_out


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or not args[1].isdigit():
        sys.stderr.write("usage: python -m agl.backends.execution.worker HARNESS CONCURRENCY\n")
        raise SystemExit(2)
    undumpable()  # the report keys of the attempts it runs live in its memory
    fd_in, fd_out = _private_pipes()
    # The log is a file: line buffering keeps harness prints in order with our records.
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    raise SystemExit(asyncio.run(_main(args[0], int(args[1]), fd_in, fd_out)))


if __name__ == "__main__":
    main()
