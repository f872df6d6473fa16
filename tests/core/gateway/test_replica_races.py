"""Admission across replicas when they come and go mid-pause (issue 46): a replica that
starts while the trainer holds calls out holds them too, one killed with a call in flight
stops counting once its lease is over, and a resume before the drain leaves the next
pause waiting for that call. Real gateway processes over a real PostgreSQL."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import openai

from agl.core.contracts.records import Rollout
from agl.testing.fake_vllm import FakeVllm
from agl.testing.postgres import PASSWORD, PostgresServer
from agl.testing.processes import GatewayProcess, gateway_process

from .test_replicas import admin_of, ask, fake_endpoint, in_thread, running, wait_for

# How long the fake takes over the call in flight at a pause: past the kill below.
SLOW_S = 4.0


def ask_or_lost(gateway: GatewayProcess, rollout: Rollout, content: str) -> str | None:
    """``ask``, or None where its replica died under the call."""
    try:
        return ask(gateway, rollout, content)
    except openai.APIConnectionError:
        return None


def test_replicas_that_come_and_go_while_paused(
    tmp_path: Path, postgres: PostgresServer, upstream: tuple[str, FakeVllm], fake: FakeVllm
) -> None:
    secret = tmp_path / "store-password"
    secret.write_text(PASSWORD)
    settings: dict[str, Any] = {
        "store": postgres.create_database(),
        "store_password_file": secret,
        "replica_heartbeat_s": 0.25,
        "replica_lease_s": 1.5,
    }
    with (
        gateway_process(tmp_path / "a", **settings) as a,
        gateway_process(tmp_path / "b", **settings) as b,
        admin_of(a) as on_a,
    ):
        on_a.register_models([{"model": "policy", "endpoint": upstream[0], "policy_version": 3}])
        slow, held = running(on_a), running(on_a)
        slow_until = 0.0
        try:
            fake.delay_s = SLOW_S
            slow_until = time.monotonic() + SLOW_S
            first, first_out = in_thread(lambda: ask_or_lost(b, slow, "slow"))
            wait_for(lambda: on_a.admission().in_flight == 1, "A sees B's call in flight")
            assert not on_a.pause(timeout_s=0.2).drained
            # Resumed before the drain, paused again: the call still counts.
            on_a.resume()
            assert not on_a.pause(timeout_s=0.2).drained
            b.kill()  # with its call in flight: it stops counting past its lease
            assert on_a.pause(timeout_s=20).drained
            first.join(timeout=30)
            assert first_out == [None]  # its harness lost the connection
            fake.delay_s = 0.0
            # A replica that starts now, on the same store, joins paused.
            with gateway_process(tmp_path / "c", **settings) as c, admin_of(c) as on_c:
                at_c, c_out = in_thread(lambda: ask(c, held, "held at C"))
                wait_for(lambda: on_c.admission().waiting == 1, "C holds its call")
                assert not c_out and on_c.admission().state == "paused"
                on_c.register_models(
                    [{"model": "policy", "endpoint": fake_endpoint(on_c), "policy_version": 4}]
                )
                assert on_c.resume().state == "running"
                at_c.join(timeout=30)
                assert c_out
                (call,) = on_a.get_events(held.rollout_id, type="model_request")
                assert call.data["policy_version"] == 4
        finally:
            fake.delay_s = 0.0
            # The killed replica's call is still asleep in the shared fake: let it end
            # here, not in a later test (it would take that test's scripted reply).
            time.sleep(max(0.0, slow_until - time.monotonic()))
