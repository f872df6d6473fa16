"""A model server that hangs, before answering or in the middle of a stream: the proxy
gives up after its read timeout, the harness gets an error in bounded time, and the call
is recorded as failed, never as something to train on."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from agl.core.client import GatewayClient, proxy_base_url
from agl.testing.fake_vllm import FakeVllm
from agl.testing.processes import GatewayProcess, gateway_process

TIMEOUT_S = 0.5
RETRIES = 1
# Long against the timeout, short enough that the shared fake server's hung handlers end
# before it is stopped (it waits 10 s for them).
HANG_S = 6.0
MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def impatient(
    tmp_path_factory: pytest.TempPathFactory, upstream: tuple[str, FakeVllm]
) -> Iterator[tuple[GatewayProcess, GatewayClient]]:
    run_dir: Path = tmp_path_factory.mktemp("impatient")
    with (
        gateway_process(
            run_dir,
            upstream_timeout_s=TIMEOUT_S,
            upstream_retries=RETRIES,
            upstream_backoff_s=0.01,
        ) as gw,
        GatewayClient(gw.url, gw.token) as admin,
    ):
        admin.register_models([{"model": "policy", "endpoint": upstream[0]}])
        yield gw, admin


def call(gw: GatewayProcess, admin: GatewayClient, rid: str, **kwargs: object) -> float:
    """Make one call that must fail; answers how long the failure took."""
    admin.create_rollouts([{"rollout_id": rid}])
    r = admin.patch_rollout(rid, "running")
    client = openai.OpenAI(
        base_url=proxy_base_url(gw.url, rid, r.attempt), api_key=r.attempt_key, max_retries=0
    )
    started = time.monotonic()
    with pytest.raises(openai.APIError):
        answer = client.chat.completions.create(model="policy", messages=MESSAGES, **kwargs)
        if kwargs.get("stream"):
            list(answer)
    return time.monotonic() - started


def test_a_hung_upstream_times_out_and_is_recorded_as_failed(
    impatient: tuple[GatewayProcess, GatewayClient], fake: FakeVllm
) -> None:
    gw, admin = impatient
    fake.delay_s = HANG_S
    took = call(gw, admin, "hung")
    assert took < HANG_S - 1
    assert admin.get_events("hung", type="model_request") == []
    (failed,) = admin.get_events("hung", type="model_request_failed")
    assert failed.data["status"] >= 500


def test_a_stream_that_stalls_is_cut_and_recorded_as_failed(
    impatient: tuple[GatewayProcess, GatewayClient], fake: FakeVllm
) -> None:
    gw, admin = impatient
    fake.chunk_delay_s = HANG_S
    try:
        took = call(gw, admin, "stalled", stream=True)
    finally:
        fake.chunk_delay_s = 0.0  # the shared fake's fixture does not reset it afterwards
    assert took < HANG_S - 1
    assert admin.get_events("stalled", type="model_request") == []
    assert len(admin.get_events("stalled", type="model_request_failed")) == 1
