"""Prompts stored by what they add: a coding agent's calls each extend the last, so a
call stored whole repeats its whole context, and a rollout's store grows with the square
of its length. A ``model_request`` whose prompt extends an earlier call of its attempt
is stored with a :class:`PromptBase` instead: its ``prompt_ids`` hold only the tokens
after the base call's prompt and response, and its input (``messages``, or a text
completion's ``prompt``) only what follows the base's. Reading puts the whole back, so
the API and the trainer see every call exactly as it was sent.

Invariants (each store checks them where it writes; ``tests/core/gateway/
test_prompt_delta.py`` holds the round trip):
- a base is an earlier ``model_request`` of the same rollout and attempt (a smaller
  sequence), so decoding in sequence order always finds the base decoded already;
- ``keep_ids`` <= the length of the base's ``prompt_ids + response_ids``, and
  ``keep_input`` <= the length of the base's input (items of a list, characters of a
  string);
- ``decode(encode(data, base_data), ...) == data`` for every call, extending or not:
  ``encode`` answers None (store it whole) where nothing is shared.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

# Where a recorded call keeps what the model was given: a chat's messages, or a text
# completion's prompt (a string or a list of token ids).
INPUT_KEYS = ("messages", "prompt")


@dataclass(frozen=True)
class PromptBase:
    """A stored call's reference to an earlier call of its attempt (see the module)."""

    sequence: int  # the base event's sequence
    keep_ids: int  # leading tokens of the base's prompt_ids + response_ids
    keep_input: int  # leading messages (or prompt items or characters) of the base's input


def input_key(data: Mapping[str, Any]) -> str | None:
    """The key of ``data``'s input, if it has one that can be stored by what it adds."""
    for key in INPUT_KEYS:
        if isinstance(data.get(key), list | str):
            return key
    return None


def extended_ids(base_data: Mapping[str, Any]) -> list[int] | None:
    """The tokens a call that extends ``base_data`` starts with: its prompt and response."""
    prompt, response = base_data.get("prompt_ids"), base_data.get("response_ids")
    if not isinstance(prompt, list) or not isinstance(response, list):
        return None
    return prompt + response


def encode(
    data: Mapping[str, Any], base_data: Mapping[str, Any], sequence: int
) -> tuple[dict[str, Any], PromptBase] | None:
    """``data`` stored by what it adds to ``base_data`` (the decoded base at
    ``sequence``), or None when it does not extend the base's prompt and response. The
    reference rule, on lists; the proxy finds the same base from the answer's bytes."""
    prompt, full = data.get("prompt_ids"), extended_ids(base_data)
    if not isinstance(prompt, list) or full is None or not _same(prompt[: len(full)], full):
        return None
    stored = dict(data)
    stored["prompt_ids"] = prompt[len(full) :]
    keep_input = 0
    key = input_key(data)
    if key is not None and type(base_data.get(key)) is type(data[key]):
        mine, theirs = data[key], base_data[key]
        keep_input = common_prefix(mine, theirs)
        stored[key] = mine[keep_input:]
    return stored, PromptBase(sequence, len(full), keep_input)


def check_tails(type_: str, data: Any, base: PromptBase) -> None:
    """Raise ValueError unless an event of ``type_`` whose ``data`` holds tails can be
    stored on ``base``: a model_request with its prompt_ids, keeping no negative count,
    with an input where some of the base's is kept. That the base is an earlier
    model_request of the same rollout and attempt is the store's to check (a lookup);
    that ``keep_ids`` is within the base's tokens is checked where it is decoded."""
    if (
        type_ != "model_request"
        or not isinstance(data, dict)
        or not isinstance(data.get("prompt_ids"), list)
        or base.keep_ids < 0
        or base.keep_input < 0
        or (base.keep_input and input_key(data) is None)
    ):
        raise ValueError(f"a {type_} event with this data cannot be stored on {base}")


def common_prefix(a: list[Any] | str, b: list[Any] | str) -> int:
    """How many leading items (or characters) ``a`` and ``b`` share, as JSON: items
    Python finds equal but JSON writes apart (1 and 1.0 or true, 0.0 and -0.0, an
    object's keys in another order) end it, so the base's items read back as sent."""
    n = min(len(a), len(b))
    if a[:n] != b[:n]:
        lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if a[:mid] == b[:mid]:
                lo = mid
            else:
                hi = mid
        n = lo
    if isinstance(a, str) or _same(a[:n], b[:n]):
        return n
    return next(i for i in range(n) if not _same(a[i], b[i]))


def _same(a: Any, b: Any) -> bool:
    """``a`` and ``b`` are the same JSON: equal, and written alike (see common_prefix).
    Both compares run in C; the second only where the first holds."""
    return bool(a == b) and orjson.dumps(a) == orjson.dumps(b)


def decode(
    stored: Mapping[str, Any], base: PromptBase, base_data: Mapping[str, Any]
) -> dict[str, Any]:
    """The call as it was sent, from its stored form and its decoded base. The kept
    part of the input shares its items (a message's dict) with the base's: read them,
    do not change them."""
    prompt, response = base_data.get("prompt_ids"), base_data.get("response_ids")
    if not isinstance(prompt, list) or not isinstance(response, list):
        raise ValueError(f"the base at sequence {base.sequence} has no prompt and response ids")
    keep = base.keep_ids
    if keep > len(prompt) + len(response):
        raise ValueError(f"the base at sequence {base.sequence} has fewer tokens than kept")
    data = dict(stored)
    # Whole lists joined in C: no copy of the base's tokens beyond the one kept.
    if keep <= len(prompt):
        data["prompt_ids"] = prompt[:keep] + stored["prompt_ids"]
    else:
        data["prompt_ids"] = prompt + response[: keep - len(prompt)] + stored["prompt_ids"]
    key = input_key(stored)
    if key is not None and base.keep_input:
        kept: Any = base_data.get(key)
        if type(kept) is not type(stored[key]) or len(kept) < base.keep_input:
            raise ValueError(f"the base at sequence {base.sequence} has less input than kept")
        data[key] = kept[: base.keep_input] + stored[key]
    return data


@dataclass
class StoredCall:
    """One stored event's data as read, with its base (None: stored whole)."""

    sequence: int
    data: Any
    base: PromptBase | None


async def resolve(
    rows: Iterable[StoredCall],
    fetch: Callable[[set[int]], Awaitable[Iterable[StoredCall]]],
) -> dict[int, Any]:
    """Every row's decoded data, by sequence. ``fetch`` reads rows the page lacks: it is
    given the sequences of bases not yet read and may answer more rows than those (a
    store reads the attempt's earlier calls in one query); it is called until every
    base is known, and a base it cannot find is an error (the store is damaged)."""
    wanted = list(rows)
    known = {row.sequence: row for row in wanted}
    while True:
        needed, missing = _chains(wanted, known)
        if not missing:
            break
        found = list(await fetch(missing))
        if not any(r.sequence in missing for r in found):
            raise LookupError(f"the store lacks the base events at sequences {sorted(missing)}")
        for row in found:
            known.setdefault(row.sequence, row)
    decoded: dict[int, Any] = {}
    for sequence in sorted(needed):  # a base before every call stored on it
        row = known[sequence]
        if row.base is None:
            decoded[sequence] = row.data
        else:
            decoded[sequence] = decode(row.data, row.base, decoded[row.base.sequence])
    return {row.sequence: decoded[row.sequence] for row in wanted}


def _chains(wanted: list[StoredCall], known: dict[int, StoredCall]) -> tuple[set[int], set[int]]:
    """The sequences the wanted rows' chains of bases pass through, and those of bases
    not read yet. Only these are decoded: ``fetch`` may answer more."""
    needed: set[int] = set()
    missing: set[int] = set()
    for row in wanted:
        at = row
        while at.sequence not in needed:
            needed.add(at.sequence)
            if at.base is None:
                break
            if at.base.sequence not in known:
                missing.add(at.base.sequence)
                break
            at = known[at.base.sequence]
    return needed, missing
