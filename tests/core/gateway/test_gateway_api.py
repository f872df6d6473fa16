"""The rollout API over real HTTP: every endpoint, idempotency, transitions, auth, bad input."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import httpx
import pytest

from agl.core.client import GatewayClient, GatewayError
from agl.core.contracts.records import EventIn, Rollout, Status
from agl.testing.processes import GatewayProcess


def new_id() -> str:
    return f"r-{uuid.uuid4().hex[:12]}"


def raw(
    gateway: GatewayProcess, method: str, path: str, token: str | None = None, **kwargs: object
) -> httpx.Response:
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    return httpx.request(method, gateway.url + path, headers=headers, timeout=10, **kwargs)


def error_message(response: httpx.Response) -> str:
    body = response.json()
    assert set(body["error"]) >= {"message", "type", "code"}, body
    return body["error"]["message"]


def test_healthz_needs_no_token(gateway: GatewayProcess) -> None:
    assert raw(gateway, "GET", "/healthz").json() == {"status": "ok"}


def test_create_is_idempotent_and_returns_records(admin: GatewayClient) -> None:
    rid = new_id()
    spec = {
        "rollout_id": rid,
        "group_id": "g1",
        "input": {"question": "2+2"},
        "mode": "val",
        "metadata": {"source": "test"},
        "max_attempts": 2,
        "timeout_s": 30,
    }
    (first,) = admin.create_rollouts([spec])
    assert (first.status, first.attempt, first.version, first.mode) == (Status.QUEUING, 1, 1, "val")
    assert first.input == {"question": "2+2"} and first.metadata == {"source": "test"}
    assert first.attempt_key and first.attempt_key.startswith("agl-")
    # Same id again, even with other content: nothing changes, the stored record comes back.
    (again,) = admin.create_rollouts([{**spec, "input": "changed", "group_id": "g2"}])
    assert again == first
    assert admin.get_rollout(rid) == first


def test_batch_with_known_and_new_ids(admin: GatewayClient) -> None:
    known, new = new_id(), new_id()
    admin.create_rollouts([{"rollout_id": known}])
    admin.patch_rollout(known, "running")
    out = admin.create_rollouts([{"rollout_id": known}, {"rollout_id": new}])
    assert [(r.rollout_id, r.status) for r in out] == [(known, "running"), (new, "queuing")]


def test_state_machine_versions_and_attempts(admin: GatewayClient) -> None:
    rid = new_id()
    admin.create_rollouts([{"rollout_id": rid, "max_attempts": 2}])
    running = admin.patch_rollout(rid, "running")
    assert (running.version, running.started_at is not None) == (2, True)
    assert admin.patch_rollout(rid, "running") == running  # repeat: no-op, same version
    failed = admin.patch_rollout(rid, "failed", error="agent crashed")
    assert (failed.version, failed.error, failed.ended_at is not None) == (3, "agent crashed", True)
    requeued = admin.patch_rollout(rid, "queuing", attempt=1)
    assert (requeued.status, requeued.attempt, requeued.version) == ("queuing", 2, 4)
    assert requeued.attempt_key != running.attempt_key  # a new key for the new attempt
    # A retried re-queue of attempt 1 is a no-op, not a third attempt.
    assert admin.patch_rollout(rid, "queuing", attempt=1) == requeued
    admin.patch_rollout(rid, "running")
    admin.patch_rollout(rid, "failed")
    with pytest.raises(GatewayError) as refused:
        admin.patch_rollout(rid, "queuing")
    assert refused.value.status == 409 and "all 2 attempts" in refused.value.message
    assert refused.value.current is not None and refused.value.current.status == "failed"


@pytest.mark.parametrize(
    "path",
    [
        ["succeeded"],
        ["running", "queuing"],
        ["running", "succeeded", "failed"],
        ["failed", "running"],
    ],
)
def test_illegal_transitions_get_409_with_current_status(
    admin: GatewayClient, path: list[str]
) -> None:
    rid = new_id()
    admin.create_rollouts([{"rollout_id": rid}])
    *legal, illegal = path
    for status in legal:
        admin.patch_rollout(rid, status)
    before = admin.get_rollout(rid)
    with pytest.raises(GatewayError) as refused:
        admin.patch_rollout(rid, illegal)
    assert refused.value.status == 409
    assert refused.value.body["current"]["status"] == before.status
    assert admin.get_rollout(rid) == before


def test_list_filters_and_cursor_pagination(admin: GatewayClient, gateway: GatewayProcess) -> None:
    group = f"group-{uuid.uuid4().hex[:8]}"
    ids = [new_id() for _ in range(7)]
    admin.create_rollouts([{"rollout_id": i, "group_id": group} for i in ids])
    for i in ids[:3]:
        admin.patch_rollout(i, "running")
    everything = admin.list_rollouts(group_id=group, page_size=2)
    assert [r.rollout_id for r in everything] == ids  # creation order across 4 pages
    assert [r.rollout_id for r in admin.list_rollouts("running", group_id=group)] == ids[:3]
    both = admin.list_rollouts(["running", "queuing"], group_id=group, page_size=3)
    assert len(both) == 7
    page = raw(gateway, "GET", f"/api/rollouts?group_id={group}&limit=5", gateway.token).json()
    assert len(page["items"]) == 5 and page["next_cursor"] is not None
    rest = raw(
        gateway,
        "GET",
        f"/api/rollouts?group_id={group}&cursor={page['next_cursor']}",
        gateway.token,
    ).json()
    assert [r["rollout_id"] for r in rest["items"]] == ids[5:] and rest["next_cursor"] is None


def test_list_rejects_bad_query(gateway: GatewayProcess) -> None:
    for query in ("status=done", "limit=0", "limit=abc", "cursor=xyz"):
        response = raw(gateway, "GET", f"/api/rollouts?{query}", gateway.token)
        assert response.status_code == 422, query
        assert error_message(response)


def test_events_append_idempotently_and_read_back(
    admin: GatewayClient, running: Callable[..., Rollout]
) -> None:
    r = running()
    first = admin.post_event(r.rollout_id, 1, "note", {"n": 1}, event_id="e-1")
    again = admin.post_event(r.rollout_id, 1, "note", {"n": 999}, event_id="e-1")
    assert again == first and again.data == {"n": 1}
    admin.post_reward(r.rollout_id, 1, 0.5)
    events = admin.get_events(r.rollout_id)
    assert [e.type for e in events] == ["note", "reward"]
    assert events[1].data == {"value": 0.5}
    assert [e.type for e in admin.get_events(r.rollout_id, type="reward")] == ["reward"]
    assert admin.get_events(r.rollout_id, attempt=2) == []


def test_event_batch_and_pagination(
    admin: GatewayClient, running: Callable[..., Rollout], gateway: GatewayProcess
) -> None:
    r = running()
    batch = [EventIn(event_id=f"b{i}", type="step", data=i) for i in range(25)]
    stored = admin.post_events(r.rollout_id, 1, batch)
    assert [e.data for e in stored] == list(range(25))
    page = raw(gateway, "GET", f"/api/rollouts/{r.rollout_id}/events?limit=10", gateway.token)
    body = page.json()
    assert len(body["items"]) == 10 and body["next_cursor"]
    rest = raw(
        gateway,
        "GET",
        f"/api/rollouts/{r.rollout_id}/events?limit=10&cursor={body['next_cursor']}",
        gateway.token,
    ).json()
    assert [e["data"] for e in rest["items"]] == list(range(10, 20))
    assert [e.data for e in admin.get_events(r.rollout_id)] == list(range(25))


def test_events_for_unknown_or_stale_attempts(
    admin: GatewayClient, running: Callable[..., Rollout]
) -> None:
    with pytest.raises(GatewayError) as unknown:
        admin.post_event("no-such-rollout", 1, "note", {})
    assert unknown.value.status == 404
    r = running(max_attempts=2)
    with pytest.raises(GatewayError) as future:
        admin.post_event(r.rollout_id, 2, "note", {})
    assert future.value.status == 404 and "no attempt 2" in future.value.message


def test_models_register_update_delete(admin: GatewayClient) -> None:
    name = f"m-{uuid.uuid4().hex[:6]}"
    admin.register_models(
        [{"model": name, "endpoint": "http://127.0.0.1:9/v1", "policy_version": 1}]
    )
    admin.register_models(
        [{"model": name, "endpoint": "http://127.0.0.1:9/v1", "policy_version": 2}]
    )
    mine = [m for m in admin.list_models() if m.model == name]
    assert [(m.endpoint, m.policy_version) for m in mine] == [("http://127.0.0.1:9/v1", 2)]
    assert admin.delete_models(name) == 1
    assert all(m.model != name for m in admin.list_models())


def test_admission_state_round_trip(admin: GatewayClient) -> None:
    assert admin.admission().state == "running"
    try:
        paused = admin.pause()
        assert (paused.state, paused.in_flight, paused.drained) == ("paused", 0, True)
        assert admin.admission().state == "paused"
    finally:
        assert admin.resume().state == "running"


def test_timeout_fails_running_attempt(admin: GatewayClient) -> None:
    rid = new_id()
    admin.create_rollouts([{"rollout_id": rid, "timeout_s": 0.2}])
    admin.patch_rollout(rid, "running")
    deadline = time.monotonic() + 10
    while admin.get_rollout(rid).status == "running" and time.monotonic() < deadline:
        time.sleep(0.05)
    r = admin.get_rollout(rid)
    assert (r.status, r.error) == ("failed", "attempt timed out")


# -- auth ----------------------------------------------------------------------------


def test_missing_and_invalid_tokens_get_401(gateway: GatewayProcess) -> None:
    for token in (None, "wrong", "agl-MTpyMQ.forged"):
        response = raw(gateway, "GET", "/api/rollouts", token)
        assert response.status_code == 401, token
        assert error_message(response)


def test_report_key_scopes(
    gateway: GatewayProcess, admin: GatewayClient, running: Callable[..., Rollout]
) -> None:
    mine, other = running(), running()
    key = mine.report_key
    assert key is not None
    agent = GatewayClient(gateway.url, key, retries=0)
    # Its own attempt: events, reading itself (without any key), finishing.
    agent.post_reward(mine.rollout_id, 1, 1.0)
    seen = agent.get_rollout(mine.rollout_id)
    assert seen.attempt_key is None and seen.report_key is None and seen.status == "running"
    # Anything else: 403.
    for call in (
        lambda: agent.post_reward(other.rollout_id, 1, 1.0),
        lambda: agent.get_rollout(other.rollout_id),
        lambda: agent.get_events(other.rollout_id),
        lambda: agent.list_rollouts(),
        lambda: agent.create_rollouts([{"rollout_id": new_id()}]),
        lambda: agent.patch_rollout(mine.rollout_id, "succeeded"),
        lambda: agent.register_models([]),
        lambda: agent.pause(),
        lambda: agent.patch_attempt(mine.rollout_id, 1, "queuing"),
    ):
        with pytest.raises(GatewayError) as refused:
            call()
        assert refused.value.status == 403, refused.value
    done = agent.patch_attempt(mine.rollout_id, 1, "succeeded")
    assert done.status == "succeeded"
    # A finished attempt's key no longer writes events.
    with pytest.raises(GatewayError) as late:
        agent.post_reward(mine.rollout_id, 1, 1.0)
    assert late.value.status == 409
    agent.close()


def test_key_of_an_old_attempt_is_refused(
    gateway: GatewayProcess, admin: GatewayClient, running: Callable[..., Rollout]
) -> None:
    r = running(max_attempts=2)
    admin.patch_rollout(r.rollout_id, "failed")
    admin.patch_rollout(r.rollout_id, "queuing")
    admin.patch_rollout(r.rollout_id, "running")
    old = GatewayClient(gateway.url, r.report_key or "", retries=0)
    with pytest.raises(GatewayError) as refused:
        old.post_reward(r.rollout_id, 1, 1.0)
    assert refused.value.status == 409 and "not running" in refused.value.message
    with pytest.raises(GatewayError) as wrong_attempt:
        old.post_reward(r.rollout_id, 2, 1.0)
    assert wrong_attempt.value.status == 403
    old.close()


# -- bad input -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    [
        ("POST", "/api/rollouts", b"{not json", 422),
        ("POST", "/api/rollouts", b"", 400),
        ("POST", "/api/rollouts", b'{"rollout_id": "x"}', 422),  # not a list
        ("POST", "/api/rollouts", b'[{"rollout_id": 5}]', 422),
        ("POST", "/api/rollouts", b'[{"rollout_id": "a/b"}]', 422),
        ("POST", "/api/rollouts", b'[{"rollout_id": "x", "mode": "test"}]', 422),
        ("POST", "/api/rollouts", b'[{"rollout_id": "x", "max_attempts": 0}]', 422),
        ("POST", "/api/rollouts", b'[{"rollout_id": "x", "unknown": 1}]', 422),
        ("PATCH", "/api/rollouts/nope", b'{"status": "running"}', 404),
        ("PATCH", "/api/rollouts/nope", b'{"status": "done"}', 422),
        ("GET", "/api/rollouts/nope", None, 404),
        ("GET", "/api/rollouts/nope/events", None, 404),
        ("POST", "/api/rollouts/nope/attempt/1/events", b'{"type": "x"}', 404),
        ("POST", "/api/rollouts/nope/attempt/one/events", b'{"type": "x"}', 422),
        ("POST", "/api/models", b'[{"model": "m", "endpoint": "not a url"}]', 422),
        ("POST", "/api/admission", b'{"state": "sleeping"}', 422),
        ("POST", "/api/nothing-here", b"{}", 404),
        ("PUT", "/api/rollouts", b"[]", 405),
    ],
)
def test_bad_input_gets_a_clear_4xx(
    gateway: GatewayProcess, method: str, path: str, body: bytes | None, status: int
) -> None:
    response = raw(gateway, method, path, gateway.token, content=body)
    assert response.status_code == status, response.text
    message = error_message(response)
    assert message and "Traceback" not in response.text


def test_event_body_errors(gateway: GatewayProcess, running: Callable[..., Rollout]) -> None:
    r = running()
    path = f"/api/rollouts/{r.rollout_id}/attempt/1/events"
    for body in (b'{"data": 1}', b'{"type": ""}', b'{"type": "x", "event_id": "a b"}', b"[1]"):
        response = raw(gateway, "POST", path, r.report_key, content=body)
        assert response.status_code == 422, body
        assert error_message(response)


def test_oversized_body_gets_413(tmp_path, upstream) -> None:
    from agl.testing.processes import gateway_process

    with gateway_process(tmp_path / "small", max_body_mb=0.01) as gw:
        big = b"[" + b",".join(b'{"rollout_id": "x%d"}' % i for i in range(2000)) + b"]"
        response = raw(gw, "POST", "/api/rollouts", gw.token, content=big)
        assert response.status_code == 413 and "limit" in error_message(response)

        def chunks():
            for _ in range(20):
                yield b" " * 1024

        streamed = raw(gw, "POST", "/api/rollouts", gw.token, content=chunks())
        assert streamed.status_code == 413
        assert raw(gw, "GET", "/healthz").status_code == 200
