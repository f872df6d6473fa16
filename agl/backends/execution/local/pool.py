"""The Python harness (``module:function``): a pool of long-lived worker processes
(:mod:`agl.backends.execution.worker`), each running many attempts in one asyncio loop,
supervised: a worker that dies has its attempts reported as exits and is restarted."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from agl.backends.execution.confine import agent_env
from agl.backends.execution.local.config import (
    READY_TIMEOUT_S,
    RESTART_BACKOFF_S,
    LocalExecutorConfig,
)
from agl.backends.execution.local.processes import signal_name, terminate
from agl.backends.execution.worker import READ_LIMIT
from agl.core.contracts.execution import Exit, Key, Launch
from agl.core.processes import die_with_parent

# The package's name, not this module's: the name its log lines carried before the split.
log = logging.getLogger("agl.backends.execution.local")


@dataclass(eq=False)
class _Worker:
    index: int
    log_path: Path
    process: asyncio.subprocess.Process | None = None
    ready: bool = False
    running: set[tuple[str, int]] = field(default_factory=set)
    # What its process was started with (its confinement's uid): held while it runs.
    held: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)


class WorkerPool:
    """``config.workers`` worker processes, each running up to ``config.concurrency``
    attempts; a launch goes to the live worker with the fewest."""

    def __init__(self, config: LocalExecutorConfig) -> None:
        self.config = config
        log_dir = Path(config.run_dir) / "workers"
        self.workers = [
            _Worker(i, log_dir / f"worker-{i}.log") for i in range(max(1, config.workers))
        ]
        self.env = agent_env({}, config.extra_pythonpath, config.pass_env)
        self.exits: list[Exit] = []
        self.supervisors: list[asyncio.Task[None]] = []
        self.closing = False

    @property
    def free_slots(self) -> int:
        if self.closing:
            return 0
        return sum(
            max(0, self.config.concurrency - len(w.running)) for w in self.workers if w.ready
        )

    async def start(self) -> None:
        self.workers[0].log_path.parent.mkdir(parents=True, exist_ok=True)
        results = await asyncio.gather(
            *(self._spawn(w) for w in self.workers), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.close()
            error = errors[0]
            raise error if isinstance(error, ValueError) else ValueError(str(error))
        self.supervisors = [asyncio.create_task(self._supervise(w)) for w in self.workers]

    async def _spawn(self, worker: _Worker) -> None:
        """Start ``worker`` and wait for its handshake; ValueError saying why it failed."""
        argv = [sys.executable, "-m", "agl.backends.execution.worker", self.config.harness]
        argv.append(str(self.config.concurrency))
        worker.held.close()  # the last process's
        start = worker.held.enter_context(self.config.start(argv, self.env))
        with open(worker.log_path, "ab") as log_file:  # the child keeps its own copy
            process = await asyncio.create_subprocess_exec(
                *start.argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=log_file,
                limit=READ_LIMIT,
                **{"start_new_session": True, "preexec_fn": die_with_parent(), **start.kwargs},
            )
        start.started()
        worker.process = process
        assert process.stdout is not None
        try:
            line = await asyncio.wait_for(process.stdout.readline(), READY_TIMEOUT_S)
        except TimeoutError:
            await terminate(process)
            raise ValueError(
                f"harness {self.config.harness!r}: worker not ready after {READY_TIMEOUT_S:g} s "
                f"(see {worker.log_path})"
            ) from None
        hello: dict[str, Any] = {}
        with contextlib.suppress(orjson.JSONDecodeError):
            hello = orjson.loads(line) if line else {}
        if not hello.get("ready"):
            await terminate(process, grace_s=5.0)
            reason = hello.get("error") or (
                f"harness {self.config.harness!r}: worker exited with code "
                f"{process.returncode} before it was ready (see {worker.log_path})"
            )
            raise ValueError(reason)
        worker.ready = True

    async def _supervise(self, worker: _Worker) -> None:
        """Serve ``worker`` until it dies, report what it held, start a new one; forever."""
        backoff = RESTART_BACKOFF_S[0]
        while True:
            code = await self._serve(worker)
            self._lost(worker, code)
            while True:
                try:
                    await self._spawn(worker)
                    log.info("worker %d restarted", worker.index)
                    backoff = RESTART_BACKOFF_S[0]
                    break
                except (ValueError, OSError) as error:
                    log.error(
                        "worker %d cannot restart (%s); again in %.1f s",
                        worker.index,
                        error,
                        backoff,
                    )
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, RESTART_BACKOFF_S[1])

    async def _serve(self, worker: _Worker) -> int:
        """Collect ``worker``'s replies until its pipe closes; answers its exit code."""
        process = worker.process
        assert process is not None and process.stdout is not None
        while line := await process.stdout.readline():
            try:
                reply = orjson.loads(line)
                key = (reply["rollout_id"], int(reply["attempt"]))
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                log.error("worker %d sent a malformed reply: %.200r", worker.index, line)
                continue
            if key in worker.running:
                worker.running.discard(key)
                self.exits.append(Exit(key[0], key[1], reply.get("error")))
        # No launch may pick this worker from here on (no await before this line).
        worker.ready = False
        await terminate(process, grace_s=0.5)  # reaps it and any group leftovers
        return process.returncode if process.returncode is not None else -1

    def _lost(self, worker: _Worker, code: int) -> None:
        reason = (
            f"worker exited with code {code}"
            if code >= 0
            else f"worker killed by signal {signal_name(-code)}"
        )
        if worker.running:
            log.warning(
                "worker %d: %s, with %d attempts", worker.index, reason, len(worker.running)
            )
        else:
            log.warning("worker %d: %s", worker.index, reason)
        self.exits.extend(Exit(rid, attempt, reason) for rid, attempt in worker.running)
        worker.running.clear()

    async def launch(self, launch: Launch) -> None:
        key = (launch.rollout_id, launch.attempt)
        live = [w for w in self.workers if w.ready]
        if any(key in w.running for w in self.workers):
            return  # launching is idempotent per attempt
        if not live:
            self.exits.append(Exit(*key, "no live worker to run it"))
            return
        worker = min(live, key=lambda w: len(w.running))
        process = worker.process
        assert process is not None and process.stdin is not None
        worker.running.add(key)
        message = {
            "rollout_id": launch.rollout_id,
            "attempt": launch.attempt,
            "timeout_s": launch.timeout_s,
            "env": launch.env,
            "report_key": launch.report_key,
        }
        try:
            process.stdin.write(orjson.dumps(message) + b"\n")
            await process.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the worker is dying: its _serve reports this attempt with the others

    def take_exits(self) -> list[Exit]:
        exits, self.exits = self.exits, []
        return exits

    def running_keys(self) -> set[Key]:
        return set().union(*(w.running for w in self.workers))

    async def stop(self, keys: set[Key]) -> None:
        """Ask each attempt's worker to cancel it; it replies with ``ORPHANED``."""
        for worker in self.workers:
            process = worker.process
            if process is None or process.stdin is None:
                continue
            for rollout_id, attempt in keys & worker.running:
                message = {"stop": True, "rollout_id": rollout_id, "attempt": attempt}
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    process.stdin.write(orjson.dumps(message) + b"\n")
                    await process.stdin.drain()

    async def close(self) -> None:
        self.closing = True
        for task in self.supervisors:
            task.cancel()
        await asyncio.gather(*self.supervisors, return_exceptions=True)
        self.supervisors = []
        processes = [w.process for w in self.workers if w.process is not None]
        for worker in self.workers:
            worker.ready = False
            worker.running.clear()
        for process in processes:
            if process.stdin is not None:
                process.stdin.close()
        await asyncio.gather(*(terminate(p) for p in processes))
        for worker in self.workers:
            worker.held.close()

    def pids(self) -> list[int]:
        return [
            w.process.pid
            for w in self.workers
            if w.process is not None and w.process.returncode is None
        ]
