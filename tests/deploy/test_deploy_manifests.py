"""deploy/: the Kubernetes manifests parse, fit the API's schema, agree with each other,
and agree with the code that acts on them (the gateway's and the controller's options,
the controller's Job rendering and its NetworkPolicy). No cluster, no network. The
replicated gateway (deploy/k8s/replicated/, in place of gateway.yaml) has its own tests
in test_replicated_gateway.py; its manifests' schema is checked here with the rest."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from kubernetes.client import ApiClient
from kubernetes.client import models as k8s_models

from agl.agent import AgentContext
from agl.backends.execution.k8s.config import EgressConfig
from agl.backends.execution.k8s.manifests import (
    KEY_ENV,
    SECRET_KEY,
    egress_policy,
    own_job,
    render_job,
)
from agl.backends.execution.k8s.naming import (
    ATTEMPT,
    INSTANCE,
    MANAGED_BY,
    ROLLOUT,
    ROLLOUT_ID,
    job_name,
)
from agl.core.command_line import parse_overrides
from agl.core.gateway.config import GatewayConfig
from tests.helpers.k8s_manifests import (
    AGENT_LABELS,
    DEPLOY,
    NAMESPACE,
    REPLICATED,
    assert_hardened_containers,
    env_of,
    load_manifests,
    module_args,
    subset,
)

AGENTS = "agl-agents"  # the agents' Jobs, Secrets and policy, and the controller's Role
AGENT_GATEWAY_URL = "http://agl-gateway.agl.svc:8000"
EXPECTED = {
    ("Namespace", "agl"),
    ("Namespace", "agl-agents"),
    ("PersistentVolumeClaim", "agl-gateway-data"),
    ("Service", "agl-gateway"),
    ("Deployment", "agl-gateway"),
    ("ServiceAccount", "agl-controller"),
    ("Role", "agl-controller"),
    ("RoleBinding", "agl-controller"),
    ("Deployment", "agl-controller"),
    ("ConfigMap", "agl-agent-job"),
    ("NetworkPolicy", "agl-agent-egress"),
    ("Secret", "agl-admin"),  # examples/: shown, not applied
    ("Secret", "agl-postgres"),  # the replicated gateway's store password, shown alike
}


ALL_DOCS = load_manifests()
# The default deploy (what `kubectl apply -f deploy/k8s/` applies) and its examples.
DOCS = [(path, doc) for path, doc in ALL_DOCS if REPLICATED not in path.parents]


def find(kind: str, name: str) -> dict[str, Any]:
    found = [d for _, d in DOCS if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} manifests"
    return found[0]


def pod_spec(deployment: str) -> dict[str, Any]:
    return find("Deployment", deployment)["spec"]["template"]["spec"]


def container(deployment: str) -> dict[str, Any]:
    (only,) = pod_spec(deployment)["containers"]
    return only


def rendered_job(input_value: Any = None, key: str = "agl-attempt-key-xyz") -> dict[str, Any]:
    """The agent Job as the controller builds it (render_job + own_job)."""
    if input_value is None:
        input_value = {"target": 5, "low": 1, "high": 8, "max_turns": 3}
    text = find("ConfigMap", "agl-agent-job")["data"]["agent-job.yaml"]
    name = job_name("agl", "r-1", 1)
    context = AgentContext(
        gateway_url=AGENT_GATEWAY_URL,
        rollout_id="r-1",
        attempt=1,
        mode="train",
        model="tiny",
        api_key=key,
        input=input_value,
    )
    env = context.to_env()
    variables = {
        "name": name,
        "namespace": AGENTS,
        "rollout_id": "r-1",
        "attempt": 1,
        "mode": "train",
        "model": "tiny",
        "input": input_value,
        "input_json": env["AGL_INPUT"],
    }
    labels = {MANAGED_BY: "agl", INSTANCE: "agl", ROLLOUT: "r-1", ATTEMPT: "1"}
    return own_job(
        render_job(text, variables),
        name=name,
        namespace=AGENTS,
        labels=labels,
        annotations={ROLLOUT_ID: "r-1", ATTEMPT: "1"},
        env=env,
        active_deadline_s=60,
        ttl_after_finished_s=600,
    )


# -- the API's schema, from the kubernetes client's models ---------------------------------

_SCALARS = {"str": str, "int": int, "bool": bool, "float": (int, float), "datetime": str}


def unknown_fields(value: Any, type_name: str, path: str) -> Iterator[str]:
    """Fields the API does not know (the client's models drop them silently), and scalars
    of the wrong type, walking the client's ``attribute_map`` / ``openapi_types``."""
    inner = re.fullmatch(r"(?:list|List)\[(.+)\]", type_name)
    if inner:
        if not isinstance(value, list):
            yield f"{path}: a list expected"
            return
        for i, item in enumerate(value):
            yield from unknown_fields(item, inner[1], f"{path}[{i}]")
        return
    inner = re.fullmatch(r"(?:dict\(|[dD]ict\[)str, (.+)[)\]]", type_name)
    if inner:
        if not isinstance(value, dict):
            yield f"{path}: a mapping expected"
            return
        for key, item in value.items():
            yield from unknown_fields(item, inner[1], f"{path}.{key}")
        return
    if type_name == "object":  # int-or-string and the like
        return
    if type_name in _SCALARS:
        if not isinstance(value, _SCALARS[type_name]) or (
            type_name == "int" and isinstance(value, bool)
        ):
            yield f"{path}: {value!r} is not a {type_name}"
        return
    model = getattr(k8s_models, type_name)
    if not isinstance(value, dict):
        yield f"{path}: a mapping ({type_name}) expected"
        return
    attrs = {json_key: attr for attr, json_key in model.attribute_map.items()}
    for key, item in value.items():
        if key not in attrs:
            yield f"{path}.{key}: not a field of {type_name}"
        else:
            yield from unknown_fields(item, model.openapi_types[attrs[key]], f"{path}.{key}")


def schema_errors(doc: dict[str, Any], kind: str) -> list[str]:
    """What the API would refuse in ``doc``: unknown fields, wrong types, missing
    required fields (the last two by the client's own models)."""
    errors = list(unknown_fields(doc, f"V1{kind}", kind))
    model = getattr(k8s_models, f"V1{kind}")
    try:
        if hasattr(model, "from_dict"):  # pydantic models (kubernetes >= 37)
            model.from_dict(doc)
        else:
            ApiClient()._ApiClient__deserialize(doc, f"V1{kind}")  # type: ignore[attr-defined]
    except (ValueError, TypeError) as error:  # pydantic's ValidationError is a ValueError
        errors.append(f"{kind}: {error}")
    return errors


# -- the tests ------------------------------------------------------------------------------


def test_every_manifest_parses_and_lives_in_the_namespace() -> None:
    seen = [(d["kind"], d["metadata"]["name"]) for _, d in DOCS]
    assert len(seen) == len(set(seen)), "a resource is defined twice"
    assert set(seen) == EXPECTED
    for path, doc in DOCS:
        assert doc.get("apiVersion"), path
        if doc["kind"] in ("Role", "RoleBinding", "NetworkPolicy"):  # the agents'
            assert doc["metadata"].get("namespace") == AGENTS, (path, doc["kind"])
        elif doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == NAMESPACE, (path, doc["kind"])
    # `kubectl apply -f deploy/k8s/` must not apply the placeholder Secret.
    examples = [p for p, d in DOCS if d["kind"] == "Secret"]
    assert examples and all(p.parent.name == "examples" for p in examples)


@pytest.mark.parametrize(
    "index",
    range(len(ALL_DOCS)),
    ids=[f"{p.parent.name}/{d['kind']}/{d['metadata']['name']}" for p, d in ALL_DOCS],
)
def test_manifest_fits_the_api_schema(index: int) -> None:
    _, doc = ALL_DOCS[index]
    assert schema_errors(doc, doc["kind"]) == []


def test_the_schema_check_catches_mistakes() -> None:
    def broken(change: Any) -> str:
        deployment = json.loads(json.dumps(find("Deployment", "agl-gateway")))
        change(deployment["spec"]["template"]["spec"]["containers"][0])
        return "\n".join(schema_errors(deployment, "Deployment"))

    misspelt = broken(lambda c: c.update(imagePullPolicyy="Always"))
    assert "imagePullPolicyy: not a field of V1Container" in misspelt
    number = broken(lambda c: c["resources"]["limits"].update(cpu=2))
    assert "limits.cpu: 2 is not a str" in number
    assert "name" in broken(lambda c: c.pop("name"))  # required


def test_the_rendered_agent_job_fits_the_api_schema() -> None:
    assert schema_errors(rendered_job(), "Job") == []


def test_gateway_service_volume_and_token_agree() -> None:
    service = find("Service", "agl-gateway")
    deployment = find("Deployment", "agl-gateway")
    pod = deployment["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert subset(deployment["spec"]["selector"]["matchLabels"], labels)
    assert subset(service["spec"]["selector"], labels)
    # What the agents' NetworkPolicy lets them reach.
    assert subset(EgressConfig().gateway_pod_labels, labels)

    gateway = container("agl-gateway")
    ports = {p["name"]: p["containerPort"] for p in gateway["ports"]}
    (port,) = service["spec"]["ports"]
    # A NetworkPolicy sees the pod's port: the Service must not translate it.
    assert port["port"] == ports[port["targetPort"]] == 8000
    config = parse_overrides(GatewayConfig, module_args(gateway, "agl.gateway"))
    assert (config.host, config.port) == ("0.0.0.0", 8000)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert gateway[probe]["httpGet"]["path"] == "/healthz"
        assert ports[gateway[probe]["httpGet"]["port"]] == config.port

    # The SQLite store is on the claim.
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in gateway["volumeMounts"]}
    store_mount = mounts[str(Path(config.store_url).parent)]
    claim = volumes[store_mount]["persistentVolumeClaim"]["claimName"]
    pvc = find("PersistentVolumeClaim", claim)
    assert pvc["spec"]["accessModes"] == ["ReadWriteOnce"]

    # The admin token: the example Secret's name and key, in both services.
    secret = find("Secret", "agl-admin")
    for name in ("agl-gateway", "agl-controller"):
        ref = env_of(container(name))["AGL_ADMIN_TOKEN"]["secretKeyRef"]
        assert ref["name"] == secret["metadata"]["name"]
        assert ref["key"] == "token" and set(secret["stringData"]) == {"token"}


def test_the_controller_role_grants_exactly_what_it_needs() -> None:
    role = find("Role", "agl-controller")
    grants: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert set(rule) == {"apiGroups", "resources", "verbs"}, rule  # no resourceNames etc.
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                grants.setdefault((group, resource), set()).update(rule["verbs"])
    assert grants == {
        ("batch", "jobs"): {"create", "get", "list", "watch", "delete"},
        ("", "secrets"): {"create", "get", "list", "delete"},
        ("", "pods"): {"list"},  # a finished Job's pods, to read their logs
        ("", "pods/log"): {"get"},
        ("networking.k8s.io", "networkpolicies"): {"create", "get", "update"},
    }
    binding = find("RoleBinding", "agl-controller")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "agl-controller",
    }
    account = find("ServiceAccount", "agl-controller")["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}
    ]
    assert pod_spec("agl-controller")["serviceAccountName"] == account
    assert not any(d["kind"] in ("ClusterRole", "ClusterRoleBinding") for _, d in DOCS)


def test_the_controller_command_parses_and_points_at_what_is_deployed() -> None:
    from agl.controller import ControllerConfig  # the standalone controller's options

    deployment = find("Deployment", "agl-controller")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    controller = container("agl-controller")
    config = parse_overrides(ControllerConfig, module_args(controller, "agl.controller"))
    assert config.executor == "k8s"
    assert config.namespace == AGENTS
    assert not config.kubeconfig  # in-cluster: the ServiceAccount's token
    assert config.agent_gateway_url == AGENT_GATEWAY_URL

    service = find("Service", "agl-gateway")
    (port,) = service["spec"]["ports"]
    for url, hosts in (
        (config.gateway_url, {"agl-gateway", "agl-gateway.agl.svc"}),
        (config.agent_gateway_url, {"agl-gateway.agl.svc"}),
    ):
        parts = urlsplit(url)
        assert parts.hostname in hosts and parts.port == port["port"], url

    # The template is the ConfigMap's key, where it is mounted.
    configmap = find("ConfigMap", "agl-agent-job")
    volumes = {v["name"]: v for v in pod_spec("agl-controller")["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in controller["volumeMounts"]}
    template = Path(config.template)
    volume = next(n for n, path in mounts.items() if Path(path) == template.parent)
    assert volumes[volume]["configMap"]["name"] == configmap["metadata"]["name"]
    assert template.name in configmap["data"]

    # Its Jobs carry the labels the static NetworkPolicy selects.
    policy = find("NetworkPolicy", "agl-agent-egress")
    assert policy["spec"]["podSelector"]["matchLabels"][INSTANCE] == config.instance
    assert policy["metadata"]["name"] == f"{config.instance}-agent-egress"


def test_the_agent_template_renders_to_a_locked_down_job() -> None:
    key = "agl-attempt-key-xyz"
    job = rendered_job(key=key)
    assert job["kind"] == "Job" and job["apiVersion"] == "batch/v1"
    assert job["metadata"]["name"] == job_name("agl", "r-1", 1)
    assert job["metadata"]["namespace"] == AGENTS
    assert job["metadata"]["labels"]["agl.dev/mode"] == "train"
    spec = job["spec"]
    assert spec["backoffLimit"] == 0 and spec["activeDeadlineSeconds"] == 60
    pod = spec["template"]
    assert subset(AGENT_LABELS, pod["metadata"]["labels"])
    assert pod["spec"]["restartPolicy"] == "Never"
    assert pod["spec"]["automountServiceAccountToken"] is False

    (agent,) = pod["spec"]["containers"]
    assert agent["image"] == container("agl-gateway")["image"]
    # The attempt's key comes from its Secret, never from the Job.
    assert key not in json.dumps(job)
    env = env_of(agent)
    assert env[KEY_ENV] == {"secretKeyRef": {"name": job["metadata"]["name"], "key": SECRET_KEY}}
    assert env["OPENAI_BASE_URL"].startswith(AGENT_GATEWAY_URL + "/proxy/rollout/r-1/attempt/1/")
    assert json.loads(env["AGL_INPUT"])["target"] == 5

    # python -m agl.agent MODULE:FUNCTION, an async harness in the image's experiments/.
    assert agent["command"][:3] == ["python", "-m", "agl.agent"]
    module, _, function = agent["command"][3].partition(":")
    spec_ = importlib.util.find_spec(module)
    assert spec_ is not None and spec_.origin is not None
    tree = ast.parse(Path(spec_.origin).read_text())
    assert any(isinstance(n, ast.AsyncFunctionDef) and n.name == function for n in tree.body)

    # A rollout may name its own image; the template's placeholders see its input.
    other = rendered_job({"target": 2, "image": "registry.example/swe-task:1"})
    assert other["spec"]["template"]["spec"]["containers"][0]["image"] == (
        "registry.example/swe-task:1"
    )


def test_the_static_network_policy_is_the_controllers() -> None:
    policy = find("NetworkPolicy", "agl-agent-egress")
    expected = egress_policy(
        policy["metadata"]["name"], AGENTS, AGENT_LABELS, EgressConfig(), AGENT_GATEWAY_URL
    )
    assert policy["spec"] == expected["spec"]
    assert policy["metadata"] == expected["metadata"]
    # What it says, spelled out: agents (as rendered) reach the gateway's pods and DNS only.
    assert subset(policy["spec"]["podSelector"]["matchLabels"], AGENT_LABELS)
    job_labels = rendered_job()["spec"]["template"]["metadata"]["labels"]
    assert subset(policy["spec"]["podSelector"]["matchLabels"], job_labels)
    gateway_rule, dns_rule = policy["spec"]["egress"]
    (to_gateway,) = gateway_rule["to"]
    gateway_labels = find("Deployment", "agl-gateway")["spec"]["template"]["metadata"]["labels"]
    assert subset(to_gateway["podSelector"]["matchLabels"], gateway_labels)
    # ... in the gateway's namespace, not the agents'.
    gateway_namespace = find("Deployment", "agl-gateway")["metadata"]["namespace"]
    assert to_gateway["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": gateway_namespace
    }
    assert gateway_rule["ports"] == [
        {"protocol": "TCP", "port": container("agl-gateway")["ports"][0]["containerPort"]}
    ]
    assert {p["port"] for p in dns_rule["ports"]} == {53}
    assert {p["protocol"] for p in dns_rule["ports"]} == {"UDP", "TCP"}


def test_every_pod_runs_non_root_read_only_and_bounded() -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    user = re.search(r"^USER (\d+)(?::(\d+))?$", dockerfile, re.M)
    assert user is not None and int(user[1]) != 0, "the image's USER must be a numeric non-root id"
    pods = {
        "agl-gateway": pod_spec("agl-gateway"),
        "agl-controller": pod_spec("agl-controller"),
        "agent": rendered_job()["spec"]["template"]["spec"],
    }
    for name, pod in pods.items():
        context = pod["securityContext"]
        assert context["runAsNonRoot"] is True, name
        assert context["runAsUser"] == int(user[1]), name
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert pod.get("enableServiceLinks") is False, name
        assert_hardened_containers(pod, {v["name"] for v in pod.get("volumes") or []}, name)


def test_the_dockerfile_installs_cpu_torch_before_agl() -> None:
    lines = [line.strip() for line in (DEPLOY / "Dockerfile").read_text().splitlines()]
    assert lines[[line.startswith("FROM") for line in lines].index(True)] == (
        "FROM python:3.11-slim"
    )
    runs = [shlex.split(line[4:]) for line in lines if line.startswith("RUN pip install")]
    assert runs[0][:3] == ["pip", "install", "torch==2.13.0"]
    assert "https://download.pytorch.org/whl/cpu" in runs[0]
    # the controller's k8s and the replicated gateway's postgresql, unless told more
    assert ".[${EXTRAS}]" in runs[1] and "ARG EXTRAS=k8s,postgresql" in lines
