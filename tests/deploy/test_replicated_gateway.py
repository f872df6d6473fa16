"""deploy/k8s/replicated/: the gateway as several replicas over one PostgreSQL server,
applied in place of gateway.yaml. The manifests agree with each other, with what they
replace (the Service and pod labels the controller and the agents' NetworkPolicy rely
on), and with the gateway's options: the store's DSN carries no password, which comes
from the same Secret the server is given, mounted. No cluster, no network (the test API
server, tests/k8s-apiserver, serves neither Deployments nor StatefulSets); the schema
and Pod Security checks are test_deploy_manifests.py's and test_pod_security.py's."""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

from agl.backends.execution.k8s.config import EgressConfig
from agl.core.command_line import parse_overrides
from agl.core.gateway.config import GatewayConfig
from tests.helpers.k8s_manifests import (
    AGENT_LABELS,
    DEPLOY,
    K8S,
    NAMESPACE,
    REPLICATED,
    assert_hardened_containers,
    env_of,
    load_manifests,
    module_args,
    subset,
)

ALL_DOCS = load_manifests()
# What the replicated deploy applies: every top-level manifest but gateway.yaml, and
# replicated/; the examples' Secrets are made by hand.
SHARED = [d for p, d in ALL_DOCS if p.parent == K8S and p.name != "gateway.yaml"]
OWN = [d for p, d in ALL_DOCS if p.parent == REPLICATED]
APPLIED = SHARED + OWN
EXAMPLES = [d for p, d in ALL_DOCS if p.parent.name == "examples"]
SINGLE = [d for p, d in ALL_DOCS if p == K8S / "gateway.yaml"]
POSTGRES_UID = 999  # the postgres image's own user


def find(kind: str, name: str, docs: list[dict[str, Any]] = APPLIED) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} manifests"
    return found[0]


def pod(kind: str, name: str) -> dict[str, Any]:
    return dict(find(kind, name)["spec"]["template"])


def only_container(kind: str, name: str) -> dict[str, Any]:
    (only,) = pod(kind, name)["spec"]["containers"]
    return dict(only)


def gateway_config() -> GatewayConfig:
    return parse_overrides(
        GatewayConfig, module_args(only_container("Deployment", "agl-gateway"), "agl.gateway")
    )


def secret_file(pod_: dict[str, Any], container: dict[str, Any], path: str) -> tuple[str, str]:
    """(Secret name, key) of the mounted file at ``path`` in ``container``."""
    volumes = {v["name"]: v for v in pod_["spec"]["volumes"]}
    file = PurePosixPath(path)
    (mount,) = [
        m for m in container["volumeMounts"] if PurePosixPath(m["mountPath"]) == file.parent
    ]
    assert mount.get("readOnly") is True
    secret = volumes[mount["name"]]["secret"]
    keys = {item["path"]: item["key"] for item in secret["items"]}
    return secret["secretName"], keys[file.name]


def test_the_replicated_deploy_replaces_gateway_yaml_alone() -> None:
    assert {(d["kind"], d["metadata"]["name"]) for d in OWN} == {
        ("Service", "agl-gateway"),
        ("Deployment", "agl-gateway"),
        ("PodDisruptionBudget", "agl-gateway"),
        ("Service", "agl-postgres"),
        ("StatefulSet", "agl-postgres"),
        ("NetworkPolicy", "agl-postgres-ingress"),
    }
    applied = [(d["kind"], d["metadata"]["name"]) for d in APPLIED]
    assert len(applied) == len(set(applied)), "a resource is defined twice"
    # The same names as gateway.yaml's: the two are alternatives, never applied together,
    # and `kubectl apply -f deploy/k8s/` does not descend into replicated/.
    single = {(d["kind"], d["metadata"]["name"]) for d in SINGLE}
    assert single - set(applied) == {("PersistentVolumeClaim", "agl-gateway-data")}
    assert REPLICATED.parent == K8S
    assert all(d["metadata"]["namespace"] == NAMESPACE for d in OWN)


def test_the_replicas_serve_behind_the_service_the_others_name() -> None:
    deployment = find("Deployment", "agl-gateway")
    service = find("Service", "agl-gateway")
    labels = pod("Deployment", "agl-gateway")["metadata"]["labels"]
    assert deployment["spec"]["replicas"] > 1
    # Replaced one at a time, never fewer than asked for (the store is shared).
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
    }
    assert subset(deployment["spec"]["selector"]["matchLabels"], labels)
    # The Service spans every replica, and an agent keeps to one (its prompt cache).
    assert subset(service["spec"]["selector"], labels)
    assert service["spec"]["sessionAffinity"] == "ClientIP"
    assert service["spec"].get("type", "ClusterIP") == "ClusterIP"
    # What the controller and the agents' NetworkPolicy rely on, as gateway.yaml has it.
    single_service = find("Service", "agl-gateway", SINGLE)
    assert service["spec"]["ports"] == single_service["spec"]["ports"]
    assert service["spec"]["selector"] == single_service["spec"]["selector"]
    assert subset(EgressConfig().gateway_pod_labels, labels)
    policy = find("NetworkPolicy", "agl-agent-egress")
    assert subset(policy["spec"]["egress"][0]["to"][0]["podSelector"]["matchLabels"], labels)

    gateway = only_container("Deployment", "agl-gateway")
    ports = {p["name"]: p["containerPort"] for p in gateway["ports"]}
    (port,) = service["spec"]["ports"]
    config = gateway_config()
    assert port["port"] == ports[port["targetPort"]] == config.port == 8000
    assert config.host == "0.0.0.0"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert gateway[probe]["httpGet"]["path"] == "/healthz"
        assert ports[gateway[probe]["httpGet"]["port"]] == config.port

    # A drain takes one replica at a time; the replicas spread over nodes.
    budget = find("PodDisruptionBudget", "agl-gateway")
    assert subset(budget["spec"]["selector"]["matchLabels"], labels)
    assert budget["spec"]["maxUnavailable"] == 1 < deployment["spec"]["replicas"]
    (spread,) = pod("Deployment", "agl-gateway")["spec"]["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname"
    assert subset(spread["labelSelector"]["matchLabels"], labels)


def test_the_replicas_differ_from_the_single_gateway_in_their_store_only() -> None:
    """The image, token, ports, probes and limits are gateway.yaml's: the two do not drift."""
    replicated = only_container("Deployment", "agl-gateway")
    (single,) = find("Deployment", "agl-gateway", SINGLE)["spec"]["template"]["spec"]["containers"]
    store_options = ("run_dir=", "store=", "store_password_file=")
    for key in set(replicated) | set(single):
        if key == "command":
            mine, theirs = (
                [a for a in c["command"] if not a.startswith(store_options)]
                for c in (replicated, single)
            )
            assert mine == theirs
        elif key != "volumeMounts":
            assert replicated.get(key) == single.get(key), key
    # No volume of its own: what a replica writes is in PostgreSQL (run_dir is /tmp's).
    volumes = pod("Deployment", "agl-gateway")["spec"]["volumes"]
    assert not any("persistentVolumeClaim" in v for v in volumes)
    tmp = next(m["name"] for m in replicated["volumeMounts"] if m["mountPath"] == "/tmp")
    assert Path("/tmp") in Path(gateway_config().run_dir).parents
    assert next(v for v in volumes if v["name"] == tmp)["emptyDir"]


def test_the_store_password_comes_from_the_servers_secret_never_the_command_line() -> None:
    config = gateway_config()
    dsn = urlsplit(config.store)
    assert dsn.scheme == "postgresql"
    assert dsn.password is None and dsn.query == ""
    # The DSN names the server as deployed: its Service, port, user and database.
    service = find("Service", "agl-postgres")
    server = only_container("StatefulSet", "agl-postgres")
    env = env_of(server)
    assert dsn.hostname in {"agl-postgres", f"agl-postgres.{NAMESPACE}.svc"}
    (port,) = service["spec"]["ports"]
    server_ports = {p["name"]: p["containerPort"] for p in server["ports"]}
    assert dsn.port == port["port"] == server_ports[port["targetPort"]] == 5432
    assert dsn.username == env["POSTGRES_USER"]
    assert dsn.path == f"/{env['POSTGRES_DB']}"

    # The gateway's password file and the server's are the same key of the same Secret,
    # mounted read-only; nothing else carries it (no env value, no argument).
    gateway = only_container("Deployment", "agl-gateway")
    theirs = secret_file(pod("StatefulSet", "agl-postgres"), server, env["POSTGRES_PASSWORD_FILE"])
    mine = secret_file(pod("Deployment", "agl-gateway"), gateway, config.store_password_file)
    assert mine == theirs == ("agl-postgres", "password")
    assert "AGL_STORE_PASSWORD" not in env_of(gateway)
    assert "POSTGRES_PASSWORD" not in env
    example = find("Secret", "agl-postgres", EXAMPLES)
    assert set(example["stringData"]) == {"password"}
    assert not any(example["stringData"]["password"] in arg for arg in gateway["command"])


def test_postgres_is_one_stateful_server_on_a_volume_of_its_own() -> None:
    statefulset = find("StatefulSet", "agl-postgres")
    service = find("Service", "agl-postgres")
    spec = statefulset["spec"]
    labels = spec["template"]["metadata"]["labels"]
    assert spec["replicas"] == 1
    assert subset(spec["selector"]["matchLabels"], labels)
    assert subset(service["spec"]["selector"], labels)
    # The StatefulSet's governing Service is headless, and the only way to the server.
    assert spec["serviceName"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"
    # Its data: a claim of its own, kept when the StatefulSet goes; PGDATA below its root.
    (claim,) = spec["volumeClaimTemplates"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert spec["persistentVolumeClaimRetentionPolicy"] == {
        "whenDeleted": "Retain",
        "whenScaled": "Retain",
    }
    server = only_container("StatefulSet", "agl-postgres")
    (data,) = [m for m in server["volumeMounts"] if m["name"] == claim["metadata"]["name"]]
    assert Path(data["mountPath"]) in Path(env_of(server)["PGDATA"]).parents
    # Ready once it answers over TCP; a fast shutdown before the kubelet's SIGTERM.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = server[probe]["exec"]["command"]
        assert command[0] == "pg_isready" and "127.0.0.1" in command
    stop = server["lifecycle"]["preStop"]["exec"]["command"]
    assert stop[:2] == ["pg_ctl", "stop"] and env_of(server)["PGDATA"] in stop
    assert "fast" in stop


def test_postgres_answers_the_gateways_only() -> None:
    policy = find("NetworkPolicy", "agl-postgres-ingress")
    server_labels = pod("StatefulSet", "agl-postgres")["metadata"]["labels"]
    assert subset(policy["spec"]["podSelector"]["matchLabels"], server_labels)
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    # Pods of this namespace only (no namespaceSelector, no ipBlock), and only gateways.
    (source,) = rule["from"]
    assert set(source) == {"podSelector"}
    selector = source["podSelector"]["matchLabels"]
    assert subset(selector, pod("Deployment", "agl-gateway")["metadata"]["labels"])
    controller_labels = find("Deployment", "agl-controller")["spec"]["template"]["metadata"]
    assert not subset(selector, controller_labels["labels"])
    assert not subset(selector, AGENT_LABELS)
    server = only_container("StatefulSet", "agl-postgres")
    assert rule["ports"] == [{"protocol": "TCP", "port": server["ports"][0]["containerPort"]}]


def test_every_replicated_pod_runs_non_root_read_only_and_bounded() -> None:
    user = re.search(r"^USER (\d+)", (DEPLOY / "Dockerfile").read_text(), re.M)
    assert user is not None
    users = {"Deployment": int(user[1]), "StatefulSet": POSTGRES_UID}
    for doc in OWN:
        if doc["kind"] not in users:
            continue
        spec = doc["spec"]["template"]["spec"]
        name = doc["metadata"]["name"]
        context = spec["securityContext"]
        assert context["runAsNonRoot"] is True, name
        assert context["runAsUser"] == context["runAsGroup"] == users[doc["kind"]], name
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert spec["automountServiceAccountToken"] is False, name
        assert spec.get("enableServiceLinks") is False, name
        volumes = {v["name"] for v in spec["volumes"]}
        claims = {t["metadata"]["name"] for t in doc["spec"].get("volumeClaimTemplates", [])}
        assert_hardened_containers(spec, volumes | claims, name)
