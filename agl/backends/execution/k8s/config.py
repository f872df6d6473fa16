"""The settings of ``K8sExecutor`` (``controller=k8s``), checked as they are made; no
Kubernetes client needed to read them."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from agl.backends.execution.k8s.pod import PodSettings


@dataclass
class EgressConfig:
    """The NetworkPolicy that confines agents' egress to the gateway, DNS and ``allow``."""

    enabled: bool = True
    gateway_pod_labels: dict[str, str] = field(
        default_factory=lambda: {"app.kubernetes.io/name": "agl-gateway"}
    )
    gateway_port: int | None = None  # None: the port of the agent-facing gateway URL
    # The gateway's namespace when agents run in another (deploy/k8s: agl-agents, the
    # gateway in agl); None: the one its URL names (``<service>.<namespace>.svc``), if any,
    # else the agents' own.
    gateway_namespace: str | None = None
    dns: bool = True
    allow: list[str] = field(default_factory=list)  # CIDRs agents may also reach


@dataclass
class GradingConfig:
    """How a graded task's Job is shaped (agl/grading/): the template's one container, the
    harness, becomes the pod's last init container, and the grader runs after it in a copy
    of that container (same image unless ``image``, same mounts, working folder and
    security context) with ``command`` plus the grader's ``module:function``. The two
    share the attempt's workspace, an emptyDir at ``workspace`` (read-only for the
    grader); only the grader holds the report key, only the harness the model key."""

    command: list[str] = field(default_factory=lambda: ["python", "-m", "agl.grading"])
    image: str | None = None
    workspace: str = "/agl/workspace"
    mounts: list[dict[str, Any]] = field(default_factory=list)  # the grader's alone


@dataclass
class K8sExecutorConfig:
    template: Any  # a path to a YAML/Jinja2 file, an inline YAML string, or a mapping
    namespace: str = "default"
    kubeconfig: str | None = None  # None: in-cluster config, else ~/.kube/config
    instance: str = "agl"  # tells apart several agl runs in one namespace
    agent_gateway_url: str = ""  # as agents reach the gateway (for the NetworkPolicy)
    max_jobs: int = 100  # attempts with a Job at once
    create_qps: float = 20.0  # Job creations per second, on average
    create_burst: int = 20
    create_retry_s: float = 60.0  # how long a create is retried through API errors
    watch: bool = True  # False: learn only from relists (for comparison)
    relist_s: float = 30.0
    watch_timeout_s: float = 300.0  # a watch is re-opened from its last version this often
    active_deadline_s: int = 3600  # for rollouts without a timeout
    ttl_after_finished_s: int = 600  # the cluster's own clean-up, should we be gone
    delete_on_close: bool = False  # True: close() deletes the Jobs (the run is over)
    api_threads: int = 8
    egress: EgressConfig = field(default_factory=EgressConfig)
    # A finished Job's pod logs are kept with its attempt (the end of each container's,
    # up to this many bytes) before the Job is deleted; 0: not read.
    pod_log_bytes: int = 256 * 1024
    grader: str | None = None  # the task's (agl/grading/): each Job grades its attempt
    grading: GradingConfig = field(default_factory=GradingConfig)
    # The agent's pod (``pod.PodSettings``, set over the template's values): its image, or
    # each task's own where ``image_field`` names it in the rollout's input (SWE-smith's
    # ``image_name``; missing or empty: ``image``, then the template's), each container's
    # resources (``{requests: {cpu: "1"}, limits: {memory: 4Gi}}``, merged per key), the
    # node selector, tolerations (added) and image pull Secrets (names, added).
    image: str | None = None
    image_field: str | None = None
    resources: dict[str, dict[str, Any]] | None = None
    node_selector: dict[str, str] | None = None
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    image_pull_secrets: list[str] = field(default_factory=list)
    pod: PodSettings = field(init=False)

    def __post_init__(self) -> None:
        self.pod = PodSettings(
            image=self.image,
            image_field=self.image_field,
            resources=self.resources or {},
            node_selector=self.node_selector or {},
            tolerations=self.tolerations,
            image_pull_secrets=self.image_pull_secrets,
        )
        if isinstance(self.egress, Mapping):
            self.egress = EgressConfig(**self.egress)
        if isinstance(self.grading, Mapping):
            self.grading = GradingConfig(**self.grading)
        if not self.grading.command or not self.grading.workspace.startswith("/"):
            raise ValueError("grading: a command, and an absolute workspace path")
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,18}[a-z0-9])?", self.instance):
            raise ValueError(f"instance {self.instance!r}: 1-20 lowercase letters, digits or '-'")
        if self.pod_log_bytes < 0:
            raise ValueError(f"pod_log_bytes={self.pod_log_bytes} must be 0 (off) or more")
        if self.max_jobs < 1 or self.create_qps <= 0 or self.create_burst < 1:
            raise ValueError("max_jobs, create_qps and create_burst must be positive")
