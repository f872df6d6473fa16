"""The recent calls of each running attempt, kept to find the call a new prompt extends.

A coding agent's next prompt is its last prompt, the model's answer and a tool's output.
The proxy keeps, per attempt, the last few recorded calls (their sequence, the bytes of
their prompt and response ids as the endpoint wrote them, their input), and matches a
new answer's prompt id bytes against them with ``bytes.startswith``: the ids the match
covers were checked when that call was recorded, so only the ids after them are parsed,
checked and stored (:mod:`agl.core.gateway.store.prompt_delta`).

Invariants:
- a link is a valid ``model_request`` (no ``invalid``) that its store acknowledged, of
  the attempt it is kept under; its ``prompt`` and ``response`` bytes are its
  ``prompt_ids`` and ``response_ids`` written as JSON list items (``1,2,3``; the
  response's with a leading comma), its ``tokens`` their number;
- a match covers whole ids: the new prompt's bytes start with the link's prompt and
  response and go on with a ``,`` or end there; the longest such link is the base;
- memory: the links' sizes given to :meth:`add` (their ids and inputs) stay within
  ``max_bytes`` (the least recently used attempts are dropped first, an attempt keeps
  its ``per_attempt`` newest links); a dropped attempt's next call is stored whole.
- nothing here awaits: it lives on the gateway's event loop, one per process.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import orjson

from agl.core.gateway.store.prompt_delta import PromptBase, common_prefix

# The n choices of one call, or two agents of one rollout taking turns, each have a link.
PER_ATTEMPT = 4


@dataclass(frozen=True)
class Link:
    """One recorded call, as a base for the next (see the module)."""

    sequence: int
    # prompt_ids + response_ids as JSON list items, in two pieces: the prompt's are the
    # answer's own bytes (shared, not copied), the response's start with a comma.
    prompt: bytes
    response: bytes
    tokens: int  # how many ids they hold
    # The call's input (messages, or a text completion's prompt) as orjson writes it:
    # a new call's input is compared as bytes too, and this takes less memory than objects.
    input: bytes | None
    input_items: int  # how many items (or characters) that input has
    # Which field that input is (prompt_delta.INPUT_KEYS): a text completion's prompt
    # shares nothing with a chat's messages, whatever their items.
    input_key: str | None

    @property
    def size(self) -> int:
        """Bytes charged to the cache."""
        return len(self.prompt) + len(self.response) + len(self.input or b"")


@dataclass(frozen=True)
class Match:
    base: PromptBase
    covered: int  # bytes of the new prompt's ids the base covers (its ``,`` not included)


@dataclass
class _Attempt:
    attempt: int
    links: deque[Link] = field(default_factory=lambda: deque(maxlen=PER_ATTEMPT))

    @property
    def size(self) -> int:
        return sum(link.size for link in self.links)


class PromptChain:
    """Recent calls per rollout's attempt, least recently used dropped past ``max_bytes``."""

    def __init__(self, max_bytes: int, per_attempt: int = PER_ATTEMPT) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be 0 (off) or more, not {max_bytes}")
        self.max_bytes = max_bytes
        self.per_attempt = per_attempt
        self.bytes = 0
        self._attempts: OrderedDict[str, _Attempt] = OrderedDict()  # by rollout id

    def match(
        self,
        rollout_id: str,
        attempt: int,
        ids: bytes,
        input: list[Any] | str | None,
        input_json: bytes | None,
        input_key: str | None,
    ) -> Match | None:
        """The base of a call of ``attempt`` whose prompt ids are ``ids`` (compact JSON
        items), with its input's shared prefix (none where its ``input_key`` is not the
        base's), or None when it extends no recent call."""
        kept = self._attempts.get(rollout_id)
        if kept is None or kept.attempt != attempt:
            return None
        self._attempts.move_to_end(rollout_id)
        # Longest first, so that one compare (memcmp, C speed) usually finds the base.
        for best in sorted(kept.links, key=lambda link: -link.tokens):
            m = len(best.prompt)
            n = m + len(best.response)
            if (
                ids.startswith(best.prompt)
                and ids.startswith(best.response, m)
                and (len(ids) == n or ids[n] == 0x2C)  # the next id starts after a comma
            ):
                break
        else:
            return None
        keep_input = 0
        if input_key == best.input_key:
            keep_input = shared_input(input, input_json, best.input, best.input_items)
        return Match(PromptBase(best.sequence, best.tokens, keep_input), n)

    def add(self, rollout_id: str, attempt: int, link: Link) -> None:
        """Keep ``link`` (a recorded valid call of ``attempt``); a later attempt of the
        rollout replaces the links of an earlier one."""
        if link.size > self.max_bytes:
            return
        kept = self._attempts.get(rollout_id)
        if kept is None or kept.attempt != attempt:
            if kept is not None:
                self.bytes -= kept.size
            kept = self._attempts[rollout_id] = _Attempt(attempt, deque(maxlen=self.per_attempt))
        self._attempts.move_to_end(rollout_id)
        if len(kept.links) == kept.links.maxlen:
            self.bytes -= kept.links[0].size
        kept.links.append(link)
        self.bytes += link.size
        while self.bytes > self.max_bytes:
            _, dropped = self._attempts.popitem(last=False)
            self.bytes -= dropped.size

    def forget(self, rollout_id: str) -> None:
        """``rollout_id`` stopped running: its calls are bases no more."""
        kept = self._attempts.pop(rollout_id, None)
        if kept is not None:
            self.bytes -= kept.size

    def __len__(self) -> int:
        """Attempts kept."""
        return len(self._attempts)


def shared_input(
    mine: list[Any] | str | None, written: bytes | None, base: bytes | None, items: int
) -> int:
    """``prompt_delta.common_prefix`` of a call's input (``mine``, which orjson writes as
    ``written``) and its base's (``base`` as orjson wrote it, of ``items`` items): the
    leading items written alike. A conversation that goes on from its base's messages
    starts with their JSON less its ``]``, then a ``,`` (or that ``]``): one compare
    (memcmp, C speed) instead of two dumps and a compare of objects. Anything else is
    read back and compared as the rule says."""
    if mine is None or written is None or base is None:
        return 0
    if isinstance(mine, list) and items and base.startswith(b"["):
        end = len(base) - 1  # where the base's ']' is
        if written.startswith(base[:end]) and written[end : end + 1] in (b",", b"]"):
            return items  # the same items, each ending where the base's did
    theirs = orjson.loads(base)
    return common_prefix(mine, theirs) if type(theirs) is type(mine) else 0
