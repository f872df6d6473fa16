"""What the trainer needs of an inference engine, whichever serves the policy: the
embedded server (``inference=embedded``) or vLLM replicas (``inference=vllm``)."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol


class ServingStats(Protocol):
    tokens_generated: int  # cumulative
    busy_s: float  # cumulative time spent generating


class InferenceService(Protocol):
    """Serves the trainer's policy over OpenAI-compatible HTTP.

    Invariants: after ``publish(v)`` returns, every endpoint answers with the weights the
    trainer's module held when ``publish`` was called, and the trainer registers each
    endpoint at the gateway as ``policy_version=v``. Every endpoint refuses (401) a
    request without the run's inference key, its health check excepted: only the gateway
    and the trainer hold the key, so every sample an agent gets went through the proxy.
    """

    @property
    def endpoints(self) -> list[str]:
        """OpenAI base URLs (ending ``/v1``), one per replica."""
        ...

    @property
    def stats(self) -> ServingStats | None: ...

    def start(self) -> InferenceService: ...

    def publish(self, policy_version: int) -> None:
        """Serve the module's current weights as ``policy_version``; blocks until they do."""
        ...

    def paused(self) -> AbstractContextManager[None]:
        """No generation reads the weights while this is held (an update in place)."""
        ...

    def close(self) -> None: ...
