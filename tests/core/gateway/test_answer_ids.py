"""An endpoint's answer read with its prompt ids as bytes: the same answer as the full
parse once they are read, whatever the endpoint wrote (agl/core/gateway/answer_ids.py)."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from agl.core.contracts.records import parse_storable
from agl.core.gateway import answer_ids
from agl.core.gateway.answer_ids import RawIds, parse_answer
from agl.core.gateway.proxy import _read_json, _token_ids


def read(value: Any) -> Any:
    """``value`` with every RawIds parsed, as the full parse would have it."""
    if isinstance(value, RawIds):
        return value.parse()
    if isinstance(value, dict):
        return {k: read(v) for k, v in value.items()}
    if isinstance(value, list):
        return [read(v) for v in value]
    return value


def outcome(parse: Any, payload: bytes) -> Any:
    try:
        return ("ok", read(parse(payload)))
    except ValueError:
        return ("error", None)


def chat(prompt: bytes, content: str = "hi") -> bytes:
    choice = orjson.dumps({"index": 0, "message": {"content": content}, "token_ids": [5, 2]})
    return b'{"id":"x","choices":[' + choice + b'],"prompt_token_ids":[' + prompt + b"]}"


def test_a_chats_prompt_ids_come_as_bytes() -> None:
    answer = parse_answer(chat(b"1,2,3"))
    assert answer["prompt_token_ids"] == RawIds(b"1,2,3")
    assert len(answer["prompt_token_ids"]) == 3 and len(RawIds(b"")) == 0
    assert answer["choices"][0]["token_ids"] == [5, 2]  # a choice's own ids are parsed


def test_a_text_completions_prompt_ids_come_as_bytes_on_each_choice() -> None:
    payload = (
        b'{"choices":[{"index":0,"text":"a","prompt_token_ids":[7,8]},'
        b'{"index":1,"text":"b","prompt_token_ids":[7,9]}]}'
    )
    answer = parse_answer(payload)
    assert [c["prompt_token_ids"] for c in answer["choices"]] == [RawIds(b"7,8"), RawIds(b"7,9")]


@pytest.mark.parametrize(
    "payload",
    [
        chat(b"1,[2],3"),  # a nested list: its first ']' is not the list's end
        chat(b'1,"2"'),  # a string
        b'{"message":{"prompt_token_ids":[1,2]},"choices":[]}',  # not where ids go
    ],
)
def test_an_unusual_answer_is_parsed_whole(payload: bytes) -> None:
    answer = parse_answer(payload)
    assert answer == parse_storable(payload)
    assert "RawIds" not in repr(answer)


def test_whitespace_stays_in_the_bytes() -> None:
    answer = parse_answer(chat(b"1, 2\n"))
    assert answer["prompt_token_ids"] == RawIds(b"1, 2\n")
    assert answer["prompt_token_ids"].parse() == [1, 2]


def test_the_key_written_in_a_string_is_text() -> None:
    payload = chat(b"1,2", content='"prompt_token_ids":[1]')  # its quotes come escaped
    answer = parse_answer(payload)
    assert answer["choices"][0]["message"]["content"] == '"prompt_token_ids":[1]'
    assert answer["prompt_token_ids"] == RawIds(b"1,2")


@pytest.mark.parametrize("ids", [b"1,,2", b"01", b"1.5", b"-1", b"99999999999999999999999"])
def test_bad_ids_read_as_the_full_parse_reads_them(ids: bytes) -> None:
    payload = chat(ids)
    assert outcome(parse_answer, payload) == outcome(parse_storable, payload)


def test_a_placeholder_the_endpoint_sent_is_not_mistaken_for_cut_ids() -> None:
    parse_answer(chat(b"1"))  # a cut makes the placeholder; an answer sending it back:
    forged = orjson.dumps(answer_ids._MARK + "0").decode()
    payload = b'{"choices":[{"prompt_token_ids":' + forged.encode() + b'}],"prompt_token_ids":[1]}'
    assert outcome(parse_answer, payload) == outcome(parse_storable, payload)


# Pieces an endpoint's answer might hold around and inside its prompt ids.
_ITEMS = st.one_of(
    st.integers(min_value=-5, max_value=2**31 + 5).map(lambda i: str(i).encode()),
    st.sampled_from([b"", b" ", b"1.0", b"true", b'"7"', b"[1]", b"{}", b"]", b"-0", b"1e3"]),
)
_TEXT = st.sampled_from(["hi", "]", '"prompt_token_ids":[1]', "\\", "[", "\u00e9"])


@settings(max_examples=300, deadline=None)
@given(
    prompt=st.lists(_ITEMS, max_size=12),
    separator=st.sampled_from([b",", b", ", b",\n"]),
    text=_TEXT,
    stream=st.booleans(),
)
def test_the_answer_is_the_full_parses_whatever_the_endpoint_wrote(
    prompt: list[bytes], separator: bytes, text: str, stream: bool
) -> None:
    content = orjson.dumps(text)
    ids = separator.join(prompt)
    if stream:  # a chat stream's first chunk
        head = b'{"choices":[{"index":0,"delta":{"content":' + content + b"}}],"
        payload = head + b'"prompt_token_ids":[' + ids + b"]}"
    else:  # a text completion
        head = b'{"choices":[{"text":' + content + b',"prompt_token_ids":['
        payload = head + ids + b']}],"usage":{}}'
    assert outcome(parse_answer, payload) == outcome(parse_storable, payload)


@pytest.mark.parametrize(
    "body",
    [
        b'{"messages":[{"role":"user","content":"hi"}],"seed":18446744073709551615}',
        b'{"seed":18446744073709551616}',  # orjson would read a float
        b'{"seed":-9223372036854775809}',
        b'{"temperature":1e19,"n":1.0}',
        b'{"a":1e400}',
        b'{"a":NaN}',
        b'{"a":"\\ud800"}',
        b'{"a":1,"a":2}',
        b"[" * 70 + b"]" * 70,
    ],
)
def test_a_request_reads_as_the_full_parse_reads_it(body: bytes) -> None:
    assert outcome(_read_json, body) == outcome(parse_storable, body)


_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)


@settings(max_examples=300, deadline=None)
@given(
    st.recursive(
        _SCALARS,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner),
        max_leaves=40,
    ),
    st.integers(min_value=0, max_value=70),
)
# orjson reads an integer just past 64 bits as the float -2**63: alone and nested
@example(-(2**63) - 1, 0)
@example(-(2**63) - 1, 1)
@example(2**64, 1)
def test_any_request_reads_as_the_full_parse_reads_it(value: Any, nesting: int) -> None:
    # Written as Python's json writes it: integers of any size stay integers.
    body = ("[" * nesting + json.dumps(value) + "]" * nesting).encode()
    assert outcome(_read_json, body) == outcome(parse_storable, body)


@pytest.mark.parametrize(
    ("items", "ids"),
    [
        (b"", []),
        (b"1,2", [1, 2]),
        (b"1, 2", [1, 2]),
        (b"2147483647", [2**31 - 1]),
        (b"2147483648", None),  # past the largest token id
        (b"18446744073709551616", None),  # past 64 bits: orjson reads a float
        (b"-1", None),
        (b"-0", [0]),
        (b"1,,2", None),
        (b"01", None),
        (b"1.0", None),
        (b"true", None),
    ],
)
def test_ids_after_a_base_are_token_ids_or_nothing(items: bytes, ids: list[int] | None) -> None:
    assert _token_ids(items) == ids
