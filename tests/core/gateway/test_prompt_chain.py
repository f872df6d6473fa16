"""Each attempt's recent calls, and the one a new prompt extends
(agl/core/gateway/prompt_chain.py)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from agl.core.gateway.prompt_chain import Link, Match, PromptChain, shared_input
from agl.core.gateway.store.prompt_delta import PromptBase, common_prefix


def link(sequence: int, ids: str, input: Any = None) -> Link:
    """A call whose prompt and response are ``ids``, its last id the response."""
    prompt, _, response = ids.encode().rpartition(b",")
    if not prompt:  # one id: all response
        prompt, response = response, b""
    else:
        response = b"," + response
    written = None if input is None else orjson.dumps(input)
    items = 0 if input is None else len(input)
    key = None if input is None else "messages"
    return Link(sequence, prompt, response, ids.count(",") + 1, written, items, key)


def match(chain: PromptChain, rollout_id: str, attempt: int, ids: bytes, input: Any = None) -> Any:
    written = None if input is None else orjson.dumps(input)
    return chain.match(
        rollout_id, attempt, ids, input, written, None if input is None else "messages"
    )


def test_a_prompt_extends_the_call_whose_ids_it_starts_with() -> None:
    chain = PromptChain(1 << 20)
    chain.add("r", 1, link(3, "1,2,3", [{"role": "user"}]))
    messages = [{"role": "user"}, {"role": "assistant"}]
    assert match(chain, "r", 1, b"1,2,3,4,5", messages) == Match(PromptBase(3, 3, 1), 5)
    assert match(chain, "r", 1, b"1,2,3", messages) == Match(PromptBase(3, 3, 1), 5)  # equal


def test_a_match_covers_whole_ids_only() -> None:
    chain = PromptChain(1 << 20)
    chain.add("r", 1, link(3, "1,2,3"))
    assert match(chain, "r", 1, b"1,2,34", None) is None  # 34 is not 3
    assert match(chain, "r", 1, b"1,2,4,3", None) is None  # another response
    assert match(chain, "r", 1, b"1,2", None) is None  # shorter: extends nothing
    assert match(chain, "r", 1, b"9,2,3,4", None) is None


def test_the_longest_recent_call_is_the_base() -> None:
    chain = PromptChain(1 << 20)
    chain.add("r", 1, link(1, "1,2"))
    chain.add("r", 1, link(2, "1,2,3,4"))
    chain.add("r", 1, link(3, "7,8"))  # another agent of the rollout
    assert match(chain, "r", 1, b"1,2,3,4,5", None) == Match(PromptBase(2, 4, 0), 7)
    assert match(chain, "r", 1, b"1,2,9", None) == Match(PromptBase(1, 2, 0), 3)
    assert match(chain, "r", 1, b"7,8,9", None) == Match(PromptBase(3, 2, 0), 3)


def test_the_input_shared_is_kept_only_between_inputs_of_one_kind() -> None:
    chain = PromptChain(1 << 20)
    chain.add("r", 1, link(1, "1,2", "the prompt"))
    assert match(chain, "r", 1, b"1,2,3", "the prompt goes on") == Match(PromptBase(1, 2, 10), 3)
    assert match(chain, "r", 1, b"1,2,3", ["the prompt"]) == Match(PromptBase(1, 2, 0), 3)


def test_an_attempt_matches_only_its_own_calls() -> None:
    chain = PromptChain(1 << 20)
    chain.add("r", 1, link(1, "1,2"))
    assert match(chain, "r", 2, b"1,2,3", None) is None
    assert match(chain, "other", 1, b"1,2,3", None) is None
    chain.add("r", 2, link(5, "4,5"))  # a later attempt replaces the earlier one's calls
    assert match(chain, "r", 1, b"1,2,3", None) is None
    assert match(chain, "r", 2, b"4,5,6", None) is not None
    assert chain.bytes == 3


def test_an_attempt_keeps_its_newest_calls() -> None:
    chain = PromptChain(1 << 20, per_attempt=2)
    for sequence in range(1, 4):
        chain.add("r", 1, link(sequence, f"{sequence}0"))
    assert match(chain, "r", 1, b"10,1", None) is None  # the oldest is gone
    assert match(chain, "r", 1, b"30,1", None) is not None
    assert chain.bytes == 4


def test_memory_stays_bounded_least_recently_used_attempts_going_first() -> None:
    chain = PromptChain(100)
    forty = "x" * 37  # with its quotes and the id: 40 bytes
    chain.add("a", 1, link(1, "1", forty))
    chain.add("b", 1, link(1, "2", forty))
    assert match(chain, "a", 1, b"1,5") is not None  # a is used: b is older now
    chain.add("c", 1, link(1, "3", forty))
    assert chain.bytes == 80 and len(chain) == 2
    assert match(chain, "b", 1, b"2,5") is None
    assert match(chain, "a", 1, b"1,5") is not None
    chain.add("d", 1, link(1, "4", "x" * 99))  # larger than all of it: not kept
    assert chain.bytes == 80 and match(chain, "d", 1, b"4") is None


def test_a_forgotten_rollout_extends_nothing() -> None:
    chain = PromptChain(1 << 20)
    chain.add("r", 1, link(1, "1,2"))
    chain.forget("r")
    chain.forget("never-seen")
    assert match(chain, "r", 1, b"1,2,3", None) is None
    assert chain.bytes == 0 and len(chain) == 0


def test_no_memory_keeps_nothing() -> None:
    chain = PromptChain(0)
    chain.add("r", 1, link(1, "1,2"))
    assert match(chain, "r", 1, b"1,2,3", None) is None and chain.bytes == 0


@pytest.mark.parametrize(
    ("mine", "base"),
    [
        ([{"role": "user", "content": "a"}, {"c": 1}], [{"role": "user", "content": "a"}]),
        ([{"c": "a"}], [{"c": "a"}]),  # the same input
        ([{"c": 1.0}, 2], [{"c": 1}]),  # equal in Python, written otherwise
        ([{"c": "a", "d": 1}], [{"d": 1, "c": "a"}]),  # keys in another order
        (["ab", "c"], ["a"]),  # the base's item a prefix of mine
        ([12, 3], [1]),
        ([1, 2, 3], [1, 2, 4, 5]),  # branched
        ([], [1]),
        ([1], []),
        (["x"], "x"),  # another kind
        ("the prompt goes on", "the prompt"),
        ("the prompt", "the prompt goes on"),
    ],
)
def test_the_input_shared_is_common_prefix_of_the_rule(mine: Any, base: Any) -> None:
    written, theirs = orjson.dumps(mine), orjson.dumps(base)
    expected = common_prefix(mine, base) if type(mine) is type(base) else 0
    assert shared_input(mine, written, theirs, len(base)) == expected
