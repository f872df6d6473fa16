"""A finished Job's pod logs, read before the Job is deleted (its pods and their logs go
with it). Pure where it can be: the API calls are two, made by ``read_job_logs``.

Invariants:
- every container of every pod of the Job gives one ``AgentLog``, init containers first,
  with how it ended (``reason``), also when its log cannot be read (``note`` says why);
- at most ``max_bytes`` of a log are kept, the end of it (where a failure shows), cut at
  a line, and ``truncated`` says so; the transfer is bounded too (``MAX_LINES``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
import urllib3
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from agl.backends.execution.k8s.api_errors import api_message
from agl.core.contracts.execution import AgentLog

MAX_LINES = 20_000  # the kubelet's tailLines: what is sent at most, whatever the bytes
JOB_NAME_LABEL = "job-name"  # set on a Job's pods by every Kubernetes version


def keep_tail(data: bytes, max_bytes: int, *, more_lines: bool = False) -> tuple[str, bool]:
    """The last ``max_bytes`` of ``data``, from a line's start, as text; and whether
    anything was cut (``more_lines``: the server sent only the last lines)."""
    if len(data) <= max_bytes:
        return data.decode("utf-8", "replace"), more_lines
    tail = data[len(data) - max_bytes :]
    newline = tail.find(b"\n")
    if 0 <= newline < len(tail) - 1:
        tail = tail[newline + 1 :]
    else:  # one line longer than the cap: at least start at a character
        tail = tail.lstrip(bytes(range(0x80, 0xC0)))
    return tail.decode("utf-8", "replace"), True


def container_reason(state: Mapping[str, Any] | None) -> str | None:
    """How a container ended, from its status's ``state``: "Completed, exit code 0",
    "Error, exit code 1", "StartError, exit code 128: ..."; "waiting: ..." or "running"
    when it has not ended; None when the status has no state."""
    if not state:
        return None
    if (done := state.get("terminated")) is not None:
        reason = f"{done.get('reason') or 'Terminated'}, exit code {done.get('exitCode')}"
        message = (done.get("message") or "").strip()
        return f"{reason}: {message}"[:500] if message else reason
    if (waiting := state.get("waiting")) is not None:
        return f"waiting: {waiting.get('reason') or '?'}"
    return "running" if "running" in state else None


def pod_containers(pod: Mapping[str, Any]) -> list[tuple[str, str | None]]:
    """(container, how it ended) for each container of ``pod``, init containers first."""
    spec, status = pod.get("spec") or {}, pod.get("status") or {}
    states = {
        s.get("name"): s.get("state")
        for key in ("initContainerStatuses", "containerStatuses")
        for s in status.get(key) or []
    }
    names = [c["name"] for key in ("initContainers", "containers") for c in spec.get(key) or []]
    return [(name, container_reason(states.get(name))) for name in names]


def pod_reason(pod: Mapping[str, Any]) -> str | None:
    status = pod.get("status") or {}
    if status.get("reason"):
        return f"pod {status['reason']}: {status.get('message') or ''}".rstrip(": ")
    return None


def read_job_logs(
    core: k8s.CoreV1Api, namespace: str, job: str, max_bytes: int
) -> tuple[tuple[AgentLog, ...], int]:
    """Every container's log of the Job's pods, and the API requests it took; one AgentLog
    with a note when there is no pod (deleted already: its log is gone) or the pods
    cannot be listed."""
    requests = 1
    try:
        response = core.list_namespaced_pod(
            namespace, label_selector=f"{JOB_NAME_LABEL}={job}", _preload_content=False
        )
        pods = orjson.loads(response.data).get("items") or []
    except ApiException as error:
        note = f"listing its pods: {api_message(error)}"
        return (AgentLog(f"Job {job}", "", note=note),), requests
    except (urllib3.exceptions.HTTPError, OSError) as error:
        return (AgentLog(f"Job {job}", "", note=f"listing its pods: {error!r}"),), requests
    if not pods:
        return (AgentLog(f"Job {job}", "", note="no pod left: its log went with it"),), requests
    pods.sort(key=lambda p: (p["metadata"].get("creationTimestamp") or "", p["metadata"]["name"]))
    logs = []
    for pod in pods:
        name = pod["metadata"]["name"]
        ended = pod_reason(pod)
        for container, how in pod_containers(pod):
            source = f"pod {name}, container {container}"
            reason = "; ".join(r for r in (how, ended) if r) or None
            requests += 1
            try:
                response = core.read_namespaced_pod_log(
                    name,
                    namespace,
                    container=container,
                    tail_lines=MAX_LINES,
                    _preload_content=False,
                )
                data = response.data
            except ApiException as error:
                logs.append(AgentLog(source, "", reason=reason, note=api_message(error)))
                continue
            except (urllib3.exceptions.HTTPError, OSError) as error:
                logs.append(AgentLog(source, "", reason=reason, note=repr(error)))
                continue
            text, cut = keep_tail(data, max_bytes, more_lines=data.count(b"\n") >= MAX_LINES)
            logs.append(AgentLog(source, text, truncated=cut, reason=reason))
    return tuple(logs), requests
