"""Executors: how a rollout attempt runs (``local`` processes, ``k8s`` Jobs)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agl.core.contracts.execution import Executor


def make_executor(
    kind: str,
    settings: Mapping[str, Any],
    *,
    harness: str,
    run_dir: Path,
    agent_gateway_url: str,
    extra_pythonpath: Sequence[str] = (),
    base_dir: Path | None = None,
    grader: str | None = None,
) -> Executor:
    """The executor ``kind`` names, ``settings`` being fields of its config; ValueError
    (one line) when they are wrong or the ``k8s`` extra is not installed. ``grader``: the
    task's (agl/grading/)."""
    # Imported here: the Kubernetes client is an optional extra.
    try:
        if kind == "k8s":
            try:
                from agl.backends.execution.k8s.config import K8sExecutorConfig
                from agl.backends.execution.k8s.executor import K8sExecutor
            except ImportError as error:
                raise ValueError(
                    f"the k8s executor needs: pip install 'agl[k8s]' (no module {error.name!r})"
                ) from None
            config = K8sExecutorConfig(
                agent_gateway_url=agent_gateway_url, grader=grader, **settings
            )
            return K8sExecutor(config, base_dir=base_dir)
        if kind == "local":
            from agl.backends.execution.local.config import LocalExecutorConfig
            from agl.backends.execution.local.executor import LocalExecutor

            return LocalExecutor(
                LocalExecutorConfig(
                    harness=harness,
                    run_dir=run_dir,
                    extra_pythonpath=list(extra_pythonpath),
                    grader=grader,
                    **settings,
                )
            )
    except TypeError as error:  # an option the config does not have
        raise ValueError(str(error)) from None
    raise ValueError(f"unknown executor {kind!r}: choose local or k8s")
