"""The proxy's router: least loaded at a rollout's first call, then sticky; what moves when
endpoints are published, removed or added; what a completed rollout gives back. The
invariants are checked by Hypothesis on the router alone, and end to end through a real
gateway in front of four fake vLLM servers."""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from agl.core.client import GatewayClient
from agl.core.contracts.records import ModelEndpoint, Rollout
from agl.core.gateway.router import Router
from agl.core.http_errors import ApiError
from agl.testing.fake_vllm import serve_in_thread
from agl.testing.processes import GatewayProcess, gateway_process
from bench.routing import endpoints, trainer_ids
from tests.conftest import agent

POOL = [f"http://127.0.0.1:{8001 + i}/v1" for i in range(8)]
ROLLOUTS = [f"t0.{j}.{k}" for j in range(6) for k in range(8)]


def registered(urls: list[str], version: int = 0, model: str = "policy") -> list[ModelEndpoint]:
    return [ModelEndpoint(model=model, endpoint=u, policy_version=version) for u in urls]


class Routing(RuleBasedStateMachine):
    """Calls, completions, publishes, removals and additions in any order, against a
    reference of where each running rollout was placed."""

    def __init__(self) -> None:
        super().__init__()
        self.router = Router()
        self.urls = POOL[:4]
        self.version = 0
        self.router.load(registered(self.urls))
        self.placed: dict[str, str] = {}  # rollout -> URL, as first answered

    @rule(rollout=st.sampled_from(ROLLOUTS))
    def call(self, rollout: str) -> None:
        before = self.router.loads()
        got = self.router.pick("any-name", rollout)
        assert got.policy_version == self.version and got.endpoint in self.urls
        if rollout in self.placed:
            assert got.endpoint == self.placed[rollout]  # sticky
        else:  # a first call: onto an endpoint with the fewest rollouts placed
            assert before.get(got.endpoint, 0) == min(before.get(u, 0) for u in self.urls)
            self.placed[rollout] = got.endpoint

    @rule(rollout=st.sampled_from(ROLLOUTS))
    def complete(self, rollout: str) -> None:
        self.router.forget(rollout)
        self.placed.pop(rollout, None)

    @rule()
    def publish(self) -> None:
        """New weights on the same URLs: nobody moves."""
        self.version += 1
        self.router.load(registered(self.urls, self.version))

    @precondition(lambda self: len(self.urls) > 1)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        """Only the removed endpoint's rollouts move (at their next call)."""
        gone = data.draw(st.sampled_from(self.urls))
        self.urls = [u for u in self.urls if u != gone]
        self.router.load(registered(self.urls, self.version))
        self.placed = {r: u for r, u in self.placed.items() if u != gone}

    @precondition(lambda self: len(self.urls) < len(POOL))
    @rule()
    def add(self) -> None:
        self.urls = [*self.urls, next(u for u in POOL if u not in self.urls)]
        self.router.load(registered(self.urls, self.version))

    @invariant()
    def loads_count_the_placed(self) -> None:
        assert self.router.loads() == dict(Counter(self.placed.values()))


TestRouting = Routing.TestCase


@given(
    groups=st.integers(1, 64),
    group_size=st.integers(1, 8),
    replicas=st.sampled_from([2, 4, 8]),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_batch_spreads_as_evenly_as_it_can(
    groups: int, group_size: int, replicas: int, seed: int
) -> None:
    """Whatever order a batch's first calls come in, no replica gets more than its fair
    share rounded up: within 1.25x of it from 4 rollouts a replica on."""
    router = Router()
    router.load(endpoints(replicas))
    ids = trainer_ids(3, groups, group_size)
    random.Random(seed).shuffle(ids)
    first = {r: router.pick("policy", r).endpoint for r in ids}
    busiest = max(Counter(first.values()).values())
    assert busiest == math.ceil(len(ids) / replicas)
    if len(ids) >= 4 * replicas:
        assert busiest <= 1.25 * len(ids) / replicas
    assert all(router.pick("policy", r).endpoint == u for r, u in first.items())


@given(capacity=st.integers(1, 8), extra=st.integers(0, 20))
def test_memory_is_bounded_by_forgetting_the_least_recently_called(
    capacity: int, extra: int
) -> None:
    router = Router(capacity)
    router.load(registered(POOL[:3]))
    keep = router.pick("policy", "kept").endpoint
    for i in range(capacity + extra):
        router.pick("policy", f"r{i}")
        router.pick("policy", "kept")  # called all along: never the one forgotten
        assert sum(router.loads().values()) <= capacity
    assert router.pick("policy", "kept").endpoint == keep


def test_a_rollout_has_a_place_per_model_and_gives_back_all_of_them() -> None:
    router = Router()
    router.load(registered(POOL[:2], model="policy") + registered(POOL[2:4], model="judge"))
    policy, judge = router.pick("policy", "r").endpoint, router.pick("judge", "r").endpoint
    assert policy in POOL[:2] and judge in POOL[2:4]
    assert router.loads() == {policy: 1, judge: 1}
    router.forget("r")
    assert router.loads() == {}
    with pytest.raises(ApiError, match="not registered"):
        router.pick("other", "r")  # two models: a name must be one of them


# -- end to end: the gateway learns of completions through its status patches ----------


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[GatewayProcess, list[str]]]:
    """A gateway in front of four fake vLLM servers, with a fast timeout sweep."""
    run_dir: Path = tmp_path_factory.mktemp("routing")
    with ExitStack() as stack:
        urls = [stack.enter_context(serve_in_thread())[0] for _ in range(4)]
        gateway = stack.enter_context(gateway_process(run_dir, sweep_interval_s=0.1))
        yield gateway, urls


def test_the_gateway_spreads_rollouts_and_refills_where_one_completed(
    four: tuple[GatewayProcess, list[str]],
) -> None:
    gateway, urls = four
    with GatewayClient(gateway.url, gateway.token, retries=0) as admin:
        admin.register_models(registered(urls, 1))

        def start(rollout_id: str, **spec: object) -> Rollout:
            admin.create_rollouts([{"rollout_id": rollout_id, "group_id": "g", **spec}])
            return admin.patch_rollout(rollout_id, "running")

        def call(r: Rollout) -> dict[str, object]:
            agent(gateway, r).chat.completions.create(
                model="policy", messages=[{"role": "user", "content": r.rollout_id}]
            )
            return [e.data for e in admin.get_events(r.rollout_id, type="model_request")][-1]

        batch = [start(f"t0.{j}.{k}") for j in range(2) for k in range(4)]
        first = {r.rollout_id: call(r)["endpoint"] for r in batch}
        assert Counter(first.values()) == dict.fromkeys(urls, 2)

        admin.register_models(registered(urls, 2))  # published: nobody moves
        for r in batch:
            again = call(r)
            assert (again["endpoint"], again["policy_version"]) == (first[r.rollout_id], 2)

        # Both rollouts on one replica complete: the next two go there.
        done = [r for r in batch if first[r.rollout_id] == urls[0]]
        for r in done:
            admin.patch_rollout(r.rollout_id, "succeeded")
        assert [call(start(f"t1.0.{k}"))["endpoint"] for k in range(2)] == [urls[0]] * 2

        # One that times out gives its place back too (the gateway's sweep fails it).
        running = {r.rollout_id: first[r.rollout_id] for r in batch if r not in done}
        running |= {f"t1.0.{k}": urls[0] for k in range(2)}
        late = start("t1.1.0", timeout_s=3.0)
        running[late.rollout_id] = call(late)["endpoint"]
        for k in range(1, 4):  # the other three replicas catch up with the late one's
            running[f"t1.1.{k}"] = call(start(f"t1.1.{k}"))["endpoint"]
        deadline = time.monotonic() + 60
        while admin.get_rollout(late.rollout_id).status != "failed":
            assert time.monotonic() < deadline, "the sweep never failed the late rollout"
            time.sleep(0.1)
        del running[late.rollout_id]
        loads = Counter(running.values())
        fewest = [u for u in urls if loads[u] == min(loads[v] for v in urls)]
        assert call(start("t1.2.0"))["endpoint"] in fewest
        with pytest.raises(openai.APIStatusError):
            call(late)  # over: refused before any endpoint is chosen
