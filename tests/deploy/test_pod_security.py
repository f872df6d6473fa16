"""Every pod agl ships meets the Pod Security level its namespace declares: the gateway
and the controller (deploy/k8s, namespace agl: restricted), and the agents' Jobs as the
controller renders them (namespace agl-agents: privileged), the deploy's own template,
the coding agent's (conf/swe/job.yaml, graded) and the general agent's
(conf/general/job.yaml). The sandboxed agents need exactly privileged, for the reasons
deploy/k8s/namespace.yaml gives; a change that lowers their needs shows here.

The replicated gateway and its PostgreSQL server (deploy/k8s/replicated) meet restricted
too. The checks are agl.testing.k8s.pod_security's, the PodSecurity admission plugin's
rules (k8s.io/pod-security-admission, latest): the test API server (tests/k8s-apiserver)
runs no admission plugin, so admission itself cannot give its verdict here. That module
gave the same verdict as the plugin's own fixtures for every one of the 148 baseline and
restricted v1.36 cases (test/testdata/{baseline,restricted}/v1.36/{pass,fail}, checked
once by hand, not kept here); the last test shows it catches each kind of breach."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from agl.backends.execution.k8s.config import K8sExecutorConfig
from agl.backends.execution.k8s.manifests import job_manifest, load_template
from agl.core.contracts.execution import Launch
from agl.testing.k8s.pod_security import enforced_level, needed_level, pod_of, violations

REPO = Path(__file__).resolve().parents[2]
DOCS = [
    doc
    for path in sorted((REPO / "deploy" / "k8s").glob("*.yaml"))  # examples/ holds no pod
    for doc in yaml.safe_load_all(path.read_text())
    if doc is not None
]
NAMESPACES = {d["metadata"]["name"]: enforced_level(d) for d in DOCS if d["kind"] == "Namespace"}
# The replicated gateway and its PostgreSQL server (applied instead of gateway.yaml).
REPLICATED = [
    doc
    for path in sorted((REPO / "deploy" / "k8s" / "replicated").glob("*.yaml"))
    for doc in yaml.safe_load_all(path.read_text())
    if doc is not None
]
SHIPPED = DOCS + REPLICATED


def find(kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in DOCS if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def _job(template: str, config: K8sExecutorConfig, input_value: Any) -> dict[str, Any]:
    """The agent Job the controller renders from ``template`` with ``config``."""
    env = {"OPENAI_API_KEY": "sk", "AGL_INPUT": orjson.dumps(input_value).decode()}
    return job_manifest(
        template,
        "agl-r-1",
        Launch("r", 1, 900.0, env, report_key="rk"),
        namespace=config.namespace,
        labels={},
        default_deadline_s=config.active_deadline_s,
        ttl_after_finished_s=config.ttl_after_finished_s,
        grader=config.grader,
        grading=config.grading,
        pod=config.pod,
    )


def _deploy_job() -> dict[str, Any]:
    """deploy/k8s's agent Job, in the namespace the deployed controller is told."""
    controller = find("Deployment", "agl-controller")["spec"]["template"]["spec"]
    args = dict(a.split("=", 1) for a in controller["containers"][0]["command"][3:])
    template = find("ConfigMap", "agl-agent-job")["data"]["agent-job.yaml"]
    config = K8sExecutorConfig(template=template, namespace=args["namespace"])
    return _job(template, config, {"target": 5, "low": 1, "high": 8, "max_turns": 3})


def _conf_job(controller: str, input_value: Any, grader: str | None = None) -> dict[str, Any]:
    """The agent Job ``conf/controller/<controller>.yaml`` renders, as the executor does."""
    settings = yaml.safe_load((REPO / "conf" / "controller" / f"{controller}.yaml").read_text())
    base = yaml.safe_load((REPO / "conf" / "controller" / "k8s.yaml").read_text())
    merged = {**base, **{k: v for k, v in settings.items() if k != "defaults"}}
    for key in ("name", "poll_s", "reconcile_s", "agent_gateway_url"):
        merged.pop(key, None)
    config = K8sExecutorConfig(**merged, grader=grader)
    return _job(load_template(config.template, REPO), config, input_value)


SANDBOXED = {
    "swe": lambda: _conf_job(
        "swe_k8s", {"instance_id": "a", "repo": "r"}, grader="experiments.swe.grader:grade"
    ),
    "general": lambda: _conf_job("general_k8s", {"question": "q"}),
}


def test_the_namespaces_declare_their_levels() -> None:
    assert NAMESPACES == {"agl": "restricted", "agl-agents": "privileged"}


@pytest.mark.parametrize(
    "index",
    [i for i, d in enumerate(SHIPPED) if pod_of(d) is not None],
    ids=lambda i: (
        f"{'replicated/' if i >= len(DOCS) else ''}{SHIPPED[i]['kind']}/"
        f"{SHIPPED[i]['metadata']['name']}"
    ),
)
def test_every_shipped_pod_meets_its_namespaces_level(index: int) -> None:
    doc = SHIPPED[index]
    pod = pod_of(doc)
    assert pod is not None
    level = NAMESPACES[doc["metadata"]["namespace"]]
    assert violations(pod, level) == []
    assert needed_level(pod) == "restricted"  # the services need nothing more


def test_the_deploys_agent_job_meets_restricted_in_the_agents_namespace() -> None:
    job = _deploy_job()
    assert job["metadata"]["namespace"] == "agl-agents"
    pod = pod_of(job)
    assert pod is not None
    assert violations(pod, NAMESPACES[job["metadata"]["namespace"]]) == []
    assert needed_level(pod) == "restricted"


@pytest.mark.parametrize("agent", sorted(SANDBOXED))
def test_a_sandboxed_agents_job_needs_privileged_and_gets_it(agent: str) -> None:
    job = SANDBOXED[agent]()
    pod = pod_of(job)
    assert pod is not None
    assert job["metadata"]["namespace"] == "agl-agents"
    assert violations(pod, NAMESPACES[job["metadata"]["namespace"]]) == []
    assert needed_level(pod) == "privileged"
    # Exactly the reasons namespace.yaml gives, in every container (a graded task's
    # harness and grader alike): SYS_ADMIN, and mount(2) past the runtime's AppArmor.
    spec = pod["spec"]
    containers = [
        f"{field}[{c['name']}]"
        for field in ("initContainers", "containers")
        for c in spec.get(field) or []
    ]
    assert len(containers) == (2 if agent == "swe" else 1)
    expected = {
        reason
        for where in containers
        for reason in (
            f"{where}: adds capabilities ['SYS_ADMIN']",
            f"{where}: appArmorProfile Unconfined",
        )
    }
    assert set(violations(pod, "baseline")) == expected
    assert set(violations(pod, "restricted")) > expected  # and root, among others


def _gateway_pod() -> dict[str, Any]:
    pod = pod_of(find("Deployment", "agl-gateway"))
    assert pod is not None
    return copy.deepcopy(pod)


def _container(pod: dict[str, Any]) -> dict[str, Any]:
    first: dict[str, Any] = pod["spec"]["containers"][0]
    return first


def _context(pod: dict[str, Any]) -> dict[str, Any]:
    context: dict[str, Any] = _container(pod)["securityContext"]
    return context


BREACHES: dict[str, tuple[str, Callable[[dict[str, Any]], object]]] = {
    # baseline's rules (so restricted's too)
    "privileged": ("baseline", lambda p: _context(p).update(privileged=True)),
    "host network": ("baseline", lambda p: p["spec"].update(hostNetwork=True)),
    "host PID": ("baseline", lambda p: p["spec"].update(hostPID=True)),
    "host IPC": ("baseline", lambda p: p["spec"].update(hostIPC=True)),
    "hostPath": ("baseline", lambda p: p["spec"]["volumes"].append({"name": "h", "hostPath": {}})),
    "host port": (
        "baseline",
        lambda p: _container(p).update(ports=[{"containerPort": 80, "hostPort": 80}]),
    ),
    "SYS_ADMIN": ("baseline", lambda p: _context(p)["capabilities"].update(add=["SYS_ADMIN"])),
    "NET_RAW": ("baseline", lambda p: _context(p)["capabilities"].update(add=["NET_RAW"])),
    "AppArmor unconfined": (
        "baseline",
        lambda p: _context(p).update(appArmorProfile={"type": "Unconfined"}),
    ),
    "AppArmor annotation": (
        "baseline",
        lambda p: (
            p["metadata"]
            .setdefault("annotations", {})
            .update({"container.apparmor.security.beta.kubernetes.io/gateway": "unconfined"})
        ),
    ),
    "seccomp unconfined": (
        "baseline",
        lambda p: p["spec"]["securityContext"].update(seccompProfile={"type": "Unconfined"}),
    ),
    "SELinux type": (
        "baseline",
        lambda p: _context(p).update(seLinuxOptions={"type": "spc_t"}),
    ),
    "unmasked /proc": ("baseline", lambda p: _context(p).update(procMount="Unmasked")),
    "unsafe sysctl": (
        "baseline",
        lambda p: p["spec"]["securityContext"].update(
            sysctls=[{"name": "kernel.msgmax", "value": "1"}]
        ),
    ),
    "probe host": (
        "baseline",
        lambda p: _container(p)["livenessProbe"]["httpGet"].update(host="10.0.0.1"),
    ),
    "HostProcess": (
        "baseline",
        lambda p: _context(p).update(windowsOptions={"hostProcess": True}),
    ),
    # restricted's own
    "root user": ("restricted", lambda p: _context(p).update(runAsUser=0)),
    "runAsNonRoot false": ("restricted", lambda p: _context(p).update(runAsNonRoot=False)),
    "runAsNonRoot unset": (
        "restricted",
        lambda p: p["spec"]["securityContext"].pop("runAsNonRoot"),
    ),
    "privilege escalation": (
        "restricted",
        lambda p: _context(p).pop("allowPrivilegeEscalation"),
    ),
    "no drop ALL": ("restricted", lambda p: _context(p).pop("capabilities")),
    "CHOWN added": ("restricted", lambda p: _context(p)["capabilities"].update(add=["CHOWN"])),
    "no seccomp": ("restricted", lambda p: p["spec"]["securityContext"].pop("seccompProfile")),
    "nfs volume": (
        "restricted",
        lambda p: p["spec"]["volumes"].append({"name": "n", "nfs": {"server": "s", "path": "/"}}),
    ),
}


@pytest.mark.parametrize("breach", sorted(BREACHES))
def test_the_checker_catches_each_breach_at_its_level(breach: str) -> None:
    level, change = BREACHES[breach]
    pod = _gateway_pod()
    assert violations(pod, "restricted") == []
    change(pod)
    assert violations(pod, "restricted"), breach
    assert bool(violations(pod, "baseline")) == (level == "baseline"), breach
    assert violations(pod, "privileged") == []
    assert needed_level(pod) == ("privileged" if level == "baseline" else "baseline")


def test_a_pod_in_a_user_namespace_may_run_as_root_under_restricted() -> None:
    """hostUsers: false lifts restricted's non-root rules (root in the pod's user
    namespace is no one on the node), as admission does; nothing else."""
    pod = _gateway_pod()
    _context(pod).update(runAsUser=0, runAsNonRoot=False)
    pod["spec"]["securityContext"].pop("runAsNonRoot")
    assert needed_level(pod) == "baseline"
    pod["spec"]["hostUsers"] = False
    assert needed_level(pod) == "restricted"
    _context(pod)["capabilities"]["add"] = ["SYS_ADMIN"]
    assert needed_level(pod) == "privileged"


def test_an_unknown_level_is_refused() -> None:
    with pytest.raises(ValueError, match="one of privileged, baseline, restricted"):
        violations(_gateway_pod(), "strict")
    with pytest.raises(ValueError, match="enforce='strict'"):
        enforced_level({"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "strict"}}})
