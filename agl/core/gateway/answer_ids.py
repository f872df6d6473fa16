"""An endpoint's answer read without turning its prompt's token ids into Python objects.

vLLM repeats every prompt id in each answer (``prompt_token_ids``: at the top of a chat
answer and of a chat stream's first chunk, on each choice of a text completion): tens of
thousands of ids for a coding agent's prompt, most of them the previous call's. Parsing
them costs more than everything else the gateway does for a call, so
:func:`parse_answer` cuts each such list out of the answer's bytes, parses the rest
(small) as :func:`~agl.core.contracts.records.parse_storable` does, and puts a
:class:`RawIds` (the list's bytes) where the list was. The proxy then compares those bytes
with an earlier call's (:mod:`agl.core.gateway.prompt_chain`) and parses only the ids
after them.

Invariants:
- ``parse_answer(payload)`` equals ``parse_storable(payload)`` (or raises as it does)
  once every ``RawIds`` in it is replaced by ``parse_storable(b"[" + raw.content + b"]")``;
- a list is cut only where nothing can be misread: its key is not preceded by a
  backslash (so it is a key, not text inside a string), it opens with ``[`` right after
  the colon, and its bytes up to the first ``]`` hold no string and no nested list (no
  ``"``, no ``[``), so that ``]`` closes it. Anything else goes through the full parse,
  so the fast path is only ever an optimisation;
- a ``RawIds``' content is not checked here: its user parses what it does not already
  know (a tail after a checked base, or all of it).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from agl.core.contracts.records import parse_storable

PROMPT_IDS = "prompt_token_ids"
_KEY = b'"' + PROMPT_IDS.encode() + b'":['
# The placeholder a cut list leaves: a string no endpoint sends (a NUL, then a random
# token of this process), numbered by the list's place in the answer.
_MARK = "\x00agl-ids-" + secrets.token_hex(8) + "-"
_PLACEHOLDER = b'"\\u0000' + _MARK[1:].encode()  # then its number and the closing quote


@dataclass(frozen=True)
class RawIds:
    """A token id list as the endpoint sent it: the bytes between its brackets, unchecked
    (whitespace included: the same endpoint writes the same ids alike)."""

    content: bytes

    def __bool__(self) -> bool:
        """Whether the list has items (``ids or other`` need not count them)."""
        return bool(self.content)

    def __len__(self) -> int:
        """How many items the list has (its commas, counted at C speed)."""
        return self.content.count(b",") + 1 if self.content else 0

    def parse(self) -> Any:
        """The list, as ``parse_storable`` reads it (ValueError as it raises)."""
        return parse_storable(b"[" + self.content + b"]")


def parse_answer(payload: bytes) -> Any:
    """``payload`` parsed as ``parse_storable`` does, each prompt id list a :class:`RawIds`
    (see the module); ValueError as ``parse_storable`` raises it."""
    cut = _cut(payload)
    if cut is not None:
        rest, raws = cut
        try:
            answer = parse_storable(rest)
        except ValueError:
            answer = None  # the full parse below says why, in its own words
        if answer is not None and _put_back(answer, raws):
            return answer
    return parse_storable(payload)


def _cut(payload: bytes) -> tuple[bytes, list[RawIds]] | None:
    """``payload`` with each safely cut prompt id list replaced by a numbered placeholder
    string, and the lists; None where there is nothing to cut or one cut is unsafe."""
    pieces: list[bytes] = []
    raws: list[RawIds] = []
    done = 0
    while (key := payload.find(_KEY, done)) != -1:
        if key and payload[key - 1] == 0x5C:  # a backslash: maybe inside a string
            return None
        start = key + len(_KEY)
        end = payload.find(b"]", start)
        if end == -1:
            return None
        content = payload[start:end]
        if b'"' in content or b"[" in content:  # memchr: C speed
            return None
        pieces += (payload[done : start - 1], _PLACEHOLDER, b'%d"' % len(raws))
        raws.append(RawIds(content))
        done = end + 1
    if not raws:
        return None
    pieces.append(payload[done:])
    return b"".join(pieces), raws


def _put_back(answer: Any, raws: list[RawIds]) -> bool:
    """Put each of ``raws`` where its placeholder is: the answer's top or a choice, the
    only places an endpoint puts prompt ids. False where a placeholder is elsewhere (or
    missing): the caller parses the whole answer instead."""
    if not isinstance(answer, dict):
        return False
    holders = [answer]
    choices = answer.get("choices")
    if isinstance(choices, list):
        holders += [c for c in choices if isinstance(c, dict)]
    found = 0
    for holder in holders:
        value = holder.get(PROMPT_IDS)
        if isinstance(value, str) and value.startswith(_MARK):
            index = value[len(_MARK) :]
            if index != str(found):
                return False
            holder[PROMPT_IDS] = raws[found]
            found += 1
    return found == len(raws)
