"""The objects the executor creates, built from a launch with no API call: the attempt's
Job (the user's template rendered, with what the controller owns set over it; for a
graded task, the harness then the grader), the Secret holding its keys, and the
NetworkPolicy confining agents' egress."""

from __future__ import annotations

import base64
import contextlib
import copy
import functools
import ipaddress
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson
import yaml
from jinja2 import Environment, StrictUndefined, TemplateError

from agl.agent import ENV_GRADED, ENV_WORKSPACE
from agl.backends.execution.k8s.config import EgressConfig, GradingConfig
from agl.backends.execution.k8s.naming import (
    ATTEMPT,
    MANAGED_BY,
    ROLE,
    ROLLOUT,
    ROLLOUT_ID,
    rollout_label,
)
from agl.backends.execution.k8s.pod import PodSettings
from agl.core.contracts.execution import Launch

KEY_ENV = "OPENAI_API_KEY"
SECRET_KEY = "api-key"
# The report key (agl/core/gateway/auth.py) rides in the same Secret; the Job's ``python -m
# agl.agent`` takes it out of its environment before the harness starts.
REPORT_ENV = "AGL_REPORT_KEY"
REPORT_SECRET_KEY = "report-key"
# A graded Job's shared folder (GradingConfig) and its grader's time (agl/grading/__main__.py).
WORKSPACE_VOLUME = "agl-workspace"
GRADE_TIMEOUT_ENV = "AGL_GRADE_TIMEOUT_S"
GRADER_CONTAINER = "grader"

# -- the Job template -----------------------------------------------------------------------


def load_template(template: Any, base_dir: Path | None = None) -> str:
    """The template's text: a mapping is dumped as YAML, a one-line string is a path."""
    if isinstance(template, Mapping):
        return yaml.safe_dump(dict(template), sort_keys=False)
    if not isinstance(template, str) or not template.strip():
        raise ValueError("controller template: give a path, inline YAML or a mapping")
    if "\n" in template:
        return template
    path = Path(template).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    try:
        return path.read_text()
    except OSError as error:
        raise ValueError(f"controller template {template!r}: {error.strerror}") from None


@functools.lru_cache(maxsize=8)
def _compile(text: str) -> Any:
    return Environment(undefined=StrictUndefined, keep_trailing_newline=True).from_string(text)


def render_job(text: str, variables: Mapping[str, Any]) -> dict[str, Any]:
    """The template rendered and parsed; ValueError (one line) if it is not a Job."""
    try:
        rendered = _compile(text).render(**variables)
        job = yaml.safe_load(rendered)
    except (TemplateError, yaml.YAMLError) as error:
        raise ValueError(f"Job template: {str(error).splitlines()[0]}") from None
    if not isinstance(job, dict):
        raise ValueError("Job template: it does not render to a mapping")
    kind = job.setdefault("kind", "Job")
    job.setdefault("apiVersion", "batch/v1")
    if kind != "Job":
        raise ValueError(f"Job template: kind is {kind!r}, not 'Job'")
    containers = (
        job.get("spec", {}).get("template", {}).get("spec", {}).get("containers")
        if isinstance(job.get("spec"), dict)
        else None
    )
    if not isinstance(containers, list) or not containers:
        raise ValueError("Job template: spec.template.spec.containers is empty")
    return job


def _mapping(parent: dict[str, Any], key: str) -> dict[str, Any]:
    value = parent.get(key)
    if not isinstance(value, dict):
        value = parent[key] = {}
    return value


def own_job(
    job: dict[str, Any],
    *,
    name: str,
    namespace: str,
    labels: Mapping[str, str],
    annotations: Mapping[str, str],
    env: Mapping[str, str],
    active_deadline_s: int,
    ttl_after_finished_s: int,
    graded: tuple[str, GradingConfig, float] | None = None,
) -> dict[str, Any]:
    """``job`` with what the controller owns set over the template's values; ``graded``
    (the grader, how, its time): the harness, then the grader (:func:`_stage_grader`)."""
    meta = _mapping(job, "metadata")
    meta.pop("generateName", None)
    meta["name"], meta["namespace"] = name, namespace
    _mapping(meta, "labels").update(labels)
    _mapping(meta, "annotations").update(annotations)
    spec = _mapping(job, "spec")
    spec.update(
        backoffLimit=0,
        completions=1,
        parallelism=1,
        activeDeadlineSeconds=active_deadline_s,
        ttlSecondsAfterFinished=ttl_after_finished_s,
    )
    pod = _mapping(spec, "template")
    pod_meta = _mapping(pod, "metadata")
    _mapping(pod_meta, "labels").update(labels, **{ROLE: "agent"})
    _mapping(pod_meta, "annotations").update(annotations)
    pod_spec = _mapping(pod, "spec")
    pod_spec["restartPolicy"] = "Never"
    pod_spec.setdefault("automountServiceAccountToken", False)
    plain = [{"name": k, "value": v} for k, v in env.items() if k != KEY_ENV]
    if graded is not None:
        _stage_grader(pod_spec, plain, name, *graded)
        return job
    ours = [
        *plain,
        _secret_env(KEY_ENV, name, SECRET_KEY),
        _secret_env(REPORT_ENV, name, REPORT_SECRET_KEY),
    ]
    for container in pod_spec["containers"]:
        if isinstance(container, dict):
            _set_env(container, ours)
    return job


def _secret_env(env_name: str, secret: str, key: str) -> dict[str, Any]:
    return {"name": env_name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def _set_env(container: dict[str, Any], ours: list[dict[str, Any]]) -> None:
    """Ours over the template's: a template's variable of the same name is dropped."""
    names = {e["name"] for e in ours}
    kept = [e for e in container.get("env") or [] if e.get("name") not in names]
    container["env"] = kept + ours


def _stage_grader(
    pod_spec: dict[str, Any],
    plain: list[dict[str, Any]],
    secret: str,
    grader: str,
    grading: GradingConfig,
    timeout_s: float,
) -> None:
    """The template's one container (the harness) becomes the last init container, and a
    copy of it runs the grader once the harness exited 0: a harness that fails fails the
    pod, and nothing of it runs while the grader does. The harness gets the model key
    and no report key; the grader the report key and no model key."""
    containers = pod_spec["containers"]
    if len(containers) != 1 or not isinstance(containers[0], dict):
        raise ValueError(
            "Job template: a graded task's template has one container, its harness "
            "(the grader's container is added after it)"
        )
    harness = containers[0]
    workspace = {"name": ENV_WORKSPACE, "value": grading.workspace}
    second = copy.deepcopy(harness)
    second.pop("args", None)
    second["name"] = GRADER_CONTAINER if harness.get("name") != GRADER_CONTAINER else "agl-grader"
    second["command"] = [*grading.command, grader]
    if grading.image:
        second["image"] = grading.image
    graded = {"name": ENV_GRADED, "value": "1"}  # the harness's finish() posts nothing
    _set_env(harness, [*plain, workspace, graded, _secret_env(KEY_ENV, secret, SECRET_KEY)])
    _set_env(
        second,
        [
            *plain,
            workspace,
            {"name": GRADE_TIMEOUT_ENV, "value": f"{timeout_s:g}"},
            _secret_env(REPORT_ENV, secret, REPORT_SECRET_KEY),
        ],
    )
    mount = {"name": WORKSPACE_VOLUME, "mountPath": grading.workspace}
    harness["volumeMounts"] = [*(harness.get("volumeMounts") or []), mount]
    second["volumeMounts"] = [
        *(second.get("volumeMounts") or []),
        {**mount, "readOnly": True},
        *copy.deepcopy(grading.mounts),
    ]
    pod_spec["initContainers"] = [*(pod_spec.get("initContainers") or []), harness]
    pod_spec["containers"] = [second]
    pod_spec["volumes"] = [
        *(pod_spec.get("volumes") or []),
        {"name": WORKSPACE_VOLUME, "emptyDir": {}},
    ]


def job_manifest(
    template: str,
    name: str,
    launch: Launch,
    *,
    namespace: str,
    labels: Mapping[str, str],
    default_deadline_s: int,
    ttl_after_finished_s: int,
    grader: str | None = None,
    grading: GradingConfig | None = None,
    pod: PodSettings | None = None,
) -> dict[str, Any]:
    """The attempt's Job: ``template`` rendered with the launch's variables, ``pod``'s
    settings set over it, then owned. ``labels`` are the executor's; the rollout's and
    the attempt's are added here. With ``grader``, the grader gets the attempt's time
    anew after the harness, as locally: the Job's deadline is twice it."""
    env = launch.env
    input_value = orjson.loads(env["AGL_INPUT"]) if env.get("AGL_INPUT") else None
    variables = {
        "name": name,
        "namespace": namespace,
        "rollout_id": launch.rollout_id,
        "attempt": launch.attempt,
        "mode": env.get("AGL_MODE", "train"),
        "model": env.get("AGL_MODEL", ""),
        "input": input_value,
        "input_json": env.get("AGL_INPUT", "null"),
    }
    time_s = launch.timeout_s or default_deadline_s
    graded = (grader, grading or GradingConfig(), time_s) if grader else None
    deadline = math.ceil(time_s * (2 if graded else 1))
    job = render_job(template, variables)
    if pod is not None:
        pod.apply(job["spec"]["template"]["spec"], input_value)
    return own_job(
        job,
        name=name,
        namespace=namespace,
        labels={
            **labels,
            ROLLOUT: rollout_label(launch.rollout_id),
            ATTEMPT: str(launch.attempt),
        },
        annotations={ROLLOUT_ID: launch.rollout_id, ATTEMPT: str(launch.attempt)},
        env=env,
        active_deadline_s=max(1, deadline),
        ttl_after_finished_s=ttl_after_finished_s,
        graded=graded,
    )


# -- the Secret ----------------------------------------------------------------------------


def secret_manifest(
    name: str, labels: Mapping[str, str], key: str, report_key: str
) -> dict[str, Any]:
    """The Secret named like the Job, holding the attempt's key and report key; the Job's
    containers read them through ``secretKeyRef`` (:func:`own_job`)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "labels": dict(labels)},
        "type": "Opaque",
        "data": {
            secret_key: base64.b64encode(value.encode()).decode()
            for secret_key, value in ((SECRET_KEY, key), (REPORT_SECRET_KEY, report_key))
        },
    }


# -- the NetworkPolicy ----------------------------------------------------------------------

# The label the API server sets on every Namespace to its name (Kubernetes 1.21 and later).
NAMESPACE_NAME = "kubernetes.io/metadata.name"
_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_SERVICE_HOST = re.compile(rf"{_LABEL}\.({_LABEL})\.svc(\..*)?")


def gateway_namespace(egress: EgressConfig, host: str | None) -> str | None:
    """The gateway's namespace: ``egress.gateway_namespace``, else the one a cluster
    service host names (``agl-gateway.agl.svc[.cluster.local]``), else None (the agents')."""
    if egress.gateway_namespace:
        return egress.gateway_namespace
    match = _SERVICE_HOST.fullmatch(host or "")
    return match[2] if match else None


def egress_policy(
    name: str, namespace: str, pod_labels: Mapping[str, str], egress: EgressConfig, gateway_url: str
) -> dict[str, Any]:
    """Agents may reach the gateway, DNS and ``egress.allow``, nothing else. The gateway's
    pods are selected in its namespace (:func:`gateway_namespace`) when it is not the
    agents'."""
    url = urlsplit(gateway_url) if gateway_url else None
    port = egress.gateway_port or (url.port if url and url.port else None)
    if port is None and url is not None:
        port = 443 if url.scheme == "https" else 80
    ports = [{"protocol": "TCP", "port": port}] if port else []
    to_gateway: list[dict[str, Any]] = []
    host = url.hostname if url else None
    with contextlib.suppress(ValueError, TypeError):
        address = ipaddress.ip_address(host or "")
        to_gateway.append({"ipBlock": {"cidr": f"{address}/{address.max_prefixlen}"}})
    if egress.gateway_pod_labels:
        peer: dict[str, Any] = {"podSelector": {"matchLabels": dict(egress.gateway_pod_labels)}}
        elsewhere = gateway_namespace(egress, host)
        if elsewhere and elsewhere != namespace:
            peer["namespaceSelector"] = {"matchLabels": {NAMESPACE_NAME: elsewhere}}
        to_gateway.append(peer)
    rules: list[dict[str, Any]] = []
    if to_gateway:
        rules.append({"to": to_gateway, **({"ports": ports} if ports else {})})
    if egress.dns:
        rules.append(
            {
                "to": [
                    {
                        "namespaceSelector": {},
                        "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
                    }
                ],
                "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
            }
        )
    for cidr in egress.allow:
        try:
            ipaddress.ip_network(cidr, strict=False)
        except ValueError:
            raise ValueError(f"egress.allow: {cidr!r} is not a CIDR") from None
        rules.append({"to": [{"ipBlock": {"cidr": cidr}}]})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": namespace, "labels": {MANAGED_BY: "agl"}},
        "spec": {
            "podSelector": {"matchLabels": dict(pod_labels)},
            "policyTypes": ["Egress"],
            "egress": rules,
        },
    }
