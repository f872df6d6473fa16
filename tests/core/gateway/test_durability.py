"""What the gateway acknowledged survives kill -9 and a restart on the same file."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import openai
import orjson
import pytest

from agl.core.client import GatewayClient, proxy_base_url
from agl.core.contracts.records import EventIn
from agl.core.ports import free_port
from agl.testing.fake_vllm import FakeVllm, reply_for
from agl.testing.processes import gateway_process
from tests.helpers.lost_answers import BIG, content_of, post_and_never_read, vllm_answer


def test_acknowledged_writes_survive_kill_9(run_dir: Path, upstream: tuple[str, FakeVllm]) -> None:
    acked_rollouts: set[str] = set()
    acked_events: dict[str, set[str]] = {}
    acked_calls: dict[str, int] = {}
    lock = threading.Lock()
    stop = threading.Event()

    with gateway_process(run_dir) as gw:
        admin = GatewayClient(gw.url, gw.token, retries=0)
        admin.register_models([{"model": "policy", "endpoint": upstream[0], "policy_version": 7}])

        def writer(worker: int) -> None:
            client = GatewayClient(gw.url, gw.token, retries=0, timeout_s=5)
            n = 0
            while not stop.is_set():
                rid = f"w{worker}-{n}"
                n += 1
                try:
                    (r,) = client.create_rollouts([{"rollout_id": rid}])
                    with lock:
                        acked_rollouts.add(rid)
                    client.patch_rollout(rid, "running")
                    ids = [f"e{i}" for i in range(3)]
                    client.post_events(
                        rid, 1, [EventIn(event_id=i, type="step", data=i) for i in ids]
                    )
                    with lock:
                        acked_events[rid] = set(ids)
                    agent = openai.OpenAI(
                        base_url=proxy_base_url(gw.url, rid, 1),
                        api_key=r.attempt_key,
                        max_retries=0,
                        timeout=5,
                    )
                    agent.chat.completions.create(
                        model="policy", messages=[{"role": "user", "content": rid}]
                    )
                    with lock:
                        acked_calls[rid] = 1
                except (httpx.HTTPError, openai.APIError, OSError):
                    return  # the gateway died under us

        threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while len(acked_calls) < 15 and time.monotonic() < deadline:
            time.sleep(0.05)
        gw.kill()  # mid-load: writers are between requests, or inside one
        stop.set()
        for t in threads:
            t.join(timeout=10)

    assert len(acked_rollouts) >= 15 and len(acked_calls) >= 15, "too little load to mean anything"
    with gateway_process(run_dir) as gw, GatewayClient(gw.url, gw.token) as admin:
        stored = {r.rollout_id for r in admin.list_rollouts()}
        assert acked_rollouts <= stored
        for rid, ids in acked_events.items():
            events = admin.get_events(rid)
            assert ids <= {e.event_id for e in events}, rid
            if rid in acked_calls:
                calls = [e for e in events if e.type == "model_request"]
                assert len(calls) == 1 and calls[0].data["policy_version"] == 7
        # Models and the secret survive too: old attempt keys still work.
        assert [m.policy_version for m in admin.list_models()] == [7]
        some = sorted(acked_calls)[0]
        key = admin.get_rollout(some).report_key
        assert GatewayClient(gw.url, key or "").get_rollout(some).rollout_id == some


PROXY_ROOT = proxy_base_url("", "r", 1).removesuffix("/openai/v1")  # rollout r, attempt 1


def lose_an_answer(
    run_dir: Path, port: int, endpoint: str, fake: FakeVllm, path: str, body: bytes, stream: bool
) -> str:
    """A gateway on ``port`` that records rollout r's call of ``body`` to ``path`` and is
    killed before its (big) answer left; answers the attempt's key."""
    with gateway_process(run_dir, port=port) as gw, GatewayClient(gw.url, gw.token) as admin:
        admin.register_models([{"model": "policy", "endpoint": endpoint}])
        admin.create_rollouts([{"rollout_id": "r"}])
        key = admin.patch_rollout("r", "running").attempt_key or ""
        fake.raw_next = [vllm_answer(BIG, stream)]
        harness = post_and_never_read(gw.url, path, key, body)
        deadline = time.monotonic() + 30
        while not admin.get_events("r", type="model_request"):
            assert time.monotonic() < deadline, "the call was never recorded"
            time.sleep(0.05)
        gw.kill()
        harness.close()
    return key


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_an_answer_lost_to_kill_9_is_replayed_to_the_retry(
    run_dir: Path, upstream: tuple[str, FakeVllm], fake: FakeVllm, stream: bool
) -> None:
    """The gateway recorded a call and died before its answer left: the harness's retry
    of the same request gets the recorded answer (``Idempotent-Replayed``), and the call
    is recorded once. An identical request to the same process later is a new call."""
    port = free_port()
    body = orjson.dumps(
        {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    )
    path = PROXY_ROOT + "/openai/v1/chat/completions"
    key = lose_an_answer(run_dir, port, upstream[0], fake, path, body, stream)

    with gateway_process(run_dir, port=port) as gw, GatewayClient(gw.url, gw.token) as admin:
        url = gw.url + path
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        retry = httpx.post(url, content=body, headers=headers, timeout=60)
        assert retry.status_code == 200 and retry.headers.get("idempotent-replayed") == "true"
        assert content_of(retry) == BIG
        (call,) = admin.get_events("r", type="model_request")
        assert call.data["response"] == BIG

        again = httpx.post(url, content=body, headers=headers, timeout=60)
        assert again.status_code == 200 and "idempotent-replayed" not in again.headers
        assert content_of(again) == reply_for([{"role": "user", "content": "hi"}])
        assert len(admin.get_events("r", type="model_request")) == 2


def test_a_lost_answer_is_replayed_only_to_the_api_it_was_asked_of(
    run_dir: Path, upstream: tuple[str, FakeVllm], fake: FakeVllm
) -> None:
    """A chat body is often a valid Messages body too: after the gateway died with a chat
    answer unsent, the same bytes to ``/anthropic/v1/messages`` are a new call (answered
    in Messages' shape, not with the chat answer), and the chat retry still gets its own."""
    port = free_port()
    body = orjson.dumps(
        {"model": "policy", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}
    )
    chat_path = PROXY_ROOT + "/openai/v1/chat/completions"
    key = lose_an_answer(run_dir, port, upstream[0], fake, chat_path, body, stream=False)

    with gateway_process(run_dir, port=port) as gw, GatewayClient(gw.url, gw.token) as admin:
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        messages = httpx.post(
            gw.url + PROXY_ROOT + "/anthropic/v1/messages",
            content=body,
            headers=headers,
            timeout=60,
        )
        assert messages.status_code == 200 and "idempotent-replayed" not in messages.headers
        assert messages.json()["type"] == "message", messages.text[:300]
        chat = httpx.post(gw.url + chat_path, content=body, headers=headers, timeout=60)
        assert chat.status_code == 200 and chat.headers.get("idempotent-replayed") == "true"
        assert content_of(chat) == BIG
        calls = admin.get_events("r", type="model_request")
        assert [c.data.get("api", "chat") for c in calls] == ["chat", "anthropic"]
