"""Two gateway processes over one real PostgreSQL store serve the same rollouts: what one
records the other reads; kill -9 of one loses nothing it acknowledged and the other
replays its lost answer; admission pauses and resumes both; idempotent writes and the
per-attempt rate limit hold across them."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from agl.core.client import GatewayClient, proxy_base_url
from agl.core.contracts.records import EventIn, Rollout
from agl.testing.fake_vllm import FakeVllm
from agl.testing.postgres import PASSWORD, PostgresServer
from agl.testing.processes import GatewayProcess, gateway_process
from tests.helpers.lost_answers import BIG, content_of, post_and_never_read, vllm_answer

Pair = tuple[GatewayProcess, GatewayProcess]


@contextmanager
def replicas(
    folder: Path, server: PostgresServer, count: int = 2, **options: object
) -> Iterator[list[GatewayProcess]]:
    """``count`` gateway processes on one new database of ``server``."""
    secret = folder / "store-password"
    secret.write_text(PASSWORD)
    url = server.create_database()
    settings: dict[str, Any] = {
        "store": url,
        "store_password_file": secret,
        "replica_heartbeat_s": 0.25,
        "upstream_backoff_s": 0.01,
        **options,
    }
    with ExitStack() as stack:
        yield [
            stack.enter_context(gateway_process(folder / f"replica{i}", **settings))
            for i in range(count)
        ]


@pytest.fixture(scope="module")
def pair(
    tmp_path_factory: pytest.TempPathFactory,
    postgres: PostgresServer,
    upstream: tuple[str, FakeVllm],
) -> Iterator[Pair]:
    with replicas(tmp_path_factory.mktemp("replicas"), postgres) as (a, b):
        with GatewayClient(a.url, a.token) as admin:
            admin.register_models(
                [{"model": "policy", "endpoint": upstream[0], "policy_version": 3}]
            )
        yield a, b


def admin_of(gateway: GatewayProcess) -> GatewayClient:
    return GatewayClient(gateway.url, gateway.token, retries=0)


def agent(gateway: GatewayProcess, rollout: Rollout) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=proxy_base_url(gateway.url, rollout.rollout_id, rollout.attempt),
        api_key=rollout.attempt_key,
        max_retries=0,
        timeout=60,
    )


def ask(gateway: GatewayProcess, rollout: Rollout, content: str) -> str:
    answer = agent(gateway, rollout).chat.completions.create(
        model="policy", messages=[{"role": "user", "content": content}]
    )
    return answer.choices[0].message.content or ""


def running(admin: GatewayClient, **spec: object) -> Rollout:
    rollout_id = f"r-{uuid.uuid4().hex[:12]}"
    admin.create_rollouts([{"rollout_id": rollout_id, **spec}])
    return admin.patch_rollout(rollout_id, "running")


def test_rollouts_made_on_one_replica_are_driven_and_read_through_both(pair: Pair) -> None:
    a, b = pair
    with admin_of(a) as on_a, admin_of(b) as on_b:
        rollouts = [running(on_a) for _ in range(3)]
        for r in rollouts:
            for turn, gateway in enumerate((a, b, a, b)):
                ask(gateway, r, f"{r.rollout_id} turn {turn}")
            reporter = GatewayClient(b.url, r.report_key or "", retries=0)
            reporter.post_events(r.rollout_id, 1, [EventIn(type="step", data={"n": 1})])
            reporter.post_reward(r.rollout_id, 1, 0.5)
            reporter.patch_attempt(r.rollout_id, 1, "succeeded")
        for admin in (on_a, on_b):
            for r in rollouts:
                assert admin.get_rollout(r.rollout_id).status == "succeeded"
                events = admin.get_events(r.rollout_id)
                calls = [e for e in events if e.type == "model_request"]
                assert [c.data["messages"][0]["content"] for c in calls] == [
                    f"{r.rollout_id} turn {t}" for t in range(4)
                ]
                assert all(c.data["policy_version"] == 3 for c in calls)
                assert [e.type for e in events[4:]] == ["step", "reward"]
                (history, _) = admin.transitions(r.rollout_id)
                assert [t.status for t in history] == ["running", "succeeded"]
            rows, _ = admin.summaries()
            by_id = {row.rollout.rollout_id: row.summary for row in rows}
            for r in rollouts:
                summary = by_id[r.rollout_id]
                assert summary is not None and (summary.calls, summary.rewards) == (4, 1)
                assert summary.reward == 0.5


def test_the_same_ids_sent_to_both_replicas_are_stored_once(pair: Pair) -> None:
    a, b = pair
    rollout_id = f"same-{uuid.uuid4().hex[:8]}"
    event = EventIn(event_id="once", type="step", data={"n": 1})
    created: list[Rollout] = []
    posted: list[Any] = []

    def both(work: Callable[[GatewayProcess], None]) -> None:
        threads = [threading.Thread(target=work, args=(g,)) for g in (a, b) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)

    def create(gateway: GatewayProcess) -> None:
        with admin_of(gateway) as admin:
            created.extend(admin.create_rollouts([{"rollout_id": rollout_id}]))

    both(create)
    assert len(created) == 6 and {(r.version, r.created_at) for r in created} == {
        (1, created[0].created_at)
    }
    with admin_of(a) as admin:
        admin.patch_rollout(rollout_id, "running")

    def post(gateway: GatewayProcess) -> None:
        with admin_of(gateway) as admin:
            posted.extend(admin.post_events(rollout_id, 1, [event]))

    both(post)
    assert len({(e.event_id, e.sequence) for e in posted}) == 1
    for gateway in (a, b):
        with admin_of(gateway) as admin:
            assert [r.rollout_id for r in admin.list_rollouts() if r.rollout_id == rollout_id] == [
                rollout_id
            ]
            assert [e.event_id for e in admin.get_events(rollout_id)] == ["once"]
            rows, _ = admin.summaries()
            (summary,) = [row.summary for row in rows if row.rollout.rollout_id == rollout_id]
            assert summary is not None and summary.events == 1


def in_thread(work: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(work()))
    thread.start()
    return thread, out


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)


def test_admission_pauses_and_resumes_every_replica(pair: Pair, fake: FakeVllm) -> None:
    a, b = pair
    with admin_of(a) as on_a, admin_of(b) as on_b:
        slow, held_b, held_a = (running(on_a) for _ in range(3))
        try:
            fake.delay_s = 3.0  # long enough for B to report it in flight
            first, first_out = in_thread(lambda: ask(b, slow, "slow"))
            wait_for(lambda: on_a.admission().in_flight == 1, "A sees B's call in flight")
            paused = on_a.pause(timeout_s=0.2)
            assert (paused.state, paused.in_flight, paused.drained) == ("paused", 1, False)
            fake.delay_s = 0.0
            at_b, b_out = in_thread(lambda: ask(b, held_b, "held at B"))
            at_a, a_out = in_thread(lambda: ask(a, held_a, "held at A"))
            wait_for(
                lambda: (s := on_b.admission()).waiting == 2 and s.in_flight == 0,
                "both calls held, B's first call over",
            )
            first.join(timeout=30)
            assert first_out and not a_out and not b_out
            drained = on_a.pause(timeout_s=10)
            assert (drained.drained, drained.in_flight, drained.waiting) == (True, 0, 2)
            # The trainer registers the new weights, then resumes, through the other replica.
            on_b.register_models(
                [{"model": "policy", "endpoint": fake_endpoint(on_b), "policy_version": 4}]
            )
            assert on_b.resume().state == "running"
            at_a.join(timeout=30)
            at_b.join(timeout=30)
            assert a_out and b_out
            for r, version in ((slow, 3), (held_a, 4), (held_b, 4)):
                (call,) = on_a.get_events(r.rollout_id, type="model_request")
                assert call.data["policy_version"] == version, r.rollout_id
        finally:
            fake.delay_s = 0.0
            on_a.resume()
            on_a.register_models(
                [{"model": "policy", "endpoint": fake_endpoint(on_a), "policy_version": 3}]
            )


def fake_endpoint(admin: GatewayClient) -> str:
    (model,) = admin.list_models()
    return model.endpoint


def test_kill_9_of_one_replica_loses_nothing_and_the_other_replays_its_lost_answer(
    tmp_path: Path, postgres: PostgresServer, upstream: tuple[str, FakeVllm], fake: FakeVllm
) -> None:
    with replicas(tmp_path, postgres, replica_lease_s=2.0) as (a, b), admin_of(b) as on_b:
        on_b.register_models([{"model": "policy", "endpoint": upstream[0], "policy_version": 7}])
        # A records a call whose (big) answer its harness never reads: pending when it dies.
        lost = running(on_b)
        body = orjson.dumps({"model": "policy", "messages": [{"role": "user", "content": "hi"}]})
        path = proxy_base_url("", lost.rollout_id, 1).removesuffix("/openai/v1")
        path += "/openai/v1/chat/completions"
        fake.raw_next = [vllm_answer(BIG)]
        harness = post_and_never_read(a.url, path, lost.attempt_key or "", body)
        wait_for(lambda: bool(on_b.get_events(lost.rollout_id)), "the lost call recorded")

        acked: dict[str, set[str]] = {}
        lock = threading.Lock()
        stop = threading.Event()
        failures: list[Exception] = []  # B must answer every request

        def writer(worker: int) -> None:
            n = 0
            while not stop.is_set():
                gateway = (a, b)[(worker + n) % 2]
                n += 1
                try:
                    with admin_of(gateway) as admin:
                        r = running(admin)
                        with lock:
                            acked[r.rollout_id] = set()
                        ask(gateway, r, r.rollout_id)
                        with lock:
                            acked[r.rollout_id].add("call")
                        admin.post_events(r.rollout_id, 1, [EventIn(event_id="e", type="step")])
                        with lock:
                            acked[r.rollout_id].add("e")
                except (httpx.HTTPError, openai.APIError, OSError) as error:
                    if gateway is b:
                        failures.append(error)
                        return
                    # A died under this request: the next goes to B

        threads = [threading.Thread(target=writer, args=(w,)) for w in range(2)]
        for t in threads:
            t.start()
        wait_for(lambda: sum("e" in v for v in acked.values()) >= 6, "some traffic acknowledged")
        a.kill()
        served = len(acked)
        wait_for(lambda: len(acked) >= served + 4, "B serving on after the kill")
        stop.set()
        for t in threads:
            t.join(timeout=60)
        harness.close()
        assert not failures

        for rollout_id, done in acked.items():
            events = on_b.get_events(rollout_id)
            calls = [e for e in events if e.type == "model_request"]
            if "call" in done:
                assert len(calls) == 1 and calls[0].data["policy_version"] == 7, rollout_id
            if "e" in done:
                assert "e" in {e.event_id for e in events}, rollout_id

        # The harness retries at B: once A's lease is over, B replays A's recorded answer.
        headers = {
            "Authorization": f"Bearer {lost.attempt_key}",
            "Content-Type": "application/json",
        }
        retry = httpx.post(b.url + path, content=body, headers=headers, timeout=60)
        assert retry.status_code == 200 and retry.headers.get("idempotent-replayed") == "true"
        assert content_of(retry) == BIG
        (call,) = on_b.get_events(lost.rollout_id, type="model_request")
        assert call.data["response"] == BIG


def test_one_attempt_key_gets_one_rate_across_replicas(
    tmp_path: Path, postgres: PostgresServer, upstream: tuple[str, FakeVllm]
) -> None:
    burst = 5
    with (
        replicas(tmp_path, postgres, attempt_rps=0.001, attempt_burst=burst) as (a, b),
        admin_of(a) as admin,
    ):
        admin.register_models([{"model": "policy", "endpoint": upstream[0]}])
        r = running(admin)
        outcomes = []
        for n in range(2 * burst):
            try:
                ask((a, b)[n % 2], r, f"call {n}")
                outcomes.append("ok")
            except openai.RateLimitError:
                outcomes.append("429")
        assert outcomes == ["ok"] * burst + ["429"] * burst
        assert len(admin.get_events(r.rollout_id, type="model_request")) == burst
