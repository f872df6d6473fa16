"""deploy/k8s's manifests as the deploy tests read them (tests/deploy/): every document
with its file, and the small readers both the default and the replicated deploy's tests
use. ``kubectl apply -f deploy/k8s/`` applies the top folder only: ``examples/`` holds
what is made by hand, ``replicated/`` the gateway applied instead of ``gateway.yaml``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from agl.backends.execution.k8s.naming import INSTANCE, MANAGED_BY, ROLE

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S = DEPLOY / "k8s"
# The replicated gateway: applied instead of gateway.yaml, so the same names again.
REPLICATED = K8S / "replicated"
NAMESPACE = "agl"
AGENT_LABELS = {MANAGED_BY: "agl", INSTANCE: "agl", ROLE: "agent"}


def load_manifests() -> list[tuple[Path, dict[str, Any]]]:
    """Every document under deploy/k8s/, with its file, in path order."""
    docs = []
    for path in sorted(K8S.rglob("*.y*ml")):
        with path.open() as f:
            docs.extend((path, doc) for doc in yaml.safe_load_all(f) if doc is not None)
    return docs


def module_args(cont: dict[str, Any], module: str) -> list[str]:
    """The ``key=value`` arguments of ``python -m module ...``."""
    assert cont["command"][:3] == ["python", "-m", module]
    return list(cont["command"][3:])


def env_of(cont: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in cont.get("env") or []}


def subset(small: dict[str, str], big: dict[str, str]) -> bool:
    return all(big.get(k) == v for k, v in small.items())


def assert_hardened_containers(pod: dict[str, Any], volumes: set[str], name: str) -> None:
    """Every container of ``pod``: no privilege escalation, a read-only root, no
    capabilities, resources requested and memory limited, mounts only of ``volumes``, a
    writable /tmp."""
    for cont in pod["containers"]:
        security = cont["securityContext"]
        assert security["allowPrivilegeEscalation"] is False, name
        assert security["readOnlyRootFilesystem"] is True, name
        assert security["capabilities"] == {"drop": ["ALL"]}, name
        assert cont["resources"]["requests"] and cont["resources"]["limits"]["memory"]
        mounts = {m["name"] for m in cont.get("volumeMounts") or []}
        assert mounts <= volumes, name
        assert "/tmp" in {m["mountPath"] for m in cont["volumeMounts"]}, name
