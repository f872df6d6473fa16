"""``LocalExecutor``: run attempts on this machine (docs/design.md, "Rollout controller").

Two kinds of harness, chosen by the harness string:

- ``module:function`` or ``python:module:function``: an ``async def function(env)``, run
  by a pool of long-lived worker processes (:mod:`agl.backends.execution.worker`), each
  running up to ``concurrency`` attempts in one asyncio loop: an attempt costs no
  interpreter start. A worker that dies has each attempt it held reported as an
  ``Exit`` and is restarted.
- ``command:<shell command>``: one process per attempt (any CLI agent), run by
  ``/bin/sh`` in its own session with the attempt's variables added to the environment;
  its stdout/stderr go to ``run_dir/attempts/<rollout_id>.<attempt>.out|.err``. A shell
  that does not exec its last command reports a signal death as exit code 128+N:
  write ``command:exec ...`` to see "killed by signal NAME".

With a ``grader`` (``module:function``, agl/grading.py; command harnesses only), each
attempt runs in a workspace of its own (``run_dir/workspaces/<rollout_id>.<attempt>``,
its ``AGL_WORKSPACE`` and working folder, removed when the attempt ends) without a report
key, and the grader's verdict on that workspace, posted from here, is its reward.

``extra_pythonpath`` is prepended to ``PYTHONPATH`` for both kinds. With ``confine``, both
kinds run in their own PID and mount namespaces without capabilities, ``run_dir`` (the
gateway's store and admin token, when the gateway's folder is in it) and ``hide`` out of
sight (:mod:`agl.backends.execution.confine`). Neither kind's environment holds the
attempt's report key: a worker gets it on its launch line, a command on the pipe
``AGL_REPORT_FD`` (:mod:`agl.agent`).

Every child runs in its own process group (so a kill takes its children too) and, on
Linux, gets SIGKILL when the thread that started it (the controller's loop) dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import shutil
import signal
import sys
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson

from agl.agent import ENV_GRADED, ENV_REPORT_FD, ENV_WORKSPACE, AgentContext, report_pipe
from agl.backends.execution.confine import confined, unavailable
from agl.backends.execution.worker import READ_LIMIT, one_line, split_harness
from agl.core.contracts.execution import ORPHANED, Exit, Key, Launch
from agl.core.contracts.failures import GRADER_RAISED
from agl.core.run.services import die_with_parent
from agl.grading import Grader, GradeRequest, as_grade, load_grader, post_grade

log = logging.getLogger(__name__)

KILL_GRACE_S = 2.0  # SIGTERM, then SIGKILL this much later
READY_TIMEOUT_S = 60.0  # a worker's import of the harness
RESTART_BACKOFF_S = (0.5, 30.0)  # first and longest wait between failed worker starts
HIDDEN_FROM_AGENTS = frozenset({"AGL_ADMIN_TOKEN"})


@dataclass
class LocalExecutorConfig:
    harness: str  # "module:function" | "python:module:function" | "command:..."
    run_dir: Path
    workers: int = 2
    concurrency: int = 64  # attempts per worker (python harness) or processes in total (command)
    extra_pythonpath: list[str] = field(default_factory=list)
    # Agents in their own PID and mount namespaces without capabilities, ``run_dir`` and
    # ``hide`` out of sight (agl/backends/execution/confine.py): True, False, or "auto"
    # (when this machine allows it; else a warning and unconfined).
    confine: bool | str = False
    hide: list[str] = field(default_factory=list)
    # The task's grader (agl/grading.py), which posts each attempt's reward from here.
    grader: str | None = None

    def __post_init__(self) -> None:
        if self.confine not in (True, False, "auto"):
            raise ValueError(f"confine must be true, false or auto, not {self.confine!r}")
        if self.grader and not self.harness.startswith("command:"):
            raise ValueError(
                f"a grader needs a command: harness (one process per attempt, each with a "
                f"workspace of its own), not {self.harness!r}"
            )

    def wrap(self, argv: list[str], kept: list[Path] | None = None) -> list[str]:
        """``argv`` as the agent's process runs it: confined (``kept``: folders inside the
        hidden ones that stay in sight) or as it is."""
        if not self.confining:
            return argv
        return confined(argv, [Path(self.run_dir), *map(Path, self.hide)], kept or [])

    @property
    def confining(self) -> bool:
        """Whether agents run confined; ValueError if asked for and impossible here."""
        if self.confine is False:
            return False
        reason = unavailable()
        if reason is None:
            return True
        if self.confine is True:
            raise ValueError(f"cannot confine the agents ({reason}); set confine=false")
        _warn_unconfined(reason)
        return False


@functools.cache
def _warn_unconfined(reason: str) -> None:
    log.warning("agents run unconfined: %s (they can read the run's folder)", reason)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


async def _terminate(process: asyncio.subprocess.Process, grace_s: float = KILL_GRACE_S) -> None:
    """SIGTERM the process group, SIGKILL it after ``grace_s``; returns once reaped."""
    if process.returncode is None:
        _signal_group(process.pid, signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(process.wait(), grace_s)
    # The leader may be gone while children it started linger in its group.
    _signal_group(process.pid, signal.SIGKILL)
    await process.wait()


def exit_reason(code: int) -> str | None:
    """A process's return code as an Exit error: None for 0."""
    if code == 0:
        return None
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _base_env(extra_pythonpath: list[str]) -> dict[str, str]:
    """This process's environment for a child, less the admin token: an agent gets only
    its attempt's key (docs/design.md, "Auth")."""
    env = {k: v for k, v in os.environ.items() if k not in HIDDEN_FROM_AGENTS}
    paths = [*extra_pythonpath, *filter(None, [env.get("PYTHONPATH")])]
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


class LocalExecutor:
    """Implements ``agl.core.controller.reconcile.Executor`` with local processes.

    Invariants: every launched attempt yields exactly one ``Exit`` (unless ``close()``
    comes first); a (rollout, attempt) already running is not launched again;
    ``free_slots`` is 0 before ``start()`` and after ``close()``."""

    detached = False  # nothing it starts outlives it

    def __init__(self, config: LocalExecutorConfig) -> None:
        self.config = config
        self._backend: _WorkerPool | _CommandRunner | None = None

    @property
    def free_slots(self) -> int:
        return 0 if self._backend is None else self._backend.free_slots

    async def start(self) -> None:
        """Check the harness and start what runs it; ValueError (one line) if it is bad.
        Idempotent."""
        if self._backend is not None:
            return
        harness = self.config.harness
        self.config.confining  # noqa: B018 - refuses confine=true where it cannot be had
        if harness.startswith("command:"):
            command = harness.removeprefix("command:").strip()
            if not command:
                raise ValueError(f"harness {harness!r}: the command is empty")
            self._backend = _CommandRunner(self.config, command)
        else:
            split_harness(harness)
            pool = _WorkerPool(self.config)
            await pool.start()
            self._backend = pool

    async def launch(self, launch: Launch) -> None:
        if self._backend is None:
            raise RuntimeError("LocalExecutor.launch before start()")
        await self._backend.launch(launch)

    async def exits(self) -> list[Exit]:
        return [] if self._backend is None else self._backend.take_exits()

    def running(self) -> set[Key]:
        return set() if self._backend is None else self._backend.running_keys()

    async def forget(self, rollout_id: str, attempt: int) -> None:
        """Nothing of an attempt outlives its exit here."""

    async def stop(self, keys: set[Key]) -> None:
        if self._backend is not None:
            await self._backend.stop(keys)

    async def close(self) -> None:
        if self._backend is not None:
            await self._backend.close()

    def pids(self) -> list[int]:
        """Live child process ids (workers or attempt processes): for tests and monitoring."""
        return [] if self._backend is None else self._backend.pids()


# -- python harness: a pool of worker processes -----------------------------------------


@dataclass(eq=False)
class _Worker:
    index: int
    log_path: Path
    process: asyncio.subprocess.Process | None = None
    ready: bool = False
    running: set[tuple[str, int]] = field(default_factory=set)


class _WorkerPool:
    def __init__(self, config: LocalExecutorConfig) -> None:
        self.config = config
        log_dir = Path(config.run_dir) / "workers"
        self.workers = [
            _Worker(i, log_dir / f"worker-{i}.log") for i in range(max(1, config.workers))
        ]
        self.env = _base_env(config.extra_pythonpath)
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
        with open(worker.log_path, "ab") as log_file:  # the child keeps its own copy
            process = await asyncio.create_subprocess_exec(
                *self.config.wrap(
                    [
                        sys.executable,
                        "-m",
                        "agl.backends.execution.worker",
                        self.config.harness,
                        str(self.config.concurrency),
                    ]
                ),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=log_file,
                env=self.env,
                start_new_session=True,
                preexec_fn=die_with_parent(),
                limit=READ_LIMIT,
            )
        worker.process = process
        assert process.stdout is not None
        try:
            line = await asyncio.wait_for(process.stdout.readline(), READY_TIMEOUT_S)
        except TimeoutError:
            await _terminate(process)
            raise ValueError(
                f"harness {self.config.harness!r}: worker not ready after {READY_TIMEOUT_S:g} s "
                f"(see {worker.log_path})"
            ) from None
        hello: dict[str, Any] = {}
        with contextlib.suppress(orjson.JSONDecodeError):
            hello = orjson.loads(line) if line else {}
        if not hello.get("ready"):
            await _terminate(process, grace_s=5.0)
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
        await _terminate(process, grace_s=0.5)  # reaps it and any group leftovers
        return process.returncode if process.returncode is not None else -1

    def _lost(self, worker: _Worker, code: int) -> None:
        reason = (
            f"worker exited with code {code}"
            if code >= 0
            else f"worker killed by signal {_signal_name(-code)}"
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
        await asyncio.gather(*(_terminate(p) for p in processes))

    def pids(self) -> list[int]:
        return [
            w.process.pid
            for w in self.workers
            if w.process is not None and w.process.returncode is None
        ]


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


# -- command harness: a process per attempt ---------------------------------------------


class _CommandRunner:
    def __init__(self, config: LocalExecutorConfig, command: str) -> None:
        self.config = config
        self.command = command
        self.grader: Grader | None = load_grader(config.grader) if config.grader else None
        self.attempt_dir = Path(config.run_dir) / "attempts"
        self.attempt_dir.mkdir(parents=True, exist_ok=True)
        self.workspace_dir = Path(config.run_dir) / "workspaces"
        self.env = _base_env(config.extra_pythonpath)
        self.exits: list[Exit] = []
        self.running: dict[tuple[str, int], asyncio.Task[None]] = {}
        self.processes: dict[tuple[str, int], asyncio.subprocess.Process] = {}
        self.stopping: set[Key] = set()
        self.closing = False

    @property
    def free_slots(self) -> int:
        return 0 if self.closing else max(0, self.config.concurrency - len(self.running))

    async def launch(self, launch: Launch) -> None:
        key = (launch.rollout_id, launch.attempt)
        if key in self.running or self.closing:
            return
        task = asyncio.create_task(self._run(launch))
        self.running[key] = task

    async def _run(self, launch: Launch) -> None:
        key = (launch.rollout_id, launch.attempt)
        stem = self.attempt_dir / f"{launch.rollout_id}.{launch.attempt}"
        try:
            error = await self._execute(launch, stem)
        except OSError as failure:
            error = f"cannot start the command: {failure}"
        finally:
            self.running.pop(key, None)
            self.processes.pop(key, None)
        if key in self.stopping:
            self.stopping.discard(key)
            error = ORPHANED
        self.exits.append(Exit(*key, error))

    async def _execute(self, launch: Launch, stem: Path) -> str | None:
        if self.grader is None:
            with report_pipe(launch.report_key) as report_fd:
                env = {**launch.env, ENV_REPORT_FD: str(report_fd)}
                process = await self._spawn(launch, stem, env, pass_fds=(report_fd,))
            return await self._wait(launch, process)
        workspace = self.workspace_dir / stem.name
        workspace.mkdir(parents=True, exist_ok=True)
        try:
            env = {**launch.env, ENV_WORKSPACE: str(workspace), ENV_GRADED: "1"}
            process = await self._spawn(launch, stem, env, cwd=workspace)
            error = await self._wait(launch, process)
            return error if error is not None else await self._grade(launch, workspace)
        finally:
            await asyncio.to_thread(shutil.rmtree, workspace, True)

    async def _spawn(
        self,
        launch: Launch,
        stem: Path,
        env: dict[str, str],
        pass_fds: tuple[int, ...] = (),
        cwd: Path | None = None,
    ) -> asyncio.subprocess.Process:
        with open(f"{stem}.out", "wb") as out, open(f"{stem}.err", "wb") as err:
            process = await asyncio.create_subprocess_exec(
                *self.config.wrap(["/bin/sh", "-c", self.command], [cwd] if cwd else None),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env={**self.env, **env},
                cwd=cwd,
                pass_fds=pass_fds,
                start_new_session=True,
                preexec_fn=die_with_parent(),
            )
        self.processes[(launch.rollout_id, launch.attempt)] = process
        return process

    async def _wait(self, launch: Launch, process: asyncio.subprocess.Process) -> str | None:
        try:
            await asyncio.wait_for(process.wait(), launch.timeout_s)
        except TimeoutError:
            await _terminate(process)
            return f"timed out after {launch.timeout_s:g} s"
        except asyncio.CancelledError:
            await asyncio.shield(_terminate(process))
            raise
        _signal_group(process.pid, signal.SIGKILL)  # an attempt's leftovers end with it
        return exit_reason(process.returncode if process.returncode is not None else -1)

    async def _grade(self, launch: Launch, workspace: Path) -> str | None:
        """Run the grader on what the harness left and post its verdict; None when it is
        posted, else the attempt's error. The grader gets the attempt's timeout anew."""
        assert self.grader is not None
        context = replace(AgentContext.from_env(launch.env), report_key=launch.report_key)
        request = GradeRequest(launch.rollout_id, launch.attempt, context.input, workspace)
        try:
            grade = as_grade(await asyncio.wait_for(self.grader(request), launch.timeout_s))
        except asyncio.CancelledError:
            raise
        except Exception as error:
            timed_out = isinstance(error, TimeoutError)
            text = f"timed out after {launch.timeout_s:g} s" if timed_out else one_line(error)
            log.error(
                "rollout %s attempt %d: the grader raised\n%s",
                launch.rollout_id,
                launch.attempt,
                "".join(traceback.format_exception(error)).rstrip(),
            )
            return f"{GRADER_RAISED}: {text}"
        try:
            await post_grade(context, grade)
        except Exception as error:  # the gateway refused or is gone: not the agent's doing
            return f"cannot report the grade: {one_line(error)}"
        return None

    def take_exits(self) -> list[Exit]:
        exits, self.exits = self.exits, []
        return exits

    def running_keys(self) -> set[Key]:
        return set(self.running)

    async def stop(self, keys: set[Key]) -> None:
        processes = [(k, p) for k, p in self.processes.items() if k in keys]
        self.stopping.update(k for k, _ in processes)
        await asyncio.gather(*(_terminate(p) for _, p in processes))

    async def close(self) -> None:
        self.closing = True
        tasks = list(self.running.values())
        groups = [p.pid for p in self.processes.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for pid in groups:  # in case a cancel landed mid-kill
            _signal_group(pid, signal.SIGKILL)

    def pids(self) -> list[int]:
        return [p.pid for p in self.processes.values() if p.returncode is None]
