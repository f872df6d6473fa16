"""The node's traffic with the API server, each on threads of its own that outlive a
restarting server: ``JobWatcher`` lists and watches the Jobs and hands them on as events;
``StatusWriter`` writes the Jobs' status patches, in order per Job."""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import urllib3
from kubernetes import client as k8s
from kubernetes.client import ApiClient, ApiException
from kubernetes.watch.watch import iter_resp_lines

from agl.testing.k8s.job_status import Manifest, job_name, job_uid

# Named for the package: the name log lines and tests' log captures know it by.
log = logging.getLogger("agl.testing.k8s")

MERGE_PATCH = "application/merge-patch+json"

# What a client sees while the API server restarts or is gone: refused connections, broken
# streams, timeouts. ApiExceptions are told apart by their status where they are caught.
TRANSIENT = (urllib3.exceptions.HTTPError, OSError)


_Patch = tuple[str, str, dict[str, Any]]  # Job name, uid, status


class StatusWriter:
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
        uid = job_uid(job)
        self._lanes[hash(uid) % len(self._lanes)].put((job_name(job), uid, status))

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
            except TRANSIENT as e:
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


class JobWatcher:
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
                    level = logging.INFO if isinstance(e, TRANSIENT) else logging.WARNING
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
