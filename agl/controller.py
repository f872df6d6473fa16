"""``python -m agl.controller executor=k8s gateway_url=http://agl-gateway:8000 ...``

The controller's command, apart from its package (``agl/core/controller/``, the reconcile
loop the trainer also runs in process) because ``python -m agl.controller`` is the public
command (the deploy manifests'), and a package's ``__main__`` could only give
``python -m agl.core.controller``.

The rollout controller as a service of its own (a Deployment next to the gateway): it
launches every queued rollout of the gateway as a Kubernetes Job (``executor=k8s``) or
a local process (``executor=local``). The admin token comes from ``AGL_ADMIN_TOKEN``.
One controller per gateway: a restarted one adopts the Jobs its predecessor started.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agl.core.command_line import parse_or_exit

if TYPE_CHECKING:
    from agl.core.contracts.execution import Executor

log = logging.getLogger("agl.controller")


@dataclass
class ControllerConfig:
    """Options of ``python -m agl.controller key=value ...``."""

    gateway_url: str = "http://127.0.0.1:8000"
    agent_gateway_url: str = ""  # how agents reach the gateway; default: gateway_url
    model: str = ""  # the model name agents ask the proxy for
    executor: str = "k8s"  # k8s | local
    # k8s
    namespace: str = "default"
    kubeconfig: str = ""  # empty: in-cluster, else ~/.kube/config
    template: str = ""  # the agent Job template (YAML / Jinja2)
    instance: str = "agl"
    max_jobs: int = 100
    create_qps: float = 20.0
    create_burst: int = 20
    relist_s: float = 30.0
    ttl_after_finished_s: int = 600
    egress: bool = True  # create the agents' egress NetworkPolicy
    egress_allow: str = ""  # comma-separated CIDRs agents may reach besides the gateway
    # local
    harness: str = ""  # module:function | command:...
    grader: str = ""  # module:function posting each attempt's reward (agl/grading/)
    workers: int = 2
    concurrency: int = 64
    run_dir: str = "runs/controller"
    # both
    poll_s: float = 0.05
    reconcile_s: float = 30.0
    log_level: str = "info"

    def __post_init__(self) -> None:
        if self.executor not in ("k8s", "local"):
            raise ValueError(f"executor={self.executor!r}: choose k8s or local")
        if self.executor == "k8s" and not self.template:
            raise ValueError("executor=k8s needs template=PATH (the agent Job template)")
        if self.executor == "local" and not self.harness:
            raise ValueError("executor=local needs harness=module:function or command:...")
        if not self.model:
            raise ValueError("model=NAME is required: the model agents ask the proxy for")


def build_executor(config: ControllerConfig) -> Executor:
    """The executor the options describe; ValueError (one line) if they are wrong."""
    from agl.backends.execution import make_executor

    if config.executor == "local":
        settings: dict[str, Any] = {"workers": config.workers, "concurrency": config.concurrency}
    else:
        allow = [c.strip() for c in config.egress_allow.split(",") if c.strip()]
        settings = {
            "template": config.template,
            "namespace": config.namespace,
            "kubeconfig": config.kubeconfig or None,
            "instance": config.instance,
            "max_jobs": config.max_jobs,
            "create_qps": config.create_qps,
            "create_burst": config.create_burst,
            "relist_s": config.relist_s,
            "ttl_after_finished_s": config.ttl_after_finished_s,
            "egress": {"enabled": config.egress, "allow": allow},
        }
    return make_executor(
        config.executor,
        settings,
        harness=config.harness,
        run_dir=Path(config.run_dir),
        grader=config.grader or None,
        agent_gateway_url=config.agent_gateway_url or config.gateway_url,
    )


async def serve(config: ControllerConfig, token: str) -> None:
    from agl.core.client import AsyncGatewayClient, fast_http_client
    from agl.core.controller.reconcile import Controller

    executor = build_executor(config)
    http = fast_http_client(64, timeout_s=60.0)
    client = AsyncGatewayClient(config.gateway_url, token, http=http)
    controller = Controller(
        client,
        executor,
        gateway_url=config.agent_gateway_url or config.gateway_url,
        model=config.model,
        poll_s=config.poll_s,
        reconcile_s=config.reconcile_s,
    )
    task = asyncio.create_task(controller.run())
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    try:
        await task
    except asyncio.CancelledError:
        log.info("stopped: %s", controller.stats)
    finally:
        await http.aclose()


def main(argv: list[str] | None = None) -> None:
    config = parse_or_exit(
        ControllerConfig,
        sys.argv[1:] if argv is None else argv,
        "agl.controller",
        about=__doc__ or "",
    )
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    token = os.environ.get("AGL_ADMIN_TOKEN", "")
    if not token:
        sys.stderr.write("agl.controller: set AGL_ADMIN_TOKEN to the gateway's admin token\n")
        raise SystemExit(2)
    try:
        asyncio.run(serve(config, token))
    except ValueError as error:
        sys.stderr.write(f"agl.controller: {error}\n")
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
