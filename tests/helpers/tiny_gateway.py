"""The embedded inference server on the tiny model behind a real gateway, as pytest
fixtures (``tiny``, ``tiny_admin``: import them into the test module) and a running
rollout on it."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from agl.core.client import GatewayClient
from agl.core.contracts.records import Rollout
from agl.testing.processes import GatewayProcess, gateway_process, serve_process
from tests.conftest import vllm_text


@dataclass(frozen=True)
class Tiny:
    gateway: GatewayProcess
    url: str  # the server's OpenAI base URL
    model: str
    tokenizer: Any

    def text(self, ids: list[int]) -> str:
        return vllm_text(self.tokenizer, ids)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tiny]:
    from agl.backends.inference.models import load_model

    tokenizer = load_model("tiny").tokenizer
    with (
        serve_process("tiny", max_context=1024) as server,
        gateway_process(tmp_path_factory.mktemp("tiny_gateway")) as gw,
        GatewayClient(gw.url, gw.token) as client,
    ):
        client.register_models([{"model": server.model, "endpoint": server.url}])
        yield Tiny(gw, server.url, server.model, tokenizer)


@pytest.fixture
def tiny_admin(tiny: Tiny) -> Iterator[GatewayClient]:
    with GatewayClient(tiny.gateway.url, tiny.gateway.token) as client:
        yield client


def start(admin: GatewayClient) -> Rollout:
    rollout_id = f"tiny-{uuid.uuid4().hex[:12]}"
    admin.create_rollouts([{"rollout_id": rollout_id, "group_id": "g", "input": {}}])
    return admin.patch_rollout(rollout_id, "running")
