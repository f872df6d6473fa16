"""The gateway's security over real HTTP, on real processes: what an attempt key cannot
reach (tests/core/gateway/test_gateway_api.py covers the common cases; these are the gaps), tokens
that never reach the log, refusing to bind a network without a secret, the per-attempt
rate limit and the body limit on the agents' routes."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import yaml
from starlette.testclient import TestClient

from agl.core.client import GatewayClient, GatewayError, proxy_base_url
from agl.core.contracts.records import EventIn, Rollout
from agl.core.gateway.app import create_app
from agl.core.gateway.asgi import BodyLimit
from agl.core.gateway.config import GatewayConfig, is_loopback
from agl.core.gateway.ratelimit import AttemptRateLimit
from agl.core.http_errors import ApiError
from agl.core.ports import free_port
from agl.core.run.services import ChildGateway
from agl.testing.fake_vllm import FakeVllm
from agl.testing.processes import GatewayProcess, gateway_process, wait_healthy

REPO = Path(__file__).resolve().parents[3]
SECRET = "0123456789abcdef0123456789abcdef"  # what `openssl rand -hex 16` could print
CHAT = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}


def new_id() -> str:
    return f"r-{uuid.uuid4().hex[:12]}"


def raw(
    url: str, method: str, path: str, token: str | None = None, **kwargs: object
) -> httpx.Response:
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    return httpx.request(method, url + path, headers=headers, timeout=10, **kwargs)


def error_message(response: httpx.Response) -> str:
    body = response.json()
    assert set(body["error"]) >= {"message", "type", "code"}, body
    assert body["error"]["message"], body
    return body["error"]["message"]


def chat_path(rollout_id: str, attempt: int, mode: str = "train") -> str:
    return proxy_base_url("", rollout_id, attempt, mode) + "/chat/completions"


def events_path(rollout_id: str, attempt: int) -> str:
    return f"/api/rollouts/{rollout_id}/attempt/{attempt}/events"


REWARD = {"type": "reward", "data": {"value": 1.0}}


# -- what an attempt key cannot reach ------------------------------------------------


def test_a_key_cannot_reach_another_rollout(
    gateway: GatewayProcess, admin: GatewayClient, running: Callable[..., Rollout], fake: FakeVllm
) -> None:
    mine, other = running(), running()
    key = mine.attempt_key
    calls = [
        ("GET", f"/api/rollouts/{other.rollout_id}", None),
        ("GET", f"/api/rollouts/{other.rollout_id}/events", None),
        ("GET", f"/api/rollouts/{other.rollout_id}/events?attempt=1", None),
        ("PATCH", f"/api/rollouts/{other.rollout_id}", {"status": "failed"}),
        ("PATCH", f"/api/rollouts/{other.rollout_id}/attempt/1", {"status": "succeeded"}),
        ("POST", events_path(other.rollout_id, 1), REWARD),
        ("POST", chat_path(other.rollout_id, 1), CHAT),
        ("POST", chat_path(other.rollout_id, 1, "val"), CHAT),
    ]
    for method, path, body in calls:
        response = raw(gateway.url, method, path, key, json=body)
        assert response.status_code == 403, (method, path, response.text)
        error_message(response)
    # Nothing of it landed: the other rollout is as it was, with no events and no calls.
    assert admin.get_rollout(other.rollout_id) == other
    assert admin.get_events(other.rollout_id) == []
    assert fake.requests == []
    # Its own routes still work with the same key.
    ok = raw(gateway.url, "POST", chat_path(mine.rollout_id, 1), key, json=CHAT)
    assert ok.status_code == 200, ok.text


def test_the_model_key_calls_the_model_and_nothing_else(
    gateway: GatewayProcess, admin: GatewayClient, running: Callable[..., Rollout], fake: FakeVllm
) -> None:
    """The model key is the agent's OPENAI_API_KEY, which harnesses hand to the model's
    shell tools: with it a tool must not set its own reward, end its attempt or read its
    rollout (its input may hold what the task grades against)."""
    r = running()
    model_key, report_key = r.attempt_key, r.report_key
    assert model_key and report_key and model_key != report_key
    own = [
        ("POST", events_path(r.rollout_id, 1), REWARD),
        ("POST", events_path(r.rollout_id, 1), [{"type": "note", "data": 1}]),
        ("PATCH", f"/api/rollouts/{r.rollout_id}/attempt/1", {"status": "succeeded"}),
        ("GET", f"/api/rollouts/{r.rollout_id}", None),
        ("GET", f"/api/rollouts/{r.rollout_id}/events", None),
    ]
    for method, path, body in own:
        response = raw(gateway.url, method, path, model_key, json=body)
        assert response.status_code == 403, (method, path, response.text)
        assert "report key" in error_message(response)
    assert admin.get_events(r.rollout_id) == []
    assert admin.get_rollout(r.rollout_id).status == "running"
    # Its one use: the model, through the attempt's proxy.
    ok = raw(gateway.url, "POST", chat_path(r.rollout_id, 1), model_key, json=CHAT)
    assert ok.status_code == 200, ok.text
    # The report key does everything the attempt may do.
    for method, path, body in own:
        response = raw(gateway.url, method, path, report_key, json=body)
        assert response.is_success, (method, path, response.text)
    assert admin.get_rollout(r.rollout_id).status == "succeeded"


def test_a_key_cannot_be_turned_into_the_other_role(
    gateway: GatewayProcess, running: Callable[..., Rollout]
) -> None:
    """Each role's MAC is domain-separated: swapping the prefix forges nothing (401)."""
    r = running()
    assert r.attempt_key and r.report_key
    as_report = "aglr-" + r.attempt_key.removeprefix("agl-")
    as_model = "agl-" + r.report_key.removeprefix("aglr-")
    for token, path in (
        (as_report, events_path(r.rollout_id, 1)),
        (as_model, chat_path(r.rollout_id, 1)),
    ):
        response = raw(gateway.url, "POST", path, token, json=REWARD)
        assert response.status_code == 401, (token, response.text)


def test_a_key_cannot_call_the_admin_api(
    gateway: GatewayProcess, running: Callable[..., Rollout], admin: GatewayClient
) -> None:
    r = running()
    before = admin.list_models()
    calls = [
        ("GET", "/api/rollouts", None),
        ("GET", "/api/rollouts?status=running", None),
        ("POST", "/api/rollouts", [{"rollout_id": new_id()}]),
        ("PATCH", f"/api/rollouts/{r.rollout_id}", {"status": "succeeded"}),
        ("GET", "/api/models", None),
        ("POST", "/api/models", [{"model": "evil", "endpoint": "http://evil/v1"}]),
        ("DELETE", "/api/models", None),
        ("DELETE", "/api/models?model=policy", None),
        ("GET", "/api/admission", None),
        ("POST", "/api/admission", {"state": "paused", "timeout_s": 0}),
        ("POST", "/api/admission", {"state": "running"}),
    ]
    for method, path, body in calls:
        response = raw(gateway.url, method, path, r.attempt_key, json=body)
        assert response.status_code == 403, (method, path, response.text)
        assert "admin" in error_message(response)
    assert admin.list_models() == before
    assert admin.admission().state == "running"
    assert admin.get_rollout(r.rollout_id).status == "running"


def test_the_key_of_an_earlier_attempt_reaches_nothing(
    gateway: GatewayProcess, admin: GatewayClient, running: Callable[..., Rollout], fake: FakeVllm
) -> None:
    r = running(max_attempts=2)
    old = r.report_key
    admin.patch_rollout(r.rollout_id, "failed")
    admin.patch_rollout(r.rollout_id, "queuing")
    now = admin.patch_rollout(r.rollout_id, "running")
    assert now.attempt == 2 and now.report_key != old and now.attempt_key != r.attempt_key
    # The new attempt's routes, and reading the rollout it now runs: neither old key's.
    for key in (r.attempt_key, old):
        for method, path, body in [
            ("GET", f"/api/rollouts/{r.rollout_id}", None),
            ("GET", f"/api/rollouts/{r.rollout_id}/events", None),
            ("PATCH", f"/api/rollouts/{r.rollout_id}/attempt/2", {"status": "succeeded"}),
            ("POST", events_path(r.rollout_id, 2), REWARD),
            ("POST", chat_path(r.rollout_id, 2), CHAT),
        ]:
            response = raw(gateway.url, method, path, key, json=body)
            assert response.status_code == 403, (method, path, response.text)
            error_message(response)
    # Its own, finished attempt: refused as not the running one (409, as elsewhere).
    for method, path, body in [
        ("PATCH", f"/api/rollouts/{r.rollout_id}/attempt/1", {"status": "succeeded"}),
        ("POST", events_path(r.rollout_id, 1), REWARD),
        ("POST", chat_path(r.rollout_id, 1), CHAT),
    ]:
        response = raw(gateway.url, method, path, old, json=body)
        assert response.status_code == 409, (method, path, response.text)
        assert "attempt 1" in error_message(response)
        current = response.json()["current"]
        assert current["attempt_key"] is None and current["report_key"] is None  # no new keys
    after = admin.get_rollout(r.rollout_id)
    assert (after.status, after.attempt, after.version) == (now.status, 2, now.version)
    assert admin.get_events(r.rollout_id) == []
    assert fake.requests == []


def test_a_report_key_reads_only_its_own_attempts_events(
    gateway: GatewayProcess, admin: GatewayClient, running: Callable[..., Rollout]
) -> None:
    r = running(max_attempts=2)
    admin.post_events(r.rollout_id, 1, [EventIn(type="note", data="first try")])
    admin.patch_rollout(r.rollout_id, "failed")
    admin.patch_rollout(r.rollout_id, "queuing")
    now = admin.patch_rollout(r.rollout_id, "running")
    admin.post_events(r.rollout_id, 2, [EventIn(type="note", data="second try")])
    events = f"/api/rollouts/{r.rollout_id}/events"
    earlier = raw(gateway.url, "GET", events + "?attempt=1", now.report_key)
    assert earlier.status_code == 403 and "own attempt (2)" in error_message(earlier)
    for query in ("", "?attempt=2", "?type=note"):
        own = raw(gateway.url, "GET", events + query, now.report_key)
        assert own.status_code == 200, (query, own.text)
        assert [e["data"] for e in own.json()["items"]] == ["second try"], query
    # The admin reads every attempt.
    assert [e.data for e in admin.get_events(r.rollout_id, attempt=1)] == ["first try"]
    assert [e.data for e in admin.get_events(r.rollout_id)] == ["first try", "second try"]


def test_another_rollout_answers_the_same_403_whether_it_exists_or_not(
    gateway: GatewayProcess, admin: GatewayClient, running: Callable[..., Rollout]
) -> None:
    """No key can learn which rollouts exist: every route that takes a rollout id refuses
    another rollout before looking it up."""
    key = running().attempt_key
    present, absent = running().rollout_id, new_id()
    messages = {**CHAT, "max_tokens": 8}

    def calls(rid: str) -> list[tuple[str, str, object]]:
        root = proxy_base_url("", rid, 1).removesuffix("/openai/v1")
        return [
            ("GET", f"/api/rollouts/{rid}", None),
            ("GET", f"/api/rollouts/{rid}/events", None),
            ("GET", f"/api/rollouts/{rid}/events?attempt=1", None),
            ("GET", f"/api/rollouts/{rid}/transitions", None),
            ("PATCH", f"/api/rollouts/{rid}", {"status": "failed"}),
            ("PATCH", f"/api/rollouts/{rid}/attempt/1", {"status": "succeeded"}),
            ("POST", events_path(rid, 1), REWARD),
            ("POST", chat_path(rid, 1), CHAT),
            ("POST", root + "/openai/v1/completions", {"model": "policy", "prompt": "hi"}),
            ("POST", root + "/openai/v1/responses", {"model": "policy", "input": "hi"}),
            ("POST", root + "/anthropic/v1/messages", messages),
            ("POST", root + "/anthropic/v1/messages/count_tokens", CHAT),
        ]

    for (method, path, body), (_, missing, _) in zip(calls(present), calls(absent), strict=True):
        there = raw(gateway.url, method, path, key, json=body)
        not_there = raw(gateway.url, method, missing, key, json=body)
        assert there.status_code == not_there.status_code == 403, (path, not_there.text)
        assert there.text.replace(present, "R") == not_there.text.replace(absent, "R"), path
    # The admin is told what is there.
    for path in (f"/api/rollouts/{absent}", f"/api/rollouts/{absent}/events"):
        assert raw(gateway.url, "GET", path, gateway.token).status_code == 404
    assert admin.get_rollout(present).status == "running"
    assert admin.get_events(present) == []


@pytest.mark.parametrize("kind", ["model_request", "model_request_failed"])
def test_a_key_cannot_forge_what_the_proxy_records(
    gateway: GatewayProcess, admin: GatewayClient, running: Callable[..., Rollout], kind: str
) -> None:
    """The trainer trains on ``model_request`` events: an agent posting one would choose
    its own tokens and logprobs. Only the proxy writes them (and the admin, say to import
    traces)."""
    r = running()
    forged = {"type": kind, "data": {"prompt_ids": [1], "response_ids": [2], "logprobs": [0.0]}}
    for body in (forged, [{"type": "note", "data": 1}, forged]):
        response = raw(
            gateway.url, "POST", events_path(r.rollout_id, r.attempt), r.report_key, json=body
        )
        assert response.status_code == 403, response.text
        assert "written by the proxy only" in error_message(response)
    assert admin.get_events(r.rollout_id) == []
    admin.post_events(r.rollout_id, r.attempt, [EventIn(**forged)])
    assert [e.type for e in admin.get_events(r.rollout_id)] == [kind]


def test_no_token_gets_401_everywhere(gateway: GatewayProcess, running: Callable[..., Rollout]):
    r = running()
    calls = [
        ("GET", "/api/rollouts", None),
        ("POST", "/api/rollouts", [{"rollout_id": new_id()}]),
        ("GET", f"/api/rollouts/{r.rollout_id}", None),
        ("PATCH", f"/api/rollouts/{r.rollout_id}", {"status": "failed"}),
        ("PATCH", f"/api/rollouts/{r.rollout_id}/attempt/1", {"status": "failed"}),
        ("GET", f"/api/rollouts/{r.rollout_id}/events", None),
        ("POST", events_path(r.rollout_id, 1), REWARD),
        ("GET", "/api/models", None),
        ("POST", "/api/models", [{"model": "evil", "endpoint": "http://evil/v1"}]),
        ("DELETE", "/api/models", None),
        ("GET", "/api/admission", None),
        ("POST", "/api/admission", {"state": "paused"}),
        ("POST", chat_path(r.rollout_id, 1), CHAT),
    ]
    for method, path, body in calls:
        for headers in ({}, {"Authorization": "Basic dXNlcjpwdw=="}, {"Authorization": "Bearer"}):
            response = httpx.request(
                method, gateway.url + path, json=body, headers=headers, timeout=10
            )
            assert response.status_code == 401, (method, path, headers, response.text)
            assert "Bearer" in error_message(response)
        # A key forged for this very rollout: 401, not 403 (no HMAC, no identity).
        forged = r.attempt_key[: r.attempt_key.rindex(".") + 1] + "A" * 43
        response = raw(gateway.url, method, path, forged, json=body)
        assert response.status_code == 401, (method, path, response.text)
        assert error_message(response) == "invalid token"


# -- tokens never reach the log ------------------------------------------------------


@contextmanager
def logged_gateway(run_dir: Path, log_path: Path, **options: object) -> Iterator[GatewayProcess]:
    port = free_port()
    args = [f"port={port}", f"run_dir={run_dir}", *(f"{k}={v}" for k, v in options.items())]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "agl.gateway", *args],
            env={**os.environ, "AGL_ADMIN_TOKEN": SECRET},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    gateway = GatewayProcess(f"http://127.0.0.1:{port}", SECRET, run_dir, process)
    try:
        wait_healthy(f"{gateway.url}/healthz", process)
        yield gateway
    finally:
        gateway.stop()


@pytest.mark.slow
def test_tokens_never_reach_the_log(tmp_path: Path, upstream: tuple[str, FakeVllm]) -> None:
    log_path = tmp_path / "gateway.log"
    with (
        logged_gateway(tmp_path / "run", log_path, log_level="debug", access_log="true") as gw,
        GatewayClient(gw.url, gw.token, retries=0) as admin,
    ):
        admin.register_models([{"model": "policy", "endpoint": upstream[0], "policy_version": 1}])
        rid, other = new_id(), new_id()
        admin.create_rollouts([{"rollout_id": rid}, {"rollout_id": other, "max_attempts": 2}])
        r = admin.patch_rollout(rid, "running")
        o = admin.patch_rollout(other, "running")
        keys = [r.attempt_key, o.attempt_key]
        key = r.attempt_key
        for response in (
            raw(gw.url, "POST", chat_path(rid, 1), key, json=CHAT),
            raw(gw.url, "POST", chat_path(rid, 1), key, json={**CHAT, "stream": True}),
            raw(gw.url, "POST", events_path(rid, 1), key, json=REWARD),
            raw(gw.url, "GET", f"/api/rollouts/{rid}", key),
            raw(gw.url, "POST", chat_path(rid, 1), key, content=b"{broken"),  # 4xx paths too
            raw(gw.url, "POST", chat_path(other, 1), key, json=CHAT),
            raw(gw.url, "GET", "/api/rollouts", key),
            raw(gw.url, "GET", "/api/rollouts", "agl-" + key[4:-3] + "xyz"),
            raw(gw.url, "GET", "/api/rollouts", SECRET[::-1]),
        ):
            assert response.status_code < 500, response.text
        admin.patch_rollout(other, "failed")
        admin.patch_rollout(other, "queuing")
        keys.append(admin.patch_rollout(other, "running").attempt_key)
        admin.list_rollouts()
        raw(gw.url, "PATCH", f"/api/rollouts/{rid}/attempt/1", key, json={"status": "succeeded"})
    text = log_path.read_text(errors="replace")
    # The log is on: access lines for the agent's calls and the refused ones are there.
    assert f'"POST /proxy/rollout/{rid}/attempt/1/' in text, text[-2000:]
    assert '"GET /api/rollouts HTTP/1.1" 401' in text, text[-2000:]
    secrets_ = [SECRET, SECRET[::-1], *keys]
    secrets_ += [k.rpartition(".")[2] for k in keys]  # the HMAC part alone
    for secret in secrets_:
        assert secret not in text, f"a token is in the gateway's log: {secret[:8]}..."
    assert "Bearer" not in text and "authorization" not in text.lower()


# -- refusing to bind a network without a secret ------------------------------------


def start_gateway(
    tmp_path: Path, *args: str, token: str | None = None, timeout_s: float = 30
) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k != "AGL_ADMIN_TOKEN"}
    if token is not None:
        env["AGL_ADMIN_TOKEN"] = token
    return subprocess.Popen(
        [sys.executable, "-m", "agl.gateway", f"run_dir={tmp_path / 'run'}", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def refused(process: subprocess.Popen[bytes]) -> str:
    stdout, stderr = process.communicate(timeout=30)
    lines = stderr.decode().splitlines()
    assert process.returncode == 2, (process.returncode, stderr.decode())
    assert len(lines) == 1 and lines[0].startswith("agl.gateway: "), stderr.decode()
    assert stdout == b""
    return lines[0]


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.23", "10.0.0.1", "gateway.lan"])
def test_a_network_host_without_a_secret_is_refused(tmp_path: Path, host: str) -> None:
    line = refused(start_gateway(tmp_path, f"host={host}", f"port={free_port()}"))
    assert host in line and "AGL_ADMIN_TOKEN" in line and "admin_token_file" in line
    assert not (tmp_path / "run" / "gateway.db").exists()  # refused before anything opened


def test_the_self_made_token_or_a_short_one_is_no_secret(tmp_path: Path) -> None:
    # A token the gateway made itself at an earlier, loopback start does not count.
    port = free_port()
    first = start_gateway(tmp_path, f"port={port}")
    try:
        wait_healthy(f"http://127.0.0.1:{port}/healthz", first)
    finally:
        first.terminate()
        first.wait(timeout=10)
    assert (tmp_path / "run" / "admin_token").exists()
    line = refused(start_gateway(tmp_path, "host=0.0.0.0", f"port={free_port()}"))
    assert "without a secret configured" in line
    # A configured but weak one neither.
    line = refused(start_gateway(tmp_path, "host=0.0.0.0", f"port={free_port()}", token="pw-1234"))
    assert "fewer than 16" in line and "pw-1234" not in line  # never echoed
    # An unreadable token file: one line too.
    missing = tmp_path / "nope"
    line = refused(start_gateway(tmp_path, "host=0.0.0.0", f"admin_token_file={missing}"))
    assert "admin_token_file" in line


def test_the_k8s_command_with_its_secret_starts(tmp_path: Path) -> None:
    """deploy/k8s/gateway.yaml's command (host=0.0.0.0) with AGL_ADMIN_TOKEN set, as its
    Secret sets it; only port and run_dir are moved to where a test may write."""
    docs = yaml.safe_load_all((REPO / "deploy/k8s/gateway.yaml").read_text())
    (deployment,) = [d for d in docs if d and d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    command = container["command"]
    assert command[:3] == ["python", "-m", "agl.gateway"] and "host=0.0.0.0" in command
    assert container["env"][0]["name"] == "AGL_ADMIN_TOKEN"
    port = free_port()
    process = start_gateway(
        tmp_path, *command[3:], f"port={port}", f"run_dir={tmp_path}", token=SECRET * 2
    )
    try:
        wait_healthy(f"http://127.0.0.1:{port}/healthz", process)
        listed = raw(f"http://127.0.0.1:{port}", "GET", "/api/rollouts", SECRET * 2)
        assert listed.status_code == 200, listed.text
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_a_token_file_is_a_secret(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(SECRET + "\n")
    port = free_port()
    process = start_gateway(
        tmp_path, "host=0.0.0.0", f"port={port}", f"admin_token_file={token_file}"
    )
    try:
        wait_healthy(f"http://127.0.0.1:{port}/healthz", process)
        url = f"http://127.0.0.1:{port}"
        assert raw(url, "GET", "/api/rollouts", SECRET).status_code == 200
        assert raw(url, "GET", "/api/rollouts", "something-else-entirely").status_code == 401
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_the_trainers_child_gateway_starts(tmp_path: Path, host: str) -> None:
    """``python -m agl.train`` starts its gateway as a ChildGateway: on loopback by
    default, and with ``gateway.host=0.0.0.0`` too (it hands the child its token)."""
    child = ChildGateway(tmp_path / "gateway", host=host).start()
    try:
        assert child.url.startswith("http://127.0.0.1:")
        assert raw(child.url, "GET", "/api/rollouts", child.token).status_code == 200
        # What opens the viewer of a live run: for its owner only.
        assert child.token_file.read_text().strip() == child.token
        assert child.token_file.stat().st_mode & 0o777 == 0o600
    finally:
        child.stop()


def test_what_counts_as_loopback() -> None:
    for host in ("127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "", "192.168.1.2", "fe80::1", "gateway", "localhost.evil"):
        assert not is_loopback(host), host


# -- rate limit ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tight(
    tmp_path_factory: pytest.TempPathFactory, upstream: tuple[str, FakeVllm]
) -> Iterator[GatewayProcess]:
    """A gateway with a low per-attempt limit (5/s, burst 10) and a 10 KiB body limit."""
    run_dir = tmp_path_factory.mktemp("tight")
    options = {"attempt_rps": 5, "attempt_burst": 10, "max_body_mb": 0.01}
    with (
        gateway_process(run_dir, token=SECRET, **options) as gw,
        GatewayClient(gw.url, gw.token) as client,
    ):
        client.register_models([{"model": "policy", "endpoint": upstream[0], "policy_version": 1}])
        yield gw


def start(gw: GatewayProcess, **spec: object) -> Rollout:
    with GatewayClient(gw.url, gw.token, retries=0) as admin:
        rid = new_id()
        admin.create_rollouts([{"rollout_id": rid, **spec}])
        return admin.patch_rollout(rid, "running")


def test_one_runaway_attempt_cannot_starve_the_others(tight: GatewayProcess) -> None:
    runaway, calm = start(tight), start(tight)

    async def flood() -> tuple[list[httpx.Response], list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=tight.url, timeout=30) as http:

            def call(r: Rollout, n: int) -> object:
                headers = {"Authorization": f"Bearer {r.report_key}"}
                if n % 2:
                    return http.post(chat_path(r.rollout_id, 1), json=CHAT, headers=headers)
                event = {**REWARD, "event_id": f"e{n}"}
                return http.post(events_path(r.rollout_id, 1), json=event, headers=headers)

            storm = [call(runaway, n) for n in range(120)]
            steady = [call(calm, n) for n in range(8)]  # within its own burst
            answers = await asyncio.gather(*storm, *steady)
            return list(answers[:120]), list(answers[120:])

    started = time.monotonic()
    storm, steady = asyncio.run(flood())
    elapsed = time.monotonic() - started
    statuses = [r.status_code for r in storm]
    assert set(statuses) <= {200, 429}, statuses
    # The burst, and what refilled (5/s) while the storm lasted.
    assert 10 <= statuses.count(200) <= 11 + 5 * elapsed, (elapsed, statuses)
    assert statuses.count(429) >= 50, statuses
    assert [r.status_code for r in steady] == [200] * 8, [r.text for r in steady]
    limited = next(r for r in storm if r.status_code == 429)
    assert "too many calls" in error_message(limited)
    assert limited.json()["error"]["type"] == "rate_limit_error"
    assert int(limited.headers["Retry-After"]) >= 1
    assert 0 < int(limited.headers["retry-after-ms"]) <= 1000
    # The admin is never limited.
    for _ in range(60):
        assert raw(tight.url, "GET", f"/api/rollouts/{runaway.rollout_id}", SECRET).is_success
    # After the wait it asked for, the runaway may call again.
    time.sleep(int(limited.headers["retry-after-ms"]) / 1000 + 0.05)
    again = raw(
        tight.url, "POST", events_path(runaway.rollout_id, 1), runaway.report_key, json=REWARD
    )
    assert again.status_code == 200, again.text


def test_the_client_waits_out_a_429(tight: GatewayProcess) -> None:
    r = start(tight)
    key = r.report_key or ""
    with GatewayClient(tight.url, key, retries=0) as impatient:
        with pytest.raises(GatewayError) as limited:
            # The burst of 10, and those that refilled meanwhile (more on a slow machine).
            for _ in range(1000):
                impatient.get_rollout(r.rollout_id)
        assert limited.value.status == 429 and "retry in" in limited.value.message
    with GatewayClient(tight.url, key, retries=20) as patient:
        started = time.monotonic()
        # Past the burst of 10, whatever refilled while the machine was slow: the other 10
        # need 10 new tokens (2 s at 5/s), so they meet 429s and the client waits them out.
        for _ in range(20):
            patient.post_reward(r.rollout_id, 1, 1.0)
        assert time.monotonic() - started >= 1.9


def test_buckets_are_bounded_and_expire() -> None:
    now = [0.0]
    limit = AttemptRateLimit(rate=50, burst=100, max_buckets=1000, clock=lambda: now[0])
    for i in range(5000):  # a flood of distinct attempts at one instant
        assert limit.take((f"r{i}", 1)) == 0.0
        assert len(limit) <= 1000
    for _ in range(100):
        assert limit.take(("hot", 1)) == 0.0
    assert limit.take(("hot", 1)) == pytest.approx(1 / 50)
    now[0] = 1.0  # half the refill time: nobody has refilled yet
    limit.take(("hot", 1))
    assert len(limit) == 1000
    now[0] = 10.0  # everyone idle has refilled: their buckets go on the next call
    limit.take(("new", 1))
    assert len(limit) == 1
    assert AttemptRateLimit(rate=0, burst=1).take(("any", 1)) == 0.0  # attempt_rps=0: off


def test_the_limiter_charges_an_event_batch_by_its_events() -> None:
    now = [0.0]
    limit = AttemptRateLimit(rate=10, burst=20, clock=lambda: now[0])
    key = ("r", 1)
    for _ in range(4):  # four calls, as a call each: 4 of 20 tokens; as 5 events: all 20
        assert limit.take(key) == 0.0
        limit.charge(key, 5 - 1)
    assert limit.take(key) == pytest.approx(1 / 10)
    # A batch bigger than the burst still passes from a full bucket, into debt that the
    # next calls wait out, and that the bucket keeps past the usual refill time (2 s).
    now[0] = 100.0
    assert limit.take(key) == 0.0
    limit.charge(key, 1000 - 1)
    now[0] = 103.0
    assert limit.take(("another", 1)) == 0.0  # a call that drops refilled buckets
    assert limit.take(key) == pytest.approx((1 + 980 - 30) / 10)


def test_a_batch_over_the_events_cap_is_refused_whole_and_one_at_the_cap_is_stored(
    gateway: GatewayProcess, admin: GatewayClient, running: Callable[..., Rollout]
) -> None:
    """100,000 events in one POST held the event loop (and every other agent) for 5 s."""
    r = running()
    over = [{"type": "log", "event_id": f"e{i}", "data": i} for i in range(1001)]
    refused = raw(gateway.url, "POST", events_path(r.rollout_id, 1), r.report_key, json=over)
    assert refused.status_code == 413, refused.text[:300]
    message = error_message(refused)
    assert "1001 events" in message and "1000" in message and "max_events_per_post" in message
    assert admin.get_events(r.rollout_id) == []  # all or nothing
    stored = raw(gateway.url, "POST", events_path(r.rollout_id, 1), r.report_key, json=over[:1000])
    assert stored.status_code == 200, stored.text[:300]
    assert [e.data for e in admin.get_events(r.rollout_id)] == list(range(1000))


def test_an_event_batch_spends_the_rate_limit_as_its_events(tight: GatewayProcess) -> None:
    """A burst of 10 calls: one batch of 60 events spends it and six times more, so the
    attempt's next call waits for the debt (at 5/s, ~10 s), where as one call it would
    have passed at once."""
    r = start(tight)
    batch = [{"type": "log", "event_id": f"e{i}"} for i in range(60)]
    posted = raw(tight.url, "POST", events_path(r.rollout_id, 1), r.report_key, json=batch)
    assert posted.status_code == 200, posted.text
    limited = raw(tight.url, "POST", events_path(r.rollout_id, 1), r.report_key, json=REWARD)
    assert limited.status_code == 429, limited.text
    assert int(limited.headers["Retry-After"]) >= 2, limited.headers
    with GatewayClient(tight.url, tight.token) as admin:
        assert len(admin.get_events(r.rollout_id)) == 60


# -- body limit on the agents' routes -------------------------------------------------


def test_oversized_bodies_on_the_proxy_and_events_get_413(
    tight: GatewayProcess, upstream: tuple[str, FakeVllm]
) -> None:
    r = start(tight)
    fake = upstream[1]
    seen = len(fake.requests)
    big_chat = {**CHAT, "messages": [{"role": "user", "content": "x" * 20_000}]}
    big_event = {"type": "log", "data": {"text": "x" * 20_000}}

    def chunks() -> Iterator[bytes]:
        yield b'{"type": "log", "data": {"text": "'
        for _ in range(20):
            yield b"x" * 1024
        yield b'"}}'

    for path, body in (
        (chat_path(r.rollout_id, 1), big_chat),
        (events_path(r.rollout_id, 1), big_event),
    ):
        response = raw(tight.url, "POST", path, r.report_key, json=body)
        assert response.status_code == 413, (path, response.text)
        assert "limit" in error_message(response)
        streamed = raw(tight.url, "POST", path, r.report_key, content=chunks())
        assert streamed.status_code == 413, (path, streamed.text)
    assert len(fake.requests) == seen  # nothing went upstream
    with GatewayClient(tight.url, SECRET) as admin:
        assert admin.get_events(r.rollout_id) == []
    small = raw(tight.url, "POST", events_path(r.rollout_id, 1), r.report_key, json=REWARD)
    assert small.status_code == 200, small.text


# -- no third-party script on the gateway's origin -------------------------------------------


def test_no_page_loads_a_third_party_script_unless_api_docs_is_asked_for(
    gateway: GatewayProcess, tmp_path: Path
) -> None:
    """FastAPI's /docs and /redoc load Swagger UI and ReDoc from a CDN: off by default;
    the schema they read stays."""
    for path in ("/docs", "/redoc", "/docs/oauth2-redirect"):
        answer = raw(gateway.url, "GET", path)
        assert answer.status_code == 404, (path, answer.text)
        error_message(answer)
    schema = raw(gateway.url, "GET", "/openapi.json")
    assert schema.status_code == 200 and schema.json()["info"]["title"] == "agl gateway"

    asked = TestClient(create_app(GatewayConfig(run_dir=str(tmp_path), api_docs=True), SECRET))
    docs = asked.get("/docs")
    assert docs.status_code == 200 and "cdn.jsdelivr.net" in docs.text


def test_request_bodies_in_flight_share_one_budget() -> None:
    """Each body within its own limit, many at once could still pin the gateway's memory
    (100 streamed 33 MiB uploads took it to 3.2 GiB): the bodies of all requests in
    flight hold at most ``max_buffered_mb``; a chunk past it gets 503, and what a request
    held is free again once it is answered."""
    chunks: dict[str, asyncio.Queue[dict[str, Any]]] = {}
    answers: dict[str, list[dict[str, Any]]] = {}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        try:
            while (await receive()).get("more_body"):
                pass
        except ApiError as error:
            await error.response()(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    limit = BodyLimit(app, max_bytes=100, budget_bytes=150)

    def request(name: str) -> asyncio.Task[None]:
        chunks[name], answers[name] = asyncio.Queue(), []

        async def send(message: dict[str, Any]) -> None:
            answers[name].append(message)

        scope = {"type": "http", "headers": [], "method": "POST", "path": "/x"}
        return asyncio.create_task(limit(scope, chunks[name].get, send))

    def status(name: str) -> int | None:
        starts = [m["status"] for m in answers[name] if m["type"] == "http.response.start"]
        return starts[0] if starts else None

    async def main() -> None:
        a, b = request("a"), request("b")
        for name in ("a", "b"):
            await chunks[name].put({"type": "http.request", "body": b"x" * 70, "more_body": True})
        while limit.held < 140:  # both have taken their chunk: 140 of 150 held
            await asyncio.sleep(0)
        c = request("c")
        await chunks["c"].put({"type": "http.request", "body": b"x" * 20, "more_body": True})
        await c
        assert status("c") == 503 and limit.held == 140
        body = orjson.loads(answers["c"][-1]["body"])
        assert "budget" in body["error"]["message"]
        for name in ("a", "b"):
            await chunks[name].put({"type": "http.request", "body": b"", "more_body": False})
        await asyncio.gather(a, b)
        assert (status("a"), status("b"), limit.held) == (200, 200, 0)
        d = request("d")  # the budget is free again
        await chunks["d"].put({"type": "http.request", "body": b"x" * 100, "more_body": False})
        await d
        assert status("d") == 200 and limit.held == 0

    asyncio.run(main())
