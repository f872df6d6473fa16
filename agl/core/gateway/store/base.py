"""The gateway's storage interface.

The gateway talks to storage only through :class:`Store`, so another database (a
PostgreSQL URL) can replace the embedded SQLite file. Contract for every implementation:

- a coroutine that returns has made its writes durable: the gateway acknowledges a
  request only after the store call returned;
- creating rollouts and appending events are idempotent by their caller-chosen ids;
- status changes go through :func:`agl.core.gateway.store.lifecycle.apply_patch` atomically with the
  read of the current state;
- each appended event updates its attempt's :class:`Summary`, and each status change
  appends a :class:`Transition`, in the same transaction, so the viewer reads both
  without parsing events;
- a ``model_request`` appended with a :class:`PromptBase` is stored by what it adds to
  its base (:mod:`agl.core.gateway.store.prompt_delta`), and every read gives it back
  whole; its summary counts its whole prompt;
- a :class:`PendingAnswer` is stored atomically with its call's events and kept until the
  proxy says it was delivered, another gateway process claims it, or its rollout stops
  running.

A :class:`SharedStore` (PostgreSQL) is shared by several gateway processes (replicas):
it also keeps who they are (a registry with heartbeats), the admission state every
replica follows, and the per-attempt rate-limit buckets, and its ``claim_answer`` takes
only a dead process's answers (see there).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from agl.core.contracts.queries import (
    EventQuery,
    RolloutQuery,
    RolloutRow,
    Summary,
    SummaryQuery,
    Transition,
)
from agl.core.contracts.records import (
    Event,
    EventIn,
    ModelEndpoint,
    Rollout,
    RolloutSpec,
    StatusPatch,
)
from agl.core.gateway.store.prompt_delta import PromptBase


class NotFound(Exception):
    """An unknown rollout or attempt."""


@dataclass(frozen=True)
class PendingAnswer:
    """A proxied call's answer, kept from the moment its call is recorded until it is
    known to have been sent. A gateway killed in between leaves it behind; the harness's
    retry of the same request then gets these bytes, and the call is recorded once.

    ``answer_id`` is the first ``model_request`` event's id; ``boot`` names the gateway
    process that holds the answer (see :meth:`Store.claim_answer`)."""

    answer_id: str
    request_hash: bytes
    boot: str
    body: bytes
    stream: bool


class Store(ABC):
    async def connect(self) -> None:  # noqa: B027 (a default: most stores need none)
        """Connect and make the schema, before the first call; the embedded store is
        ready from its constructor."""

    @abstractmethod
    async def create_rollouts(self, specs: Sequence[RolloutSpec], now: float) -> list[Rollout]:
        """Insert the rollouts whose ids are new; answer all of them as stored."""

    @abstractmethod
    async def get_rollout(self, rollout_id: str) -> Rollout | None: ...

    @abstractmethod
    async def list_rollouts(self, query: RolloutQuery) -> tuple[list[Rollout], int | None]:
        """One page in creation order, and the cursor of the next page (None at the end)."""

    @abstractmethod
    async def patch_rollout(self, rollout_id: str, patch: StatusPatch, now: float) -> Rollout:
        """Apply a status change; raises NotFound or IllegalTransition."""

    @abstractmethod
    async def expire_running(self, now: float, error: str) -> list[Rollout]:
        """Fail every running rollout whose ``timeout_s`` has passed; answer them."""

    @abstractmethod
    async def append_events(
        self,
        rollout_id: str,
        attempt: int,
        events: Sequence[EventIn],
        now: float,
        pending: PendingAnswer | None = None,
        bases: Sequence[PromptBase | None] | None = None,
    ) -> list[Event]:
        """Append events with ids assigned where missing; a known id is not appended again.
        ``pending`` is stored in the same transaction. ``bases`` (one per event, from the
        recording proxy) says which events hold only what their prompt and input add to
        an earlier call: their ``data`` holds those tails, and the new events answered
        are as given (the tails), while every later read answers them whole, as does a
        known id given again."""

    @abstractmethod
    async def claim_answer(
        self, rollout_id: str, attempt: int, request_hash: bytes, boot: str
    ) -> PendingAnswer | None:
        """The oldest pending answer to this request held by a process other than
        ``boot`` (one that died before sending it), now held by ``boot``; None if none."""

    @abstractmethod
    async def answer_delivered(self, rollout_id: str, attempt: int, answer_id: str) -> None:
        """Forget a pending answer: it was sent."""

    @abstractmethod
    async def list_events(self, rollout_id: str, query: EventQuery) -> list[Event]: ...

    @abstractmethod
    async def query_rollouts(self, query: SummaryQuery) -> tuple[list[RolloutRow], int]:
        """One page of rollouts with their summaries, and how many match in all."""

    @abstractmethod
    async def summaries(self, rollout_id: str) -> list[Summary]:
        """The summary of each attempt that has events, by attempt."""

    @abstractmethod
    async def transitions(self, rollout_id: str) -> list[Transition]:
        """The rollout's status changes in order (creation, as ``queuing``, is not one)."""

    @abstractmethod
    async def put_models(self, models: Sequence[ModelEndpoint]) -> None:
        """Register endpoints; registering one again updates its policy_version."""

    @abstractmethod
    async def delete_models(self, model: str | None) -> int:
        """Remove the endpoints of ``model`` (all when None); answer how many went."""

    @abstractmethod
    async def list_models(self) -> list[ModelEndpoint]: ...

    @abstractmethod
    async def get_meta(self, key: str) -> str | None: ...

    @abstractmethod
    async def set_meta(self, key: str, value: str) -> None: ...

    @abstractmethod
    async def set_meta_once(self, key: str, value: str) -> str:
        """Store ``value`` unless the key has one already; answer the stored value."""

    @abstractmethod
    async def close(self) -> None: ...


# Meta keys: the admission gate's last requested state, restored at start (every store);
# its generation and the models registry's, which a shared store's replicas follow.
ADMISSION_META = "admission"
ADMISSION_GENERATION = "admission_generation"
MODELS_GENERATION = "models_generation"


@dataclass(frozen=True)
class Replica:
    """One gateway process as it reports itself to a shared store."""

    boot: str
    in_flight: int  # calls admitted and not finished
    waiting: int  # calls held at its closed admission gate
    applied: int  # the admission generation it has applied


@dataclass(frozen=True)
class SharedState:
    """What every replica of a shared store follows: the admission state with its
    generation (one more at every change), and the models registry's generation."""

    admission: str  # "paused" or "running"
    generation: int
    models: int


class SharedStore(Store):
    """A store several gateway processes share. Liveness is the database's clock: a
    replica not heard from in ``lease_s`` seconds is dead, whatever its own clock says.

    ``claim_answer`` takes a pending answer only from a process that is dead (absent from
    the registry, or silent past the lease). While a live process holds one for the same
    request (it may still be sending it), it waits, polling, until that answer is
    delivered (then None: the request is a new call) or its holder dies (then it is
    claimed), for at most the lease."""

    lease_s: float

    @abstractmethod
    async def heartbeat(self, replica: Replica) -> SharedState:
        """Record that ``replica`` is alive, as it says; answer the shared state."""

    @abstractmethod
    async def leave(self, boot: str) -> None:
        """Take a replica out of the registry (it stops: it holds nothing any more)."""

    @abstractmethod
    async def live_replicas(self) -> list[Replica]:
        """The replicas heard from within the lease."""

    @abstractmethod
    async def shared_state(self) -> SharedState: ...

    @abstractmethod
    async def set_admission(self, state: str) -> SharedState:
        """Store the admission state with the next generation and tell every replica."""

    @abstractmethod
    async def watch(self, wake: Callable[[], None]) -> None:
        """Call ``wake`` (on the event loop) whenever the shared state changes; each
        call of :meth:`heartbeat` re-arms a watch whose connection was lost."""

    @abstractmethod
    async def take_token(self, key: tuple[str, int], rate: float, burst: float) -> float:
        """Spend a token of ``key``'s bucket in one atomic step: 0.0 if there was one,
        else the seconds until there would be (see ``agl.core.gateway.ratelimit``)."""

    @abstractmethod
    async def charge_tokens(
        self, key: tuple[str, int], rate: float, burst: float, cost: float
    ) -> None:
        """Spend ``cost`` more tokens of ``key``'s bucket, into debt if need be."""
