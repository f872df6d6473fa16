"""Collocated async: pause drains in-flight calls; calls arriving while paused wait."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import openai

from agl.core.client import GatewayClient
from agl.core.contracts.records import Rollout
from agl.core.ports import free_port
from agl.testing.fake_vllm import FakeVllm, reply_for
from agl.testing.processes import GatewayProcess, gateway_process
from tests.conftest import base_url

MESSAGES = [{"role": "user", "content": "hi"}]


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def call_in_thread(
    gateway: GatewayProcess, r: Rollout, stream: bool, out: list
) -> threading.Thread:
    def run() -> None:
        client = openai.OpenAI(
            base_url=base_url(gateway, r), api_key=r.attempt_key, max_retries=0, timeout=30
        )
        answer = client.chat.completions.create(model="policy", messages=MESSAGES, stream=stream)
        text = (
            "".join(c.choices[0].delta.content or "" for c in answer if c.choices)
            if stream
            else answer.choices[0].message.content
        )
        out.append((text, time.monotonic()))

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_pause_waits_for_in_flight_calls_then_holds_new_ones(
    gateway: GatewayProcess, admin: GatewayClient, running: Callable[..., Rollout], fake: FakeVllm
) -> None:
    fake.delay_s = 1.0
    in_flight: list = []
    first = [running(), running()]
    threads = [
        call_in_thread(gateway, r, stream, in_flight)
        for r, stream in zip(first, (False, True), strict=True)
    ]
    wait_until(lambda: len(fake.requests) == 2)  # both calls are at the upstream
    assert admin.admission().in_flight == 2
    try:
        paused = admin.pause()
        # pause returned only once both in-flight calls had completed and been recorded
        assert (paused.in_flight, paused.drained) == (0, True)
        for r in first:
            assert len(admin.get_events(r.rollout_id, type="model_request")) == 1
        for t in threads:
            t.join(timeout=10)
        assert [text for text, _ in in_flight] == [reply_for(MESSAGES)] * 2

        fake.delay_s = 0.0
        waiting: list = []
        late = [call_in_thread(gateway, running(), stream, waiting) for stream in (False, True)]
        wait_until(lambda: admin.admission().waiting == 2)
        time.sleep(0.3)
        assert waiting == []  # held at the gate, neither refused nor answered
        assert admin.admission().in_flight == 0 and len(fake.requests) == 2
    finally:
        resumed_at = time.monotonic()
        admin.resume()
    for t in late:
        t.join(timeout=10)
    # The harness never saw the switch: a normal answer, just later.
    assert [text for text, _ in waiting] == [reply_for(MESSAGES)] * 2
    assert all(done >= resumed_at for _, done in waiting)


def test_pause_with_timeout_reports_not_drained(
    gateway: GatewayProcess, admin: GatewayClient, running: Callable[..., Rollout], fake: FakeVllm
) -> None:
    fake.delay_s = 1.0
    out: list = []
    thread = call_in_thread(gateway, running(), False, out)
    wait_until(lambda: len(fake.requests) == 1)
    try:
        state = admin.pause(timeout_s=0.1)
        assert (state.state, state.drained, state.in_flight) == ("paused", False, 1)
    finally:
        admin.resume()
    thread.join(timeout=10)
    assert out


def test_weights_updated_while_paused_are_used_by_waiting_calls(
    gateway: GatewayProcess,
    admin: GatewayClient,
    running: Callable[..., Rollout],
    upstream,
    fake: FakeVllm,
) -> None:
    """A call that waited through a weight update records the new policy_version."""
    r = running()
    out: list = []
    try:
        admin.pause()
        thread = call_in_thread(gateway, r, False, out)
        wait_until(lambda: admin.admission().waiting == 1)
        admin.register_models([{"model": "policy", "endpoint": upstream[0], "policy_version": 4}])
    finally:
        admin.resume()
    thread.join(timeout=10)
    try:
        (event,) = admin.get_events(r.rollout_id, type="model_request")
        assert event.data["policy_version"] == 4
    finally:
        admin.register_models([{"model": "policy", "endpoint": upstream[0], "policy_version": 3}])


def test_a_harness_that_hangs_up_mid_stream_leaves_no_call_in_flight(
    gateway: GatewayProcess, admin: GatewayClient, running: Callable[..., Rollout], fake: FakeVllm
) -> None:
    import httpx

    r = running()
    body = {"model": "policy", "messages": MESSAGES, "stream": True}
    fake.chunk_delay_s = 0.2
    with httpx.stream(
        "POST",
        base_url(gateway, r) + "/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {r.attempt_key}"},
        timeout=10,
    ) as s:
        lines = s.iter_lines()
        assert next(lines).startswith("data: ")  # the stream has begun ...
        assert admin.admission().in_flight == 1
    # ... and the harness hung up (closing the response) long before its end.
    deadline = time.monotonic() + 30
    while admin.admission().in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert admin.admission().in_flight == 0
    try:
        assert admin.pause(timeout_s=5).drained
    finally:
        admin.resume()


def test_a_restarted_gateway_keeps_admission_paused_until_resumed(
    tmp_path: Path, upstream: tuple[str, FakeVllm]
) -> None:
    """Killed -9 while the trainer updates weights, the gateway comes back paused: calls
    wait for the trainer's resume, as they would have at the gateway that died."""
    port = free_port()
    with gateway_process(tmp_path, port=port) as gw, GatewayClient(gw.url, gw.token) as admin:
        admin.register_models([{"model": "policy", "endpoint": upstream[0]}])
        admin.create_rollouts([{"rollout_id": "r"}])
        r = admin.patch_rollout("r", "running")
        assert admin.pause().state == "paused"
        gw.kill()
    with gateway_process(tmp_path, port=port) as gw, GatewayClient(gw.url, gw.token) as admin:
        assert admin.admission().state == "paused"
        out: list = []
        caller = call_in_thread(gw, r, stream=False, out=out)
        wait_until(lambda: admin.admission().waiting == 1)
        resumed = time.monotonic()
        assert admin.resume().state == "running"
        caller.join(timeout=30)
        assert out and out[0][0] == reply_for(MESSAGES) and out[0][1] >= resumed
    with gateway_process(tmp_path, port=port) as gw, GatewayClient(gw.url, gw.token) as admin:
        assert admin.admission().state == "running"
