"""The Pod Security Standards' checks, as the PodSecurity admission plugin makes them
(k8s.io/pod-security-admission's ``policy/check_*.go``, latest version), for tests of
what agl ships: the test API server runs no admission (``api_server``), so the levels its
namespaces declare are checked here.

``violations(pod, level)`` lists every rule of ``level`` a pod breaks, one line each
(``baseline`` also holds for ``restricted``; ``privileged`` has none);
``needed_level(pod)`` is the least level that admits it; ``pod_of(manifest)`` finds the
pod in a Pod, a Job, a Deployment or another workload; ``enforced_level(namespace)``
reads a Namespace's ``pod-security.kubernetes.io/enforce`` label (none: privileged).

Invariant: the checks read only what admission reads, the pod's metadata and spec, and a
field left out counts as its default (undefined), as admission counts it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

LEVELS = ("privileged", "baseline", "restricted")
ENFORCE = "pod-security.kubernetes.io/enforce"

# check_capabilities_baseline.go: the container runtimes' default set, NET_RAW left out.
BASELINE_CAPABILITIES = frozenset(
    {
        "AUDIT_WRITE",
        "CHOWN",
        "DAC_OVERRIDE",
        "FOWNER",
        "FSETID",
        "KILL",
        "MKNOD",
        "NET_BIND_SERVICE",
        "SETFCAP",
        "SETGID",
        "SETPCAP",
        "SETUID",
        "SYS_CHROOT",
    }
)
# check_sysctls.go: namespaced, and isolated from other pods on the node.
SAFE_SYSCTLS = frozenset(
    {
        "kernel.shm_rmid_forced",
        "net.ipv4.ip_local_port_range",
        "net.ipv4.tcp_syncookies",
        "net.ipv4.ping_group_range",
        "net.ipv4.ip_unprivileged_port_start",
        "net.ipv4.ip_local_reserved_ports",
        "net.ipv4.tcp_keepalive_time",
        "net.ipv4.tcp_fin_timeout",
        "net.ipv4.tcp_keepalive_intvl",
        "net.ipv4.tcp_keepalive_probes",
        "net.ipv4.tcp_rmem",
        "net.ipv4.tcp_wmem",
        "net.ipv4.tcp_slow_start_after_idle",
        "net.ipv4.tcp_notsent_lowat",
    }
)
SELINUX_TYPES = frozenset(
    {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
)
# check_restrictedVolumes.go: the inline volume sources restricted allows.
RESTRICTED_VOLUMES = frozenset(
    {
        "configMap",
        "downwardAPI",
        "emptyDir",
        "projected",
        "secret",
        "csi",
        "persistentVolumeClaim",
        "ephemeral",
        "image",
    }
)
PROFILES = ("RuntimeDefault", "Localhost")  # seccomp's and AppArmor's allowed types
_APPARMOR_ANNOTATION = "container.apparmor.security.beta.kubernetes.io/"
_HANDLERS = ("livenessProbe", "readinessProbe", "startupProbe")


def _containers(spec: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    for field in ("initContainers", "containers", "ephemeralContainers"):
        for container in spec.get(field) or []:
            yield f"{field}[{container.get('name', '?')}]", container


def _context(owner: Mapping[str, Any]) -> Mapping[str, Any]:
    return owner.get("securityContext") or {}


def _baseline(meta: Mapping[str, Any], spec: Mapping[str, Any]) -> Iterator[str]:
    pod = _context(spec)
    if (pod.get("windowsOptions") or {}).get("hostProcess"):
        yield "securityContext.windowsOptions.hostProcess: a HostProcess pod"
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            yield f"{field}: the host's namespace"
    for volume in spec.get("volumes") or []:
        if "hostPath" in volume:
            yield f"volumes[{volume.get('name', '?')}]: hostPath"
    for key, value in (meta.get("annotations") or {}).items():
        allowed = not value or value == "runtime/default" or str(value).startswith("localhost/")
        if key.startswith(_APPARMOR_ANNOTATION) and not allowed:
            yield f"annotation {key}: AppArmor profile {value!r}"
    yield from _pod_profiles(pod, "pod securityContext")
    for sysctl in pod.get("sysctls") or []:
        if sysctl.get("name") not in SAFE_SYSCTLS:
            yield f"securityContext.sysctls: {sysctl.get('name')!r} is not a safe sysctl"
    user_namespace = spec.get("hostUsers") is False
    for where, container in _containers(spec):
        context = _context(container)
        if (context.get("windowsOptions") or {}).get("hostProcess"):
            yield f"{where}: a HostProcess container"
        if context.get("privileged"):
            yield f"{where}: privileged"
        added = set((context.get("capabilities") or {}).get("add") or [])
        if added - BASELINE_CAPABILITIES:
            yield f"{where}: adds capabilities {sorted(added - BASELINE_CAPABILITIES)}"
        for port in container.get("ports") or []:
            if port.get("hostPort"):
                yield f"{where}: hostPort {port['hostPort']}"
        if context.get("procMount", "Default") != "Default" and not user_namespace:
            yield f"{where}: procMount {context['procMount']}"
        yield from _pod_profiles(context, where)
        for handler in _handlers(container):
            for action in ("httpGet", "tcpSocket"):
                if (handler.get(action) or {}).get("host"):
                    yield f"{where}: a probe or hook's {action}.host"


def _handlers(container: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    for probe in _HANDLERS:
        if container.get(probe):
            yield container[probe]
    lifecycle = container.get("lifecycle") or {}
    for hook in ("postStart", "preStop"):
        if lifecycle.get(hook):
            yield lifecycle[hook]


def _pod_profiles(context: Mapping[str, Any], where: str) -> Iterator[str]:
    """Baseline's seccomp, AppArmor and SELinux rules, pod or container level."""
    for field in ("seccompProfile", "appArmorProfile"):
        kind = (context.get(field) or {}).get("type")
        if kind is not None and kind not in PROFILES:
            yield f"{where}: {field} {kind}"
    selinux = context.get("seLinuxOptions") or {}
    if selinux.get("type", "") not in SELINUX_TYPES:
        yield f"{where}: seLinuxOptions.type {selinux['type']!r}"
    for field in ("user", "role"):
        if selinux.get(field):
            yield f"{where}: seLinuxOptions.{field}"


def _restricted(spec: Mapping[str, Any]) -> Iterator[str]:
    pod = _context(spec)
    for volume in spec.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if kinds - RESTRICTED_VOLUMES:
            yield f"volumes[{volume.get('name', '?')}]: type {sorted(kinds)[0]}"
    user_namespace = spec.get("hostUsers") is False
    windows = (spec.get("os") or {}).get("name") == "windows"
    pod_non_root = pod.get("runAsNonRoot")
    if not user_namespace and pod.get("runAsUser") == 0:
        yield "securityContext.runAsUser: 0"
    pod_seccomp = (pod.get("seccompProfile") or {}).get("type")
    if pod_non_root is False and not user_namespace:
        yield "securityContext.runAsNonRoot: false"
    for where, container in _containers(spec):
        context = _context(container)
        if context.get("procMount", "Default") != "Default":
            yield f"{where}: procMount {context['procMount']}"
        if not user_namespace:
            non_root = context.get("runAsNonRoot")
            if non_root is False or (non_root is None and pod_non_root is not True):
                yield f"{where}: runAsNonRoot is not true (here or on the pod)"
            if context.get("runAsUser") == 0:
                yield f"{where}: runAsUser 0"
        if windows:  # Linux-only controls (the plugin skips them for Windows pods)
            continue
        if context.get("allowPrivilegeEscalation") is not False:
            yield f"{where}: allowPrivilegeEscalation is not false"
        seccomp = (context.get("seccompProfile") or {}).get("type")
        if seccomp is None and pod_seccomp not in PROFILES:
            yield f"{where}: no seccompProfile (here or on the pod)"
        capabilities = context.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            yield f"{where}: capabilities.drop lacks ALL"
        added = set(capabilities.get("add") or []) - {"NET_BIND_SERVICE"}
        if added:
            yield f"{where}: adds capabilities {sorted(added)} (restricted: NET_BIND_SERVICE)"


def violations(pod: Mapping[str, Any], level: str) -> list[str]:
    """What of ``level`` the pod (``{"metadata": ..., "spec": ...}``) breaks."""
    if level not in LEVELS:
        raise ValueError(f"Pod Security level {level!r}: one of {', '.join(LEVELS)}")
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    found: list[str] = []
    if level in ("baseline", "restricted"):
        found += _baseline(meta, spec)
    if level == "restricted":
        found += _restricted(spec)
    return found


def needed_level(pod: Mapping[str, Any]) -> str:
    """The least level that admits the pod."""
    return next(level for level in reversed(LEVELS) if not violations(pod, level))


def pod_of(manifest: Mapping[str, Any]) -> dict[str, Any] | None:
    """The pod a manifest makes (``metadata`` and ``spec``): a Pod's own, a Job's,
    Deployment's and other workloads' template, a CronJob's Job's; None for the rest."""
    kind = manifest.get("kind")
    spec = manifest.get("spec") or {}
    if kind == "Pod":
        return {"metadata": manifest.get("metadata") or {}, "spec": spec}
    if kind == "CronJob":
        spec = (spec.get("jobTemplate") or {}).get("spec") or {}
    template = spec.get("template") or {}
    if kind in ("Job", "CronJob", "Deployment", "StatefulSet", "DaemonSet", "ReplicaSet"):
        return {"metadata": template.get("metadata") or {}, "spec": template.get("spec") or {}}
    return None


def enforced_level(namespace: Mapping[str, Any]) -> str:
    """The level a Namespace's ``enforce`` label declares; privileged without one."""
    level = ((namespace.get("metadata") or {}).get("labels") or {}).get(ENFORCE, "privileged")
    if level not in LEVELS:
        raise ValueError(f"{ENFORCE}={level!r}: one of {', '.join(LEVELS)}")
    return str(level)
