"""Hostile agents for ``python -m bench.soak --hostile``: what issue 18's attacker did, with
only what an agent has (its attempt's *model key*, the ``OPENAI_API_KEY`` a harness hands
to the model's tools, and no report key).

Each attacker loops over ``ATTACKS`` until it is told to stop, every request bounded by a
timeout, and counts each outcome per attack kind: the HTTP status, ``held`` / ``closed``
for a stalled socket (still open after ``hold_s``, or dropped by the gateway), or the
error's name (the gateway is killed -9 mid-run, so some calls meet no gateway).
The attackers run in a process of their own (``AttackProcess``), so that their own CPU
is not spent inside the honest agents' event loop, which would add to the honest latency
that the soak measures.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import multiprocessing
import queue
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson

from agl.core.client import fast_http_client, proxy_base_url
from agl.core.gateway.auth import Keyring

# Attacks that try to set a reward or an attempt's status without the report key: a 2xx
# for any of them is a reward the model's tools could forge.
MUST_REFUSE = frozenset(
    {"reward_model_key", "finish_model_key", "forged_keys", "other_rollouts", "big_event_batch"}
)
BIG_BATCH_EVENTS = 100_000  # issue 18, finding 2: 1.2 MiB that froze the gateway for 5 s
DEEP_LEVELS = 250  # past the 64-level check, inside what orjson parses (finding 3)
OVERSIZED_MIB = 33  # past the gateway's default 32 MiB body limit, streamed
LOGIN_GUESSES = 20  # per round (finding 13)
LOGIN_BIG_MIB = 4  # a login form far past its 8 KiB limit (finding 4)
NO_GATEWAY_PAUSE_S = 0.1
_FORGED_REWARD = {"type": "reward", "data": {"value": 1.0}}


@dataclass(frozen=True)
class Target:
    """One attacker's own attempt (attempt 1, mode train) and its model key."""

    rollout_id: str
    model_key: str


@dataclass(frozen=True)
class Plan:
    """What the attackers get: the gateway, their attempts, the honest rollouts' ids
    (what they would try to reach) and how long a stalled socket is held."""

    url: str
    targets: tuple[Target, ...]
    victims: tuple[str, ...]
    hold_s: float = 5.0
    stalled_sockets: int = 6  # held at once per attacker, spread over the three ways
    timeout_s: float = 30.0  # the most one attack's round (or a stalled socket's connect) takes
    settle_s: float = 60.0  # after stop, the most an attacker waits to be answered once


class Tally:
    """Outcomes per attack kind, and which kinds the gateway has answered at least once
    (a status or a stalled socket's fate, not a connection that met no gateway)."""

    def __init__(self) -> None:
        self.outcomes: collections.Counter[tuple[str, str]] = collections.Counter()
        self.answered: set[str] = set()
        self.cpu_s = 0.0  # the attackers' process's own CPU time

    def add(self, kind: str, outcome: str) -> None:
        self.outcomes[(kind, outcome)] += 1
        if outcome[0].isdigit() or outcome in ("held", "closed"):
            self.answered.add(kind)

    def table(self) -> dict[str, dict[str, int]]:
        table: dict[str, dict[str, int]] = collections.defaultdict(dict)
        for (kind, outcome), n in sorted(self.outcomes.items()):
            table[kind][outcome] = n
        return dict(table)


class Attacker:
    """One hostile agent: its own attempt, its model key, and every attack in turn."""

    def __init__(
        self, plan: Plan, target: Target, victim: str, http: httpx.AsyncClient, tally: Tally
    ) -> None:
        self.plan = plan
        self.target = target
        self.victim = victim
        self.http = http
        self.tally = tally
        self._stalled: set[asyncio.Task[None]] = set()
        self.proxy = proxy_base_url(plan.url, target.rollout_id, 1)

    def auth(self, key: str | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {key or self.target.model_key}"}

    def events(self, rollout_id: str | None = None) -> str:
        return (
            f"{self.plan.url}/api/rollouts/{rollout_id or self.target.rollout_id}/attempt/1/events"
        )

    async def send(self, kind: str, method: str, url: str, **kwargs: Any) -> None:
        """One request of attack ``kind``, its outcome counted."""
        try:
            response = await self.http.request(method, url, **kwargs)
            self.tally.add(kind, str(response.status_code))
        except httpx.TransportError as error:
            # The aiohttp transport maps its errors to a few httpx ones (a refused
            # connection reads ConnectTimeout); its own name says what happened.
            self.tally.add(kind, type(error.__cause__ or error).__name__)
            # No gateway (the kill): spinning on refused connections would only take CPU
            # from the gateway coming back.
            await asyncio.sleep(NO_GATEWAY_PAUSE_S)

    # -- the attacks, one round each ------------------------------------------------

    async def reward_model_key(self) -> None:
        """Finding 1: a tool posts its own reward with ``OPENAI_API_KEY``."""
        await self.send(
            "reward_model_key", "POST", self.events(), json=_FORGED_REWARD, headers=self.auth()
        )

    async def finish_model_key(self) -> None:
        """Finding 1: ... and marks its attempt succeeded."""
        url = f"{self.plan.url}/api/rollouts/{self.target.rollout_id}/attempt/1"
        await self.send(
            "finish_model_key", "PATCH", url, json={"status": "succeeded"}, headers=self.auth()
        )

    async def forged_keys(self) -> None:
        """Keys it could make: its model key as a report key (role swap), report keys
        signed with a guessed secret for itself and for a victim, and its own MAC on the
        victim's scope."""
        guessed = Keyring("", secrets.token_bytes(32))
        own_mac = self.target.model_key.partition(".")[2]
        victim_scope = guessed.report_key(self.victim, 1).partition(".")[0]
        for rollout_id, key in (
            (None, "aglr-" + self.target.model_key.removeprefix("agl-")),
            (None, guessed.report_key(self.target.rollout_id, 1)),
            (self.victim, guessed.report_key(self.victim, 1)),
            (self.victim, f"{victim_scope}.{own_mac}"),
        ):
            await self.send(
                "forged_keys",
                "POST",
                self.events(rollout_id),
                json=_FORGED_REWARD,
                headers=self.auth(key),
            )

    async def other_rollouts(self) -> None:
        """Finding 10: another rollout's reward, status, events, proxy; and one that does
        not exist (whether its answer differs tells which rollouts exist)."""
        victim, url = self.victim, self.plan.url
        for method, where, body in (
            ("POST", self.events(victim), _FORGED_REWARD),
            ("PATCH", f"{url}/api/rollouts/{victim}/attempt/1", {"status": "failed"}),
            ("GET", f"{url}/api/rollouts/{victim}/events", None),
            ("POST", proxy_base_url(url, victim, 1) + "/chat/completions", _chat("steal")),
            ("GET", f"{url}/api/rollouts/no-such-{secrets.token_hex(4)}", None),
        ):
            await self.send("other_rollouts", method, where, json=body, headers=self.auth())

    async def big_event_batch(self) -> None:
        """Finding 2: 100,000 events in one POST."""
        await self.send(
            "big_event_batch", "POST", self.events(), content=_BIG_BATCH, headers=self._json()
        )

    async def deep_json(self) -> None:
        """Finding 3 (the harness's side): a chat body nested 250 levels deep."""
        await self.chat("deep_json", _DEEP)

    async def huge_integer(self) -> None:
        """Finding 7: an integer past 64 bits in a proxied chat body."""
        await self.chat("huge_integer", _HUGE_INT)

    async def oversized_body(self) -> None:
        """A chat body past the body limit, streamed without a length."""
        await self.chat("oversized_body", _chunks(OVERSIZED_MIB))

    async def chat(self, kind: str, body: bytes | AsyncIterator[bytes]) -> None:
        """``body`` to its own attempt's proxy, with its model key."""
        await self.send(
            kind, "POST", self.proxy + "/chat/completions", content=body, headers=self._json()
        )

    async def query_abuse(self) -> None:
        """Finding 6: numeric query values past 64 bits, Unicode digits, negatives."""
        own = f"{self.plan.url}/api/rollouts/{self.target.rollout_id}/events"
        for query in (
            "cursor=18446744073709551616",
            "attempt=9223372036854775808",
            "cursor=%C2%B2",
            "attempt=%E2%91%A0",
            "limit=-1",
        ):
            await self.send("query_abuse", "GET", f"{own}?{query}", headers=self.auth())
        for path in (
            "/api/rollouts?cursor=%C2%B2",
            "/ui?step=9223372036854775808",
            "/ui?page=%E2%91%A0",
        ):
            await self.send("query_abuse", "GET", self.plan.url + path, headers=self.auth())

    async def login_flood(self) -> None:
        """Finding 13: guesses at the admin token as fast as the gateway answers."""
        for _ in range(LOGIN_GUESSES):
            form = {"token": secrets.token_urlsafe(24), "next": "/ui"}
            await self.send("login_flood", "POST", f"{self.plan.url}/ui/login", data=form)

    async def login_big_body(self) -> None:
        """Finding 4: a login form of megabytes, which the handler buffers before its check."""
        await self.send(
            "login_big_body",
            "POST",
            f"{self.plan.url}/ui/login",
            content=_chunks(LOGIN_BIG_MIB),
            headers={"Content-Type": "application/x-www-form-urlencoded"},
        )

    async def stalled_requests(self) -> None:
        """Finding 11: requests that never complete, each held open up to ``hold_s`` in
        the background while the other attacks go on, ``stalled_sockets`` at a time."""
        path = urlsplit(self.proxy).path + "/chat/completions"
        self._stalled = {task for task in self._stalled if not task.done()}
        kinds = itertools.cycle(_stalls(path, self.target.model_key))
        for payload in itertools.islice(kinds, self.plan.stalled_sockets - len(self._stalled)):
            self._stalled.add(asyncio.create_task(self._stall(payload)))

    async def _stall(self, payload: bytes) -> None:
        self.tally.add("stalled_requests", await self._stall_fate(payload))

    async def _stall_fate(self, payload: bytes) -> str:
        """Send the start of a request and wait: ``held`` if the gateway still holds the
        socket after ``hold_s``, ``closed`` if it dropped it, its status if it answered."""
        where = urlsplit(self.plan.url)
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(where.hostname, where.port), self.plan.timeout_s
            )
        except (OSError, TimeoutError) as error:
            return type(error).__name__
        try:
            writer.write(payload)
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(64), self.plan.hold_s)
        except TimeoutError:
            return "held"
        except OSError as error:
            return type(error).__name__
        finally:
            writer.close()
            with contextlib.suppress(OSError, TimeoutError):
                await asyncio.wait_for(writer.wait_closed(), 1.0)
        parts = answer.split(b" ", 2)
        return parts[1].decode() if answer.startswith(b"HTTP/") and len(parts) > 1 else "closed"

    def _json(self) -> dict[str, str]:
        return {**self.auth(), "Content-Type": "application/json"}

    async def run(self, stop: Callable[[], bool]) -> None:
        """Every attack in turn, each bounded, until ``stop()`` and every attack has been
        answered once (``settle_s`` at most after the stop: a gateway that never answers
        one shows in the tally, not as a hung bench)."""
        attacks = [getattr(self, kind) for kind in ATTACKS]
        settle_until: float | None = None
        for attack in itertools.cycle(attacks):
            if stop():
                settle_until = settle_until or time.monotonic() + self.plan.settle_s
                if self.tally.answered >= set(ATTACKS) or time.monotonic() > settle_until:
                    break
            try:
                await asyncio.wait_for(attack(), self.plan.timeout_s)
            except TimeoutError:
                self.tally.add(attack.__name__, "timeout")
            except Exception as error:  # an outcome to count, never the end of the soak
                self.tally.add(attack.__name__, type(error).__name__)
        await asyncio.gather(*self._stalled)  # each bounded by its connect and hold


ATTACKS = (
    "reward_model_key",
    "finish_model_key",
    "forged_keys",
    "other_rollouts",
    "big_event_batch",
    "deep_json",
    "huge_integer",
    "oversized_body",
    "query_abuse",
    "login_flood",
    "login_big_body",
    "stalled_requests",
)


def _chat(content: Any) -> dict[str, Any]:
    return {"model": "policy", "messages": [{"role": "user", "content": content}]}


def _stalls(path: str, key: str) -> list[bytes]:
    """Half a request line; headers without the blank line; half a body (with the key,
    so that the proxy waits for the rest rather than refusing it unread)."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: gateway\r\nAuthorization: Bearer {key}\r\n"
        "Content-Type: application/json\r\n"
    )
    return [
        f"POST {path} HT".encode(),
        head.encode(),
        (head + "Content-Length: 1000\r\n\r\n").encode() + b'{"model": "policy", "mess',
    ]


async def _chunks(mib: int) -> AsyncIterator[bytes]:
    chunk = b"a" * 2**20
    for _ in range(mib):
        yield chunk


# Made once: the attackers' bodies cost the attackers' process no CPU per round.
_BIG_BATCH = orjson.dumps([{"type": "n"}] * BIG_BATCH_EVENTS)
_DEEP = orjson.dumps(_chat("x"))[:-3] + b"[" * DEEP_LEVELS + b"]" * DEEP_LEVELS + b"}]}"
_HUGE_INT = orjson.dumps(_chat("huge"))[:-1] + b', "user_id": 123456789012345678901234567890}'


async def attack(plan: Plan, stop: Callable[[], bool]) -> Tally:
    """Every attacker of ``plan`` at once until ``stop()``; their outcomes."""
    tally = Tally()
    async with fast_http_client(len(plan.targets), timeout_s=plan.timeout_s) as http:
        await asyncio.gather(
            *(
                Attacker(plan, target, plan.victims[i % len(plan.victims)], http, tally).run(stop)
                for i, target in enumerate(plan.targets)
            )
        )
    return tally


def _attack_main(plan: Plan, ready: Any, stop: Any, results: Any) -> None:
    ready.set()
    tally = asyncio.run(attack(plan, stop.is_set))
    results.put((dict(tally.outcomes), sorted(tally.answered), time.process_time()))


class AttackProcess:
    """``attack(plan)`` in a process of its own: ``start()`` returns once it runs,
    ``finish()`` stops it and returns its tally."""

    def __init__(self, plan: Plan) -> None:
        context = multiprocessing.get_context("spawn")
        self._ready, self._stop = context.Event(), context.Event()
        self._results = context.Queue()
        self._process = context.Process(
            target=_attack_main, args=(plan, self._ready, self._stop, self._results), daemon=True
        )
        self._wait_s = plan.settle_s + plan.timeout_s + plan.hold_s + 30

    async def start(self) -> None:
        self._process.start()
        if not await asyncio.to_thread(self._ready.wait, 60):
            raise RuntimeError("the attackers' process did not start within 60 s")

    async def finish(self) -> Tally:
        self._stop.set()
        try:
            outcomes, answered, cpu_s = await asyncio.to_thread(
                self._results.get, True, self._wait_s
            )
        except queue.Empty:
            self._process.kill()
            raise RuntimeError(
                f"the attackers did not stop within {self._wait_s:.0f} s of being told to"
            ) from None
        await asyncio.to_thread(self._process.join, 10)
        tally = Tally()
        tally.outcomes.update(outcomes)
        tally.answered.update(answered)
        tally.cpu_s = cpu_s
        return tally
