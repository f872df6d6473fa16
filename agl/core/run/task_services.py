"""A task's own services (``task.services``): processes a run starts before its agents
and stops after them, such as the search task's retriever. Each is ``python -m MODULE
host=H port=P key=value ...`` on a free loopback port, healthy once ``GET /healthz``
answers 200; every input the agents get carries its URL as ``<name>_url``.

Like the gateway (``agl.core.run.services``), a service dies with the trainer: its own
process group (Ctrl-C reaches only the trainer, which stops it in order) and the
kernel's parent-death signal (``kill -9`` of the trainer).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from agl.core.ports import free_port
from agl.core.processes import die_with_parent, end_process


@dataclass(frozen=True)
class ServiceSpec:
    name: str
    module: str
    args: dict[str, Any] = field(default_factory=dict)
    start_timeout_s: float = 120.0

    @classmethod
    def of(cls, name: str, spec: Mapping[str, Any]) -> ServiceSpec:
        unknown = set(spec) - {"module", "args", "start_timeout_s"}
        if unknown or not isinstance(spec.get("module"), str) or not name.isidentifier():
            raise ValueError(
                f"task.services.{name}: a service has an identifier for a name, a 'module' "
                f"and optional 'args' and 'start_timeout_s' (not {sorted(unknown)})"
            )
        return cls(
            name,
            spec["module"],
            dict(spec.get("args") or {}),
            float(spec.get("start_timeout_s", 120.0)),
        )


class ChildService:
    """One running service; ``stop`` ends it (terminate, then kill)."""

    def __init__(self, spec: ServiceSpec, log_dir: Path, host: str = "127.0.0.1") -> None:
        self.spec = spec
        self.host = host
        self.port = free_port(host)
        self.log_path = log_dir / f"{spec.name}.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> ChildService:
        args = [f"{k}={v}" for k, v in self.spec.args.items()]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log_file:
            process = self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    self.spec.module,
                    f"host={self.host}",
                    f"port={self.port}",
                    *args,
                ],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                process_group=0,
                preexec_fn=die_with_parent(),
            )
        deadline = time.monotonic() + self.spec.start_timeout_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(
                    f"task service {self.spec.name} exited with code {process.returncode} "
                    f"(see {self.log_path})"
                )
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(
                    f"task service {self.spec.name} was not up after "
                    f"{self.spec.start_timeout_s} s (see {self.log_path})"
                )
            time.sleep(0.05)

    def stop(self) -> None:
        end_process(self.process)
