"""The client retries blindly, which is safe because every endpoint is idempotent."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from agl.core.client import AsyncGatewayClient, GatewayClient, GatewayError
from agl.core.contracts.records import EventIn
from agl.testing.processes import free_port, gateway_process


def test_retries_connection_errors_until_the_gateway_is_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()
    # 20 tries wait 35 s at least: a gateway starting on a busy machine takes a while.
    client = GatewayClient(f"http://127.0.0.1:{port}", "tok", retries=20, backoff_s=0.1)

    def start_late() -> None:
        time.sleep(0.5)
        with gateway_process(tmp_path, token="tok", port=port):
            done.wait(30)

    done = threading.Event()
    thread = threading.Thread(target=start_late)
    thread.start()
    try:
        (r,) = client.create_rollouts([{"rollout_id": "late"}])
        assert r.rollout_id == "late"
        assert any("ConnectError" in m and "retrying" in m for m in caplog.messages)
    finally:
        done.set()
        thread.join()
        client.close()


def test_gives_up_after_its_retries(tmp_path: Path) -> None:
    client = GatewayClient(f"http://127.0.0.1:{free_port()}", "tok", retries=2, backoff_s=0.01)
    with pytest.raises(httpx.ConnectError):
        client.list_models()


def test_retries_5xx_and_stops_on_4xx() -> None:
    seen: list[str] = []

    def flaky(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        if len(seen) < 3:
            return httpx.Response(503, json={"error": {"message": "busy"}})
        if request.url.path == "/api/models":
            return httpx.Response(200, json=[])
        return httpx.Response(409, json={"error": {"message": "no"}, "current": None})

    client = GatewayClient("http://gw", "tok", retries=5, backoff_s=0.001)
    client._http = httpx.Client(base_url="http://gw", transport=httpx.MockTransport(flaky))
    assert client.list_models() == []
    assert len(seen) == 3
    with pytest.raises(GatewayError) as refused:
        client.get_rollout("x")
    assert refused.value.status == 409 and len(seen) == 4  # a 4xx is final, not retried


def test_a_retried_event_post_appends_once(tmp_path: Path) -> None:
    """The client fixes event ids before the first try, so a lost answer costs nothing."""
    with gateway_process(tmp_path) as gw, GatewayClient(gw.url, gw.token) as admin:
        admin.create_rollouts([{"rollout_id": "r"}])
        admin.patch_rollout("r", "running")
        from agl.core.client import _Calls

        call = _Calls.post_events("r", 1, [EventIn(type="reward", data={"value": 1.0})])
        first = admin._send(call)
        again = admin._send(call)  # the same request, as a retry would send it
        assert first == again
        assert len(admin.get_events("r")) == 1


def test_async_client_round_trip(tmp_path: Path) -> None:
    import asyncio

    async def main(url: str, token: str) -> None:
        async with AsyncGatewayClient(url, token) as client:
            (r,) = await client.create_rollouts([{"rollout_id": "a", "group_id": "g"}])
            await client.patch_rollout("a", "running")
            await client.post_reward("a", 1, 0.25)
            assert [e.data for e in await client.get_events("a")] == [{"value": 0.25}]
            done = await client.patch_attempt("a", 1, "succeeded")
            assert done.status == "succeeded" and done.version == r.version + 2
            assert [x.rollout_id for x in await client.list_rollouts("succeeded")] == ["a"]
            assert (await client.pause()).state == "paused"
            assert (await client.resume()).state == "running"

    with gateway_process(tmp_path) as gw:
        asyncio.run(main(gw.url, gw.token))
