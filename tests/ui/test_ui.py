"""The trajectory viewer (/ui): login and its cookie, what it refuses, escaping, the
list's filters, sorting and pages against a model, query counts at 10,000 rollouts, the
store's summaries and transitions (also for a store made before them), and a real
browser over a real short training run."""

from __future__ import annotations

import asyncio
import html
import os
import re
import sqlite3
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agl.core.client import GatewayClient
from agl.core.contracts.queries import HISTORY_SINCE, EventQuery
from agl.core.contracts.records import EventIn, RolloutSpec, Status, StatusPatch
from agl.core.gateway import app as gateway_module
from agl.core.gateway.app import create_app
from agl.core.gateway.config import GatewayConfig
from agl.core.gateway.store.sqlite import SqliteStore
from agl.strategies.merging import common_prefix_len
from agl.testing.processes import GatewayProcess, gateway_process
from agl.ui.session import COOKIE, Sessions, session_value
from agl.ui.throttle import LoginThrottle
from tests.conftest import SHORT_RUN, train_run

TOKEN = "test-admin-token"  # conftest's gateway fixture
_ROLLOUT_LINK = re.compile(r'class="rollout" href="/ui/rollouts/([^"]+)"')
_COUNT = re.compile(r'id="count">(\d+) rollouts?')


@contextmanager
def ui_client(gateway: GatewayProcess, login: bool = True) -> Iterator[httpx.Client]:
    # generous: a page that retokenizes a run takes its time on a starved machine
    with httpx.Client(base_url=gateway.url, timeout=120) as client:
        if login:
            answer = client.post("/ui/login", data={"token": gateway.token, "next": "/ui"})
            assert answer.status_code == 303, answer.text
        yield client


def listed(page: httpx.Response) -> list[str]:
    assert page.status_code == 200, page.text
    return _ROLLOUT_LINK.findall(page.text)


def count(page: httpx.Response) -> int:
    found = _COUNT.search(page.text)
    assert found is not None, page.text[:2000]
    return int(found.group(1))


def call_event(prompt: list[int], sampled: list[int], **data: Any) -> EventIn:
    return EventIn(
        type="model_request",
        data={
            "prompt_ids": prompt,
            "response_ids": sampled,
            "logprobs": [-0.5] * len(sampled),
            "policy_version": 0,
            "finish_reason": "stop",
            "latency_s": 0.01,
            **data,
        },
    )


# -- login, cookie, refusals ---------------------------------------------------------------


def test_pages_redirect_to_login_until_the_admin_token_is_given(gateway: GatewayProcess) -> None:
    with ui_client(gateway, login=False) as client:
        for path in ("/ui", "/ui/rollouts/nope", "/ui/groups/g?x=1"):
            answer = client.get(path)
            assert answer.status_code == 303
            assert answer.headers["location"].startswith("/ui/login?next=")
        assert client.get("/ui/login").status_code == 200
        wrong = client.post("/ui/login", data={"token": "not-the-token", "next": "/ui"})
        assert wrong.status_code == 401 and "set-cookie" not in wrong.headers
        assert "not the gateway" in wrong.text

        good = client.post("/ui/login", data={"token": TOKEN, "next": "/ui?sort=reward"})
        assert good.status_code == 303 and good.headers["location"] == "/ui?sort=reward"
        cookie = good.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/ui" in cookie
        assert f"Max-Age={12 * 3600}" in cookie  # the default ui_session_hours
        assert TOKEN not in cookie  # derived from the token, not the token
        assert client.get("/ui").status_code == 200

    # a made-up cookie is no session; the admin token as a Bearer header is
    forged = httpx.get(f"{gateway.url}/ui", cookies={COOKIE: "0" * 64})
    assert forged.status_code == 303
    bearer = httpx.get(f"{gateway.url}/ui", headers={"Authorization": f"Bearer {TOKEN}"})
    assert bearer.status_code == 200
    real = httpx.get(f"{gateway.url}/ui", cookies={COOKIE: session_value(TOKEN, int(time.time()))})
    assert real.status_code == 200


def test_login_goes_only_to_viewer_pages(gateway: GatewayProcess) -> None:
    with ui_client(gateway, login=False) as client:
        for target in ("https://evil.example/", "//evil.example/ui", "/api/rollouts", ""):
            answer = client.post("/ui/login", data={"token": TOKEN, "next": target})
            assert answer.headers["location"] == "/ui"


def test_login_percent_encodes_where_it_goes_next(gateway: GatewayProcess) -> None:
    group = f"组一-{uuid.uuid4().hex[:6]}"  # a group id in CJK: not Latin-1, as a header is
    with GatewayClient(gateway.url, gateway.token) as admin:
        admin.create_rollouts([{"rollout_id": f"r-{uuid.uuid4().hex[:12]}", "group_id": group}])
    page = "/ui/groups/" + quote(group, safe="")
    with ui_client(gateway, login=False) as client:
        to_login = client.get(page)
        assert to_login.status_code == 303
        form = client.get(to_login.headers["location"])
        target = re.search(r'name="next" value="([^"]*)"', form.text)
        assert target is not None, form.text
        answer = client.post("/ui/login", data={"token": TOKEN, "next": html.unescape(target[1])})
        assert answer.status_code == 303, answer.text
        assert answer.headers["location"] == page
        assert client.get(page).status_code == 200
        # Logged in, the login page sends a CJK target on as well.
        again = client.get("/ui/login", params={"next": f"/ui?group={group}&sort=reward"})
        assert again.status_code == 303
        assert again.headers["location"] == f"/ui?group={quote(group)}&sort=reward"
        for target in ("//evil.example", "https://evil.example", "/\\evil.example", "组"):
            answer = client.post("/ui/login", data={"token": TOKEN, "next": target})
            assert answer.headers["location"] == "/ui", target


def test_a_session_lasts_its_lifetime_and_its_issue_time_is_signed(
    gateway: GatewayProcess,
) -> None:
    lifetime = 12 * 3600  # the default ui_session_hours
    now = int(time.time())
    fresh = session_value(TOKEN, now - lifetime + 600)
    expired = session_value(TOKEN, now - lifetime - 1)
    _, nonce, mac = expired.split(".")
    moved = f"{now}.{nonce}.{mac}"  # an old cookie given a new issue time
    for cookie, status in ((fresh, 200), (expired, 303), (moved, 303)):
        answer = httpx.get(f"{gateway.url}/ui", cookies={COOKIE: cookie})
        assert answer.status_code == status, cookie


def cookie_of(set_cookie: str) -> str:
    return set_cookie.split(";")[0].removeprefix(f"{COOKIE}=")


def test_sessions_expire_by_their_clock_and_end_at_logout() -> None:
    clock = [1_000_000.0]
    sessions = Sessions(TOKEN, lifetime_s=100.0, clock=lambda: clock[0])
    cookie = cookie_of(sessions.start())
    assert "Max-Age=100;" in sessions.start()
    assert sessions.valid(cookie)
    clock[0] += 99
    assert sessions.valid(cookie)
    clock[0] += 1
    assert not sessions.valid(cookie)
    other = Sessions("another token", lifetime_s=100.0, clock=lambda: clock[0])
    assert not sessions.valid(cookie_of(other.start()))

    cookie = cookie_of(sessions.start())
    assert "Max-Age=0;" in sessions.end(cookie)
    assert not sessions.valid(cookie)  # a copy of a logged-out cookie is refused too
    assert sessions.valid(cookie_of(sessions.start()))
    for made_up in (None, "", ".", "1.2", "x.0123456789abcdef." + "0" * 64, "\uff11\uff12.ab"):
        assert not sessions.valid(made_up)


def test_logout_ends_the_session(gateway: GatewayProcess) -> None:
    with ui_client(gateway) as client:
        cookie = client.cookies[COOKIE]
        page = client.get("/ui")
        assert '<form class="logout" method="post" action="/ui/logout">' in page.text
        out = client.post("/ui/logout")
        assert out.status_code == 303 and out.headers["location"] == "/ui/login"
        assert "Max-Age=0" in out.headers["set-cookie"]
        assert COOKIE not in client.cookies
        assert client.get("/ui").status_code == 303
    # The cookie as it was (say, copied) no longer opens the viewer either.
    copied = httpx.get(f"{gateway.url}/ui", cookies={COOKIE: cookie})
    assert copied.status_code == 303
    with ui_client(gateway) as client:  # a new login is a new session
        assert client.get("/ui").status_code == 200


def test_failed_logins_from_an_address_are_refused_for_a_backoff(tmp_path: Path) -> None:
    free = LoginThrottle().free_failures
    with gateway_process(tmp_path / "gateway", token=TOKEN) as gateway:
        with ui_client(gateway, login=False) as client:
            for _ in range(free):
                wrong = client.post("/ui/login", data={"token": "guess", "next": "/ui"})
                assert wrong.status_code == 401
            for token in ("guess", TOKEN):  # now even the right token waits
                refused = client.post("/ui/login", data={"token": token, "next": "/ui"})
                assert refused.status_code == 429, refused.text
                assert int(refused.headers["retry-after"]) >= 1
                assert "set-cookie" not in refused.headers
            bearer = client.get("/ui", headers={"Authorization": f"Bearer {TOKEN}"})
            assert bearer.status_code == 200  # curl with the token is not throttled
        # Another address is not held up by this one's failures.
        elsewhere = httpx.HTTPTransport(local_address="127.0.0.2")
        with httpx.Client(base_url=gateway.url, transport=elsewhere, timeout=30) as client:
            login = client.post("/ui/login", data={"token": TOKEN, "next": "/ui"})
            assert login.status_code == 303, login.text


def test_the_login_throttle_backs_off_doubling_and_forgets_by_its_clock() -> None:
    clock = [0.0]
    throttle = LoginThrottle(
        free_failures=3,
        first_wait_s=1.0,
        max_wait_s=8.0,
        forget_after_s=100.0,
        max_addresses=2,
        clock=lambda: clock[0],
    )
    for _ in range(2):
        throttle.failed("a")
        assert throttle.wait("a") == 0.0
    waits = []
    for _ in range(6):
        throttle.failed("a")
        waits.append(throttle.wait("a"))
        clock[0] += waits[-1]
        assert throttle.wait("a") == 0.0  # the backoff passed
    assert waits == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    throttle.failed("a")
    throttle.succeeded("a")  # the right token clears the address
    assert throttle.wait("a") == 0.0
    for _ in range(3):
        throttle.failed("b")
    assert throttle.wait("b") == 1.0 and throttle.wait("c") == 0.0
    clock[0] += 101  # quiet for forget_after_s: forgotten at the next failure
    throttle.failed("c")
    assert len(throttle) == 1
    throttle.failed("d")
    throttle.failed("e")  # past max_addresses the oldest goes
    assert len(throttle) == 2 and throttle.wait("c") == 0.0


def test_an_attempt_key_never_opens_the_viewer(gateway: GatewayProcess, running: Any) -> None:
    rollout = running()
    key = rollout.attempt_key
    assert key
    as_agent = httpx.get(f"{gateway.url}/ui", headers={"Authorization": f"Bearer {key}"})
    assert as_agent.status_code == 403
    with ui_client(gateway, login=False) as client:
        login = client.post("/ui/login", data={"token": key, "next": "/ui"})
        assert login.status_code == 403 and "set-cookie" not in login.headers
        assert "attempt key" in login.text


def test_the_viewer_is_read_only(gateway: GatewayProcess, running: Any) -> None:
    rollout = running()
    with ui_client(gateway) as client:
        for method in ("POST", "PUT", "PATCH", "DELETE"):
            for path in ("/ui", f"/ui/rollouts/{rollout.rollout_id}", "/ui/groups/g"):
                assert client.request(method, path).status_code == 405, (method, path)
    with GatewayClient(gateway.url, gateway.token) as admin:
        assert admin.get_rollout(rollout.rollout_id).version == rollout.version


# -- escaping --------------------------------------------------------------------------------

SCRIPT = "<script>alert('x')</script>"
IMG = '<img src=x onerror="alert(1)">'


def test_what_rollouts_hold_is_shown_as_text(gateway: GatewayProcess, admin: GatewayClient) -> None:
    rollout_id = f"x-{uuid.uuid4().hex[:8]}"
    group = f"{SCRIPT}{uuid.uuid4().hex[:4]}"
    admin.create_rollouts(
        [
            {
                "rollout_id": rollout_id,
                "group_id": group,
                "input": {"task": SCRIPT, IMG: IMG},
                "metadata": {"note": SCRIPT},
            }
        ]
    )
    admin.patch_rollout(rollout_id, "running")
    admin.post_events(
        rollout_id,
        1,
        [
            call_event(
                [1, 2],
                [3],
                messages=[{"role": "user", "content": SCRIPT}, {"role": IMG, "content": [IMG]}],
                response=SCRIPT,
                tool_calls=[{"function": {"name": SCRIPT, "arguments": IMG}}],
            ),
            EventIn(type=SCRIPT, data={IMG: SCRIPT}),
            EventIn(type="reward", data={"value": 1.0, "why": SCRIPT}),
        ],
    )
    admin.patch_rollout(rollout_id, "failed", error=SCRIPT)
    with ui_client(gateway) as client:
        pages = [
            client.get("/ui", params={"group": group}),
            client.get(f"/ui/rollouts/{rollout_id}"),
            client.get("/ui/groups/" + quote(group, safe="")),
            client.get("/ui/rollouts/" + "%3Cscript%3E"),  # an error page naming the id
        ]
        for page in pages[:3]:
            assert page.status_code == 200, page.text
        for page in pages:
            body = page.text
            assert "<script" not in body.lower() and "<img" not in body.lower()
            assert 'onerror="' not in body
            assert "default-src 'none'" in page.headers["content-security-policy"]
        # shown, as text: input, metadata, message, response, tool call, event, error
        assert pages[1].text.count("&lt;script&gt;") >= 7


# -- the list against a model ----------------------------------------------------------------

REWARDS = (-1.0, 0.0, 0.5, 1.0, None)
POPULATION = 130  # three pages


@pytest.fixture(scope="module")
def population(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[GatewayProcess, list]]:
    """A gateway holding only POPULATION rollouts of known shape; answers it and the
    model: one dict per rollout in creation order."""
    import random

    rng = random.Random(7)
    run_dir = tmp_path_factory.mktemp("population")
    with (
        gateway_process(run_dir, token=TOKEN, attempt_rps=0) as gw,
        GatewayClient(gw.url, gw.token) as admin,
    ):
        specs = []
        for i in range(POPULATION):
            mode = rng.choice(["train", "val"])
            step = rng.randrange(4)
            specs.append(
                {
                    "rollout_id": f"p{i:03d}",
                    "group_id": f"g{rng.randrange(10)}",
                    "mode": mode,
                    "metadata": {"batch": step} if mode == "train" else {"step": step},
                    "input": {"i": i},
                }
            )
        admin.create_rollouts(specs)
        model = []
        for spec in specs:
            rid = spec["rollout_id"]
            status = rng.choice(["queuing", "running", "succeeded", "failed"])
            calls = rng.randrange(4)
            lengths = [rng.randrange(1, 9) for _ in range(calls)]
            reward = rng.choice(REWARDS)
            events = [call_event([k], [7] * n) for k, n in enumerate(lengths)]
            if reward is not None:
                events.append(EventIn(type="reward", data={"value": 5.0}))  # overwritten
                events.append(EventIn(type="reward", data={"value": reward}))
            if status != "queuing":
                admin.patch_rollout(rid, "running")
            if events:
                admin.post_events(rid, 1, events)
            if status in ("succeeded", "failed"):
                admin.patch_rollout(rid, status)
            record = admin.get_rollout(rid)
            duration = (
                None
                if record.started_at is None or record.ended_at is None
                else record.ended_at - record.started_at
            )
            meta = spec["metadata"]
            step = meta["step"] if "step" in meta else meta["batch"] + 1
            model.append(
                {
                    "id": rid,
                    "group": spec["group_id"],
                    "mode": spec["mode"],
                    "step": step,
                    "status": status,
                    "reward": reward,
                    "turns": calls if events else None,
                    "tokens": sum(lengths) if events else None,
                    "duration": duration,
                    "created": record.created_at,
                }
            )
        yield gw, model


def expected(model: list[dict[str, Any]], query: dict[str, Any]) -> list[str]:
    rows = [
        r
        for r in model
        if (query["status"] is None or r["status"] == query["status"])
        and (query["mode"] is None or r["mode"] == query["mode"])
        and (query["step"] is None or r["step"] == query["step"])
        and (query["group"] is None or r["group"] == query["group"])
        and (
            query["min_reward"] is None
            or (r["reward"] is not None and r["reward"] >= query["min_reward"])
        )
        and (
            query["max_reward"] is None
            or (r["reward"] is not None and r["reward"] <= query["max_reward"])
        )
    ]
    key = query["sort"]
    position = {r["id"]: i for i, r in enumerate(model)}
    value = {"created": lambda r: position[r["id"]]}.get(key, lambda r: r[key])
    present = [r for r in rows if value(r) is not None]
    missing = [r for r in rows if value(r) is None]
    # ties in creation order whatever the direction; rows without the key last
    present.sort(key=lambda r: position[r["id"]])
    present.sort(key=value, reverse=query["order"] == "desc")
    return [r["id"] for r in present + missing]


queries = st.fixed_dictionaries(
    {
        "status": st.none() | st.sampled_from([s.value for s in Status]),
        "mode": st.none() | st.sampled_from(["train", "val"]),
        "step": st.none() | st.integers(0, 4),
        "group": st.none() | st.sampled_from([f"g{i}" for i in range(10)]),
        "min_reward": st.none() | st.sampled_from(REWARDS[:-1]),
        "max_reward": st.none() | st.sampled_from(REWARDS[:-1]),
        "sort": st.sampled_from(["created", "reward", "turns", "tokens", "duration"]),
        "order": st.sampled_from(["asc", "desc"]),
        "page": st.integers(1, 4),
    }
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(query=queries)
def test_filters_sort_and_pages_match_a_model(population: Any, query: dict[str, Any]) -> None:
    gateway, model = population
    params = {k: v for k, v in query.items() if v is not None}
    page = httpx.get(
        f"{gateway.url}/ui",
        params=params,
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=30,
    )
    want = expected(model, query)
    start = (query["page"] - 1) * 50
    assert listed(page) == want[start : start + 50]
    assert count(page) == len(want)


def test_every_page_once_and_in_order(population: Any) -> None:
    gateway, model = population
    seen: list[str] = []
    with ui_client(gateway) as client:
        url = "/ui?sort=tokens&order=desc"
        while url:
            page = client.get(url)
            seen += listed(page)
            found = re.search(r'rel="next" href="([^"]+)"', page.text)
            url = html.unescape(found.group(1)) if found else ""
    query = {k: None for k in ("status", "mode", "step", "group", "min_reward", "max_reward")}
    assert seen == expected(model, {**query, "sort": "tokens", "order": "desc"})
    assert len(seen) == POPULATION


def test_a_bad_filter_is_a_400_that_says_which(population: Any) -> None:
    gateway, _ = population
    with ui_client(gateway) as client:
        for params, word in (
            ({"step": "two"}, "step"),
            ({"sort": "colour"}, "sort"),
            ({"status": "done"}, "status"),
            ({"min_reward": "nan"}, "min_reward"),
            ({"page": "0"}, "page"),
        ):
            page = client.get("/ui", params=params)
            assert page.status_code == 400 and word in page.text


# -- 10,000 rollouts: a bounded number of queries per page ----------------------------------


RUNNING = StatusPatch(status=Status.RUNNING)


async def _fill(path: Path, n: int) -> None:
    store = SqliteStore(path)
    specs = [
        RolloutSpec(rollout_id=f"r{i:05d}", group_id=f"g{i // 8}", metadata={"batch": i // 1000})
        for i in range(n)
    ]
    await store.create_rollouts(specs, 1000.0)
    for start in range(0, n, 500):
        chunk = range(start, min(n, start + 500))
        await asyncio.gather(
            *(
                store.patch_rollout(f"r{i:05d}", StatusPatch(status="running"), 1001.0)
                for i in chunk
            )
        )
        await asyncio.gather(
            *(
                store.append_events(
                    f"r{i:05d}",
                    1,
                    [
                        call_event(list(range(20)), list(range(i % 13 + 1))),
                        EventIn(type="reward", data={"value": (i * 7919) % 10 / 10}),
                    ],
                    1002.0 + i % 17,
                )
                for i in chunk
            )
        )
        await asyncio.gather(
            *(
                store.patch_rollout(f"r{i:05d}", StatusPatch(status="succeeded"), 1003.0 + i % 29)
                for i in chunk
            )
        )
    await store.close()


def test_ten_thousand_rollouts_cost_a_few_queries_per_page(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from starlette.testclient import TestClient

    run_dir = tmp_path / "gateway"
    asyncio.run(_fill(run_dir / "gateway.db", 10_000))
    statements: list[str] = []
    opened = gateway_module.open_store

    def traced(url: str, **options: Any) -> Any:
        store = opened(url, **options)
        store._db.set_trace_callback(statements.append)
        return store

    monkeypatch.setattr(gateway_module, "open_store", traced)
    # the timeout sweeper's query is the gateway's background work, not a page's: keep it
    # out of the count (under load a page could straddle a sweep)
    config = GatewayConfig(run_dir=str(run_dir), sweep_interval_s=3600.0)
    app = create_app(config, TOKEN)
    pages = {
        "first page": "/ui",
        "sorted by reward, page 150": "/ui?sort=reward&order=desc&page=150",
        "sorted by duration, filtered": "/ui?sort=duration&mode=train&step=3&min_reward=0.5",
        "sorted by tokens": "/ui?sort=tokens&order=asc",
        "sorted by turns, by status": "/ui?sort=turns&status=succeeded&page=7",
    }
    with TestClient(app, headers={"Authorization": f"Bearer {TOKEN}"}) as client:
        for name, path in pages.items():
            statements.clear()
            page = client.get(path)
            assert page.status_code == 200, page.text
            assert len(listed(page)) == 50, name
            # one COUNT and one page, whatever the page, sort or filter; no event is read
            assert len(statements) == 2, (name, statements)
            assert not any(re.search(r"(FROM|JOIN) events\b", s) for s in statements), name
        statements.clear()
        assert client.get("/ui/rollouts/r05000").status_code == 200
        assert len(statements) <= 6, statements  # rollout, history, summaries, events, meta
        statements.clear()
        assert client.get("/ui/groups/g625").status_code == 200
        assert len(statements) <= 2 + 8, statements  # the group, then each rollout's events
        by_reward = client.get("/ui?sort=reward&order=desc&page=1")
        assert "0.900" in by_reward.text


# -- the store: summaries and transitions ----------------------------------------------------

event_data = st.one_of(
    st.none(),
    st.integers(-5, 5),
    st.text(max_size=3),
    st.lists(st.integers(0, 5), max_size=3),
    st.fixed_dictionaries(
        {},
        optional={
            "prompt_ids": st.none() | st.lists(st.integers(0, 99), max_size=6),
            "response_ids": st.none() | st.lists(st.integers(0, 99), max_size=6),
            "value": st.none()
            | st.booleans()
            | st.integers(-3, 3)
            | st.floats(-2, 2)
            | st.text(max_size=2),
        },
    ),
)
events_in = st.lists(
    st.tuples(
        st.integers(1, 2),
        st.sampled_from(["model_request", "model_request_failed", "reward", "custom"]),
        event_data,
    ),
    max_size=25,
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(events=events_in)
def test_summaries_kept_as_appended_equal_those_built_from_an_old_store(
    tmp_path: Path, events: list[tuple[int, str, Any]]
) -> None:
    """What append_events keeps, and what a store made before summaries gets from its
    events when opened (SQL over the stored JSON), are the same numbers, and the same
    reward as the trainer reads (the last reward event's number)."""
    path = tmp_path / f"{uuid.uuid4().hex}.db"

    async def write() -> list[Any]:
        store = SqliteStore(path)
        await store.create_rollouts([RolloutSpec(rollout_id="r")], 1.0)
        for i, (attempt, kind, data) in enumerate(events):
            await store.append_events("r", attempt, [EventIn(type=kind, data=data)], 2.0 + i)
        kept = await store.summaries("r")
        await store.close()
        return kept

    kept = asyncio.run(write())
    for attempt in (1, 2):
        mine = [(k, d) for a, k, d in events if a == attempt]
        summary = next((s for s in kept if s.attempt == attempt), None)
        assert (summary is None) == (not mine)
        if summary is None:
            continue
        rewards = [d for k, d in mine if k == "reward"]
        last = rewards[-1] if rewards else None
        value = last.get("value") if isinstance(last, dict) else None
        assert summary.reward == (float(value) if isinstance(value, int | float) else None)
        assert summary.calls == sum(k == "model_request" for k, _ in mine)

    with sqlite3.connect(path) as db:  # back to the schema before summaries
        db.execute("DROP TABLE attempt_summaries")
        db.execute("DROP TABLE transitions")
        db.execute("DELETE FROM meta")

    async def reopen() -> tuple[list[Any], str | None]:
        store = SqliteStore(path)
        built = await store.summaries("r")
        since = await store.get_meta(HISTORY_SINCE)
        await store.close()
        return built, since

    built, since = asyncio.run(reopen())
    assert built == kept
    assert since is not None


def test_status_history_is_recorded_with_each_change(
    gateway: GatewayProcess, admin: GatewayClient
) -> None:
    rollout_id = f"h-{uuid.uuid4().hex[:8]}"
    admin.create_rollouts([{"rollout_id": rollout_id, "group_id": "h", "max_attempts": 2}])
    admin.patch_rollout(rollout_id, "running")
    admin.patch_rollout(rollout_id, "running")  # a no-op: not a change
    admin.patch_rollout(rollout_id, "failed", error="worker died")
    admin.patch_rollout(rollout_id, "queuing", attempt=1)
    admin.patch_rollout(rollout_id, "running")
    admin.patch_rollout(rollout_id, "succeeded")
    with ui_client(gateway) as client:
        page = client.get(f"/ui/rollouts/{rollout_id}").text
    table = page.split('id="history"')[1].split("</table>")[0]
    rows = re.findall(r'<td class="num">(\d+)</td><td class="status-(\w+)">', table)
    assert rows == [
        ("1", "queuing"),
        ("1", "running"),
        ("1", "failed"),
        ("2", "queuing"),
        ("2", "running"),
        ("2", "succeeded"),
    ]
    assert "worker died" in table


def test_a_rollout_page_shows_calls_rewards_and_events_in_order(
    gateway: GatewayProcess, admin: GatewayClient
) -> None:
    rollout_id = f"c-{uuid.uuid4().hex[:8]}"
    admin.create_rollouts([{"rollout_id": rollout_id, "group_id": "c", "input": {"q": 1}}])
    admin.patch_rollout(rollout_id, "running")
    first = [{"role": "user", "content": "question one"}]
    second = [
        *first,
        {"role": "assistant", "content": "answer one"},
        {"role": "user", "content": "two"},
    ]
    admin.post_events(
        rollout_id,
        1,
        [
            call_event([1, 2], [3, 4], messages=first, response="answer one", policy_version=4),
            call_event([1, 2], [5], messages=first, response="retried"),  # same prompt
            EventIn(type="tool_result", data={"ok": True}),
            call_event([1, 2, 5, 9], [6], messages=second, response="answer two"),
            call_event([1, 2, 5, 9, 6], [], messages=second, response=""),  # no token ids
            EventIn(type="reward", data={"value": 0.25}),
        ],
    )
    with ui_client(gateway) as client:
        page = client.get(f"/ui/rollouts/{rollout_id}").text
    kinds = re.findall(r'class="item kind-(\w+)"', page)
    assert kinds == ["call", "call", "event", "call", "call", "reward"]
    assert "left out: no_response_ids" in page  # as the trainer reads calls
    assert page.index("question one") < page.index("tool_result") < page.index("answer two")
    assert "retried: a later call has the same prompt" in page
    assert "call 0" in page and "call 1" in page  # the kept calls, as samples number them
    assert "policy version: <b>4</b>" in page
    assert page.count("1 earlier message as in the call before") == 2
    assert "3 earlier messages as in the call before" in page
    assert page.count("question one") == 1  # not repeated with every call
    assert "No run folder" in page


def test_summaries_and_events_stay_consistent_under_concurrent_appends(tmp_path: Path) -> None:
    """Group commit: many appends in one transaction each add once to the summary, and
    a retried event id adds nothing."""

    async def run() -> tuple[Any, int]:
        store = SqliteStore(tmp_path / "c.db")
        await store.create_rollouts([RolloutSpec(rollout_id="r")], 1.0)
        batch = [call_event([i], [1, 2, 3]) for i in range(50)]
        await asyncio.gather(
            *(
                store.append_events("r", 1, [e.model_copy(update={"event_id": f"e{i}"})], 2.0)
                for i, e in enumerate(batch)
            )
        )
        await store.append_events(
            "r", 1, [batch[0].model_copy(update={"event_id": "e0"})], 3.0
        )  # a retry
        (summary,) = await store.summaries("r")
        events = await store.list_events("r", EventQuery())
        await store.close()
        return summary, len(events)

    summary, stored = asyncio.run(run())
    assert stored == summary.events == summary.calls == 50
    assert summary.tokens == 150 and summary.last_event_at == 2.0


# -- a real browser over a real run ----------------------------------------------------------

CHROMIUM = "/usr/bin/chromium"  # Debian's (.ci/run installs it); never `playwright install`
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]
RUN_TOKEN = "ui-browser-test-token-0123456789"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Headless chromium. Missing, the test is skipped with the line that installs it
    (tests/run does); there but broken, it fails."""
    pytest.importorskip(
        "playwright", reason="Playwright is not installed: pip install -e '.[test]'"
    )
    from playwright.sync_api import Error, sync_playwright

    if not Path(CHROMIUM).is_file():
        pytest.skip(
            f"no chromium at {CHROMIUM}: apt-get install -y chromium (Debian's; Playwright "
            "must not download a browser of its own)"
        )
    with sync_playwright() as playwright:
        try:
            launched = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        except Error as error:
            first = str(error).strip().splitlines()[0]
            pytest.fail(f"chromium at {CHROMIUM} did not start headless: {first}")
        yield launched
        launched.close()


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A short run whose warm-up samples noncanonical segmentations three times as often as
    the task's (0.3, not 0.1): the viewer's break pages need one, and a machine's CPU
    kernels were seen to give the default warm-up none in 64 rollouts."""
    folder = tmp_path_factory.mktemp("trained_run") / "run"
    return train_run(folder, *SHORT_RUN, "task.warmup_options.dropout=0.3")


def retokenized(gateway: GatewayProcess, run: Path) -> list[tuple[Any, Any]]:
    """The rollouts with a break whose two sides spell the same text, found here with
    ``agl.core.trainer.explain`` over the events as the API gives them: (rollout, break)."""
    from agl.core.run_folder import load_run
    from agl.core.trainer.explain import calls_from_events, explain

    info = load_run(run)
    merge, decode = info.merge(), info.decode_token()
    found = []
    with GatewayClient(gateway.url, gateway.token) as admin:
        for rollout in admin.list_rollouts(mode="train"):
            events = admin.get_events(rollout.rollout_id, attempt=rollout.attempt)
            x = explain(calls_from_events(events), merge, decode)
            found += [(rollout, b) for b in x.breaks if b.same_text]
    return found


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def logged_in(
    browser: Any, url: str, token: str, width: int = 1280, height: int = 720
) -> tuple[Any, list[str]]:
    """A new page sent from ``/ui`` to the login and logged in, and the list the console
    errors it meets go to (a stylesheet or form the page's CSP refused, say)."""
    page = browser.new_page(viewport={"width": width, "height": height})
    problems: list[str] = []
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.goto(f"{url}/ui")
    assert "/ui/login" in page.url
    page.fill("#token", token)
    page.click("button[type=submit]")
    page.wait_for_url(f"{url}/ui")
    return page, problems


@pytest.mark.slow
def test_a_browser_clicks_from_the_list_to_a_break_and_its_group(
    browser: Any, trained_run: Path, tmp_path: Path
) -> None:
    shots = Path(os.environ.get("AGL_UI_SCREENSHOTS", tmp_path))  # to look at them
    from agl.ui.render import visible

    assert (trained_run / "config.yaml").is_file()
    with gateway_process(trained_run / "gateway", token=RUN_TOKEN) as gw:
        candidates = retokenized(gw, trained_run)
        assert candidates, "the run had no retokenization break to show"
        rollout, detail = candidates[0]
        first = common_prefix_len(detail.before_ids, detail.after_ids)

        page, problems = logged_in(browser, gw.url, RUN_TOKEN, width=1400, height=1000)
        assert int(page.inner_text("#count").split()[0]) >= 64

        # the list, narrowed to the rollout's group and sorted by turns, then a click
        page.fill("input[name=group]", rollout.group_id)
        page.select_option("select[name=sort]", "turns")
        page.click("form.filters button[type=submit]")
        page.wait_for_url("**sort=turns**")
        ids = page.locator("a.rollout").all_inner_texts()
        assert rollout.rollout_id in ids and all(i.startswith(rollout.group_id) for i in ids)
        page.click(f"a.rollout:text-is('{rollout.rollout_id}')")
        page.wait_for_url(f"**/ui/rollouts/{rollout.rollout_id}")

        shown = page.locator(".break[data-reason=response_retokenized]").filter(
            has=page.locator(".same-text")
        )
        assert shown.count() >= 1
        box = shown.first
        differing = box.locator(".tok.diff").all_inner_texts()
        assert differing == [visible(detail.before[first]), visible(detail.after[first])]
        before_split = box.locator(".split-before").inner_text()
        after_split = box.locator(".split-after").inner_text()
        assert before_split != after_split
        assert before_split.replace("|", "") == after_split.replace("|", "")  # same text
        assert page.locator("h3", has_text="Samples under merge=prefix").count() >= 1
        shot = shots / "rollout.png"
        page.screenshot(path=str(shot), full_page=True)
        width, height = png_size(shot.read_bytes())
        assert width >= 1000 and height >= 800 and shot.stat().st_size > 20_000

        page.click("#group-link")
        page.wait_for_url("**/ui/groups/**")
        rows = page.locator("#group-table tbody tr")
        assert rows.count() == 8
        assert page.locator("#group-table th", has_text="advantage (sample level)").count() == 1
        group_shot = shots / "group.png"
        page.screenshot(path=str(group_shot), full_page=True)
        assert png_size(group_shot.read_bytes())[0] >= 1000
        assert not problems, problems  # e.g. the stylesheet refused by the page's CSP
        page.close()


def test_a_browser_logs_in_and_out(browser: Any, gateway: GatewayProcess) -> None:
    page, problems = logged_in(browser, gateway.url, TOKEN)
    page.click("form.logout button")
    page.wait_for_url(f"{gateway.url}/ui/login")
    page.goto(f"{gateway.url}/ui")
    assert "/ui/login" in page.url  # the session is over
    assert not problems, problems  # the form posts within the page's CSP
    page.close()


@pytest.mark.slow
def test_under_stitch_the_rollout_page_shows_where_a_prompt_was_changed(
    trained_run: Path, tmp_path: Path
) -> None:
    """The same recorded run, viewed as if it had trained with merge=stitch (``ui_run``
    names a copy of its folder whose config says so): a retokenized response is replaced by
    the sampled tokens, and the page shows the prompt as recorded and as trained."""
    import yaml

    folder = tmp_path / "as-stitch"
    folder.mkdir()
    config = yaml.safe_load((trained_run / "config.yaml").read_text())
    config["merge"] = {"name": "stitch"}
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    with gateway_process(trained_run / "gateway", token=RUN_TOKEN, ui_run=folder) as gw:
        rollout, _ = retokenized(gw, trained_run)[0]
        with ui_client(gw) as client:
            page = client.get(f"/ui/rollouts/{rollout.rollout_id}").text
    assert "Samples under merge=stitch" in page
    stitched = page.split('class="break stitch"')[1:]
    assert stitched, "no stitched call shown"
    assert stitched[0].count('class="tok diff"') == 2  # recorded vs trained, first difference
    assert "run " + str(folder) in html.unescape(page)


def test_the_agent_log_is_the_attempts_files_and_the_worker_lines_naming_the_rollout(
    tmp_path: Path,
) -> None:
    from agl.ui.agentlog import agent_log

    (tmp_path / "attempts").mkdir()
    (tmp_path / "attempts" / "t0.1.3.2.err").write_text("second attempt's stderr\n")
    (tmp_path / "workers").mkdir()
    (tmp_path / "workers" / "worker-0.log").write_text(
        "2026-11-30 14:09:26,236 INFO worker: ready\n"
        "2026-11-30 14:09:26,445 INFO httpx: POST /proxy/rollout/t0.1.3/attempt/1/mode/train\n"
        "2026-11-30 14:09:26,446 INFO httpx: POST /proxy/rollout/t0.1.30/attempt/1/mode/train\n"
        "2026-11-30 14:09:27,000 ERROR worker: rollout t0.1.3 attempt 2: harness raised\n"
        "Traceback (most recent call last):\n"
        '  File "harness.py", line 3, in run\n'
        "ValueError: boom\n"
        "2026-11-30 14:09:28,000 INFO worker: rollout t0.1.31 done\n"
        "2026-11-30 14:09:29,000 INFO worker: finished t0.1.3.\n"
    )
    parts = agent_log(tmp_path, "t0.1.3", attempts=2)
    assert [p.source for p in parts] == ["attempts/t0.1.3.2.err", "workers/worker-0.log"]
    assert parts[0].lines == ["second attempt's stderr"]
    lines = parts[1].lines
    assert len(lines) == 6 and "ValueError: boom" in lines
    assert not any("t0.1.30" in line or "t0.1.31" in line for line in lines)
    assert agent_log(tmp_path, "t0.1", attempts=1) == []


BIG_LOG = 65 * 2**20  # past the 64 MiB the viewer once read whole


def write_repeated(path: Path, line: bytes, size: int, last: bytes) -> None:
    """``line`` over and over to ``size`` bytes, then ``last``: written a MiB at a time,
    so that the test holds nothing of the file's size."""
    block = line * (2**20 // len(line) + 1)
    with path.open("wb") as f:
        for _ in range(size // len(block) + 1):
            f.write(block)
        f.write(last)


def big_logs(run: Path, rollout_id: str) -> None:
    """An attempt's 65 MiB output, and two 65 MiB worker logs naming the rollout: one in
    records of 16 KiB, one a single line with no end."""
    (run / "attempts").mkdir()
    (run / "workers").mkdir()
    write_repeated(
        run / "attempts" / f"{rollout_id}.1.out", b"o" * 999 + b"\n", BIG_LOG, b"the last line\n"
    )
    record = f"2026-11-30 14:09:26,445 INFO worker: rollout {rollout_id} says ".encode()
    write_repeated(
        run / "workers" / "worker-0.log",
        record + b"w" * 16 * 2**10 + b"\n",
        BIG_LOG,
        record + b"the last record\n",
    )
    write_repeated(run / "workers" / "worker-1.log", record + b"z" * 4096, BIG_LOG, b"")


def test_a_huge_agent_log_is_read_in_bounded_pieces(tmp_path: Path) -> None:
    """L1 of issue 43: the viewer read up to 64 MiB of a log whole (1.6 GB a page). The
    memory reading the logs takes does not grow with them, and the page still shows
    their last lines, and says what it left out."""
    import tracemalloc

    from agl.ui.agentlog import KEPT_BYTES, MAX_LINES, agent_log

    big_logs(tmp_path, "t0.1.3")
    tracemalloc.start()
    try:
        parts = agent_log(tmp_path, "t0.1.3", attempts=1)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * KEPT_BYTES < BIG_LOG / 4, peak
    out, worker, endless = parts
    assert out.source == "attempts/t0.1.3.1.out" and out.truncated
    assert len(out.lines) == MAX_LINES and out.lines[-1] == "the last line"
    assert worker.truncated and "searched" in worker.note
    assert worker.lines[-1].endswith("rollout t0.1.3 says the last record")
    assert sum(map(len, worker.lines)) <= KEPT_BYTES
    assert endless.lines and sum(map(len, endless.lines)) <= KEPT_BYTES


def test_the_viewer_serves_a_huge_agent_log_cut(tmp_path: Path) -> None:
    """The same logs through a real gateway's viewer: the rollout page answers, with the
    last lines and notes saying the log was cut and how far it was searched."""
    from agl.ui.agentlog import KEPT_BYTES

    run = tmp_path / "run"
    run.mkdir()
    big_logs(run, "big")
    with gateway_process(tmp_path / "gateway", token=TOKEN, ui_run=run) as gw:
        with GatewayClient(gw.url, gw.token) as admin:
            admin.create_rollouts([{"rollout_id": "big", "group_id": "g"}])
        with ui_client(gw) as client:
            page = client.get("/ui/rollouts/big")
    assert page.status_code == 200, page.text[:2000]
    text = html.unescape(page.text)
    for shown in (
        "attempts/big.1.out",
        "the last line</pre>",
        "workers/worker-0.log",
        "rollout big says the last record",
        "only the last 64 MiB of the file were searched",
        "Cut: the last lines are kept.",
    ):
        assert shown in text, shown
    assert len(page.content) < 4 * 3 * KEPT_BYTES, len(page.content)  # three parts shown
