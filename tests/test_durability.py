"""What the gateway acknowledged survives kill -9 and a restart on the same file."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import openai

from agl.core.client import GatewayClient, proxy_base_url
from agl.core.records import EventIn
from agl.testing.fake_vllm import FakeVllm
from agl.testing.processes import gateway_process


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
        deadline = time.monotonic() + 30
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
        key = admin.get_rollout(some).attempt_key
        assert GatewayClient(gw.url, key or "").get_rollout(some).rollout_id == some
