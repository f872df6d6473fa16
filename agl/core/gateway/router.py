"""Which endpoint serves a rollout's calls: the least loaded at its first call, then the
same one for every later call (the endpoint's prefix cache holds the conversation so far).

Load is the number of rollouts placed on an endpoint, not the calls in flight: an agentic
rollout spends much of its life between calls (a tool, a test run) and comes back with a
longer prompt, so the rollouts an endpoint holds are the work it is committed to. A
rollout leaves its endpoint when the gateway sees it stop running (``forget``: a status
patch out of ``running``, a timeout), when its endpoint is no longer registered, or when
more than ``capacity`` rollouts are placed and it is the one least recently called (a
bound on memory for ends the gateway never saw; a rollout still running then costs its
prefix cache once, at its next call). A call admitted after its rollout ended (it waited
at the paused admission gate while the rollout timed out) places the rollout again, and
it stays counted until that bound drops it.

Ties between equally loaded endpoints go to the one a rendezvous hash (blake2b over the
rollout id and the endpoint's URL) ranks highest for the rollout: a spread that does not
depend on the ids' shape (the trainer's ``t<batch>.<group>.<k>`` differ in a few
characters, which a CRC ranks in lockstep) nor on the registration order.

Invariants, for each model name: a placed rollout gets its endpoint until it leaves (a
new registration of the same URL, with a new ``policy_version``, keeps it there); a new
placement goes to an endpoint with the fewest rollouts placed; removing an endpoint moves
only its own rollouts. The router lives in one gateway process, on its event loop, and
nothing here awaits: a placement and its load change together. State is not persisted: a
restarted gateway places running rollouts again at their next call.
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict

from agl.core.contracts.records import ModelEndpoint
from agl.core.http_errors import ApiError

# Far above the rollouts running at once (a few thousand at the largest batch sizes).
DEFAULT_CAPACITY = 1 << 16


class Router:
    """Chooses the endpoint of a call: least loaded at a rollout's first call, then sticky
    (see the module)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, not {capacity}")
        self.capacity = capacity
        self._by_model: dict[str, dict[str, ModelEndpoint]] = {}  # model -> URL -> endpoint
        # rollout -> model -> URL, least recently called first; every URL is registered
        # for its model.
        self._placed: OrderedDict[str, dict[str, str]] = OrderedDict()
        self._load: Counter[str] = Counter()  # URL -> placements on it, never zero

    def load(self, models: list[ModelEndpoint]) -> None:
        """Serve ``models`` from now on: rollouts stay on the URLs still registered for
        their model; those whose endpoint is gone are placed again at their next call."""
        by_model: dict[str, dict[str, ModelEndpoint]] = {}
        for m in models:
            by_model.setdefault(m.model, {})[m.endpoint] = m
        self._by_model = by_model
        for rollout_id, placed in list(self._placed.items()):
            gone = {m: u for m, u in placed.items() if u not in by_model.get(m, {})}
            self._release(gone)
            for model in gone:
                del placed[model]
            if not placed:
                del self._placed[rollout_id]

    def pick(self, model: object, rollout_id: str) -> ModelEndpoint:
        """The endpoint of ``rollout_id``'s call to ``model`` (any name, when one model is
        registered); a 404 ``ApiError`` when no registered model answers to it."""
        name, endpoints = self._resolve(model)
        placed = self._placed.get(rollout_id)
        if placed is None:
            placed = self._placed[rollout_id] = {}
            self._evict()
        else:
            self._placed.move_to_end(rollout_id)
            if name in placed:
                return endpoints[placed[name]]
        url = min(endpoints, key=lambda u: (self._load[u], -_rank(rollout_id, u)))
        placed[name] = url
        self._load[url] += 1
        return endpoints[url]

    def forget(self, rollout_id: str) -> None:
        """``rollout_id`` stopped running: its endpoints carry it no more."""
        self._release(self._placed.pop(rollout_id, {}))

    def loads(self) -> dict[str, int]:
        """Rollouts placed per endpoint URL (those with none left out)."""
        return dict(self._load)

    def _resolve(self, model: object) -> tuple[str, dict[str, ModelEndpoint]]:
        if isinstance(model, str) and model in self._by_model:
            return model, self._by_model[model]
        # Harnesses often hard-code a model name; with one model served, any name is it.
        if len(self._by_model) != 1:
            names = ", ".join(sorted(self._by_model)) or "none"
            raise ApiError(404, f"model {model!r} is not registered (registered: {names})")
        ((name, endpoints),) = self._by_model.items()
        return name, endpoints

    def _release(self, placed: dict[str, str]) -> None:
        """Take ``placed`` (model -> URL) off its endpoints' loads."""
        for url in placed.values():
            self._load[url] -= 1
            if not self._load[url]:
                del self._load[url]

    def _evict(self) -> None:
        while len(self._placed) > self.capacity:
            self._release(self._placed.popitem(last=False)[1])


def _rank(rollout_id: str, url: str) -> int:
    """The rendezvous weight of ``url`` for ``rollout_id``: uniform and independent per
    pair, whatever the ids look like."""
    digest = hashlib.blake2b(f"{rollout_id}|{url}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")
