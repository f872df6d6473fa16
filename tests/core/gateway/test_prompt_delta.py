"""Prompts stored by what they add (agl.core.gateway.store.prompt_delta), without a
store: every call of any history reads back exactly as sent, as JSON, from its stored
form and its base, page by page."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from agl.core.gateway.store.prompt_delta import (
    PromptBase,
    StoredCall,
    common_prefix,
    decode,
    encode,
    resolve,
)
from tests.helpers.call_histories import Batch, Step, histories, reference_base


def _table(steps: list[Step]) -> tuple[dict[int, StoredCall], dict[int, Any]]:
    """The rows a store would hold for ``steps`` under the reference rule (sequences
    from 1, retries appending nothing), and each row's data as sent."""
    rows: dict[int, StoredCall] = {}
    sent: dict[int, Any] = {}
    calls: dict[int, list[tuple[int, dict[str, Any]]]] = {}
    for step in steps:
        if not isinstance(step, Batch):
            continue
        earlier = list(calls.setdefault(step.attempt, []))  # a call's choices: not each other's
        for event in step.events:
            sequence = len(rows) + 1
            encoded = None
            if event.type == "model_request":
                encoded = reference_base(event.data, earlier)
                calls[step.attempt].append((sequence, event.data))
            stored, base = encoded if encoded else (event.data, None)
            rows[sequence] = StoredCall(sequence, stored, base)
            sent[sequence] = event.data
    return rows, sent


def _exactly(a: Any, b: Any) -> bool:
    return bool(a == b) and orjson.dumps(a) == orjson.dumps(b)


@given(histories())
def test_every_call_reads_back_exactly_from_any_earlier_call(steps: list[Step]) -> None:
    calls = [e.data for s in steps if isinstance(s, Batch) for e in s.events]
    calls = [c for c in calls if "prompt_ids" in c]
    for i, data in enumerate(calls):
        for base_data in calls[:i]:
            encoded = encode(data, base_data, 7)
            if encoded is None:
                continue
            stored, base = encoded
            assert base.sequence == 7
            assert _exactly(decode(stored, base, base_data), data)
            # The base's tokens and input items are not stored again.
            kept = len(base_data["prompt_ids"]) + len(base_data["response_ids"])
            assert base.keep_ids == kept
            assert len(stored["prompt_ids"]) == len(data["prompt_ids"]) - kept


@given(
    base_ids=st.lists(st.integers(0, 9), max_size=5),
    answer=st.lists(st.integers(0, 9), max_size=5),
    added=st.lists(st.integers(0, 9), max_size=5),
    kind=st.sampled_from(("messages", "prompt")),
)
def test_an_extension_stores_only_what_it_adds(
    base_ids: list[int], answer: list[int], added: list[int], kind: str
) -> None:
    given_input: Any = [{"role": "user", "content": "q"}] if kind == "messages" else "q"
    more: Any = [{"role": "tool", "content": "r"}] if kind == "messages" else "r"
    base_data = {"prompt_ids": base_ids, "response_ids": answer, kind: given_input}
    data = {"prompt_ids": base_ids + answer + added, "response_ids": [1], kind: given_input + more}
    encoded = encode(data, base_data, 3)
    assert encoded is not None
    stored, base = encoded
    assert base == PromptBase(3, len(base_ids) + len(answer), 1)
    assert stored == {"prompt_ids": added, "response_ids": [1], kind: more}


@pytest.mark.parametrize(
    ("base_ids", "ids"),
    [
        ([1, 2], [1]),  # shorter than the base's prompt and answer
        ([1, 2], [1, 3, 4]),  # another token inside
        ([1, 2], [1.0, 2, 4]),  # equal in Python, written apart as JSON
        ([1, 2], [True, 2, 4]),
    ],
)
def test_a_prompt_that_does_not_extend_is_stored_whole(base_ids: list[Any], ids: list[Any]) -> None:
    base_data = {"prompt_ids": base_ids[:1], "response_ids": base_ids[1:]}
    assert encode({"prompt_ids": ids, "response_ids": []}, base_data, 1) is None
    assert encode({"prompt_ids": None}, base_data, 1) is None
    assert encode({"prompt_ids": base_ids}, {"prompt_ids": base_ids}, 1) is None  # no answer


@pytest.mark.parametrize(
    ("a", "b", "shared"),
    [
        ("abcd", "abxy", 2),
        ([1, 2, 3], [1, 2], 2),
        ([1, 2, 3], [1, 2.0, 3], 1),
        ([0.0, 1], [-0.0, 1], 0),
        ([1, 1], [1, True], 1),
        ([{"a": 1, "b": 2}, 3], [{"b": 2, "a": 1}, 3], 0),  # the same keys in another order
        ([{"a": [1, {"b": 1}]}], [{"a": [1, {"b": 1.0}]}], 0),
        ([], [1], 0),
    ],
)
def test_the_shared_input_is_what_json_writes_alike(
    a: list[Any] | str, b: list[Any] | str, shared: int
) -> None:
    assert common_prefix(a, b) == shared == common_prefix(b, a)


@given(histories(), st.data())
def test_resolve_reads_any_page_whole(steps: list[Step], data: st.DataObject) -> None:
    rows, sent = _table(steps)
    if not rows:
        return
    first = data.draw(st.integers(1, len(rows)), label="first")
    last = data.draw(st.integers(first, len(rows)), label="last")
    generous = data.draw(st.booleans(), label="fetch answers every earlier row")
    fetched: list[set[int]] = []

    async def fetch(missing: set[int]) -> Iterable[StoredCall]:
        fetched.append(missing)
        if generous:
            return [rows[s] for s in range(1, max(missing) + 1)]
        return [rows[s] for s in missing]

    page = [rows[s] for s in range(first, last + 1)]
    decoded = asyncio.run(resolve(page, fetch))
    assert list(decoded) == list(range(first, last + 1))
    for sequence, value in decoded.items():
        assert _exactly(value, sent[sequence])
    assert all(s < first for missing in fetched for s in missing)


def test_a_base_the_store_lacks_is_an_error() -> None:
    async def nothing(missing: set[int]) -> Iterable[StoredCall]:
        return []

    row = StoredCall(5, {"prompt_ids": [], "response_ids": []}, PromptBase(2, 0, 0))
    with pytest.raises(LookupError, match=r"\[2\]"):
        asyncio.run(resolve([row], nothing))


@pytest.mark.parametrize(
    ("stored", "base", "error"),
    [
        ({"prompt_ids": []}, PromptBase(1, 3, 0), "fewer tokens"),
        ({"prompt_ids": [], "prompt": "x"}, PromptBase(1, 2, 3), "less input"),
        ({"prompt_ids": [], "messages": []}, PromptBase(1, 2, 1), "less input"),  # a string
    ],
)
def test_a_base_with_less_than_kept_is_an_error(
    stored: dict[str, Any], base: PromptBase, error: str
) -> None:
    base_data = {"prompt_ids": [1], "response_ids": [2], "prompt": "ab"}
    with pytest.raises(ValueError, match=error):
        decode(stored, base, base_data)
