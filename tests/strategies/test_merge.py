"""Merge strategies: property tests over traces with every drift mechanism."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agl.core.contracts.samples import BreakReason, ModelCall, Sample
from agl.strategies.dedup import dedup
from agl.strategies.registry import get, names
from tests.helpers.sample_positions import action_positions, contexts
from tests.helpers.toy_traces import decode, traces

EXACT = ("independent", "prefix", "tree")


def merge(name: str, calls: list[ModelCall]) -> list[Sample]:
    options = {"decode": decode} if name == "stitch" else {}
    return get("merge", name)(calls, "r", "g", **options)


@pytest.mark.parametrize("name", EXACT)
@given(calls=traces())
def test_every_action_is_scored_under_the_prompt_it_was_sampled_under(
    name: str, calls: list[ModelCall]
) -> None:
    calls = dedup(calls)
    for s in merge(name, calls):
        done: Counter[int] = Counter()
        for p, context in enumerate(contexts(s)):
            if not s.action_mask[p]:
                assert s.call_index[p] == -1 and s.logprobs[p] == 0.0
                continue
            call = calls[s.call_index[p]]
            j = done[s.call_index[p]]
            done[s.call_index[p]] += 1
            assert context == call.prompt_ids + call.response_ids[:j]
            assert s.tokens[p] == call.response_ids[j]
            assert s.logprobs[p] == call.logprobs[j]


@pytest.mark.parametrize("name", ["independent", "prefix", "stitch", "tree"])
@given(calls=traces())
def test_every_action_appears_exactly_once(name: str, calls: list[ModelCall]) -> None:
    calls = dedup(calls)
    expected = {(i, j) for i, c in enumerate(calls) for j in range(len(c.response_ids))}
    seen = action_positions(merge(name, calls))
    assert set(seen) == expected and set(seen.values()) <= {1}


@given(calls=traces())
def test_tree_stores_each_shared_prefix_once(calls: list[ModelCall]) -> None:
    calls = dedup(calls)
    (s,) = merge("tree", calls)
    assert s.parents is not None and s.position_ids is not None
    assert all(parent < node for node, parent in enumerate(s.parents))
    paths = [tuple([*c, t]) for c, t in zip(contexts(s), s.tokens, strict=True)]
    assert s.position_ids == [len(path) - 1 for path in paths]
    prefixes = {
        tuple(seq[:n])
        for c in calls
        for seq in [c.prompt_ids + c.response_ids]
        for n in range(1, len(seq) + 1)
    }
    assert set(paths) == prefixes
    # a path is stored twice only when the same token was sampled twice after it
    for path, count in Counter(paths).items():
        if count > 1:
            nodes = [n for n, p in enumerate(paths) if p == path]
            assert sum(1 for n in nodes if s.action_mask[n]) >= count - 1


@given(calls=traces())
def test_prefix_merges_exactly_when_eq_9_holds(calls: list[ModelCall]) -> None:
    calls = dedup(calls)
    samples = merge("prefix", calls)
    sample_of = {}
    for k, s in enumerate(samples):
        for c in set(s.call_index) - {-1}:
            sample_of[c] = k
    for i in range(len(calls) - 1):
        previous = calls[i].prompt_ids + calls[i].response_ids
        eq9 = calls[i + 1].prompt_ids[: len(previous)] == previous
        assert (sample_of[i] == sample_of[i + 1]) == eq9
    for s in samples[1:]:
        assert s.break_reason in (BreakReason.RESPONSE_RETOKENIZED, BreakReason.HISTORY_REWRITTEN)


@given(calls=traces())
def test_stitch_flags_a_changed_prompt_exactly_when_it_changed_one(
    calls: list[ModelCall],
) -> None:
    calls = dedup(calls)
    samples = merge("stitch", calls)
    for s in samples:
        first_token = {}
        for p, c in enumerate(s.call_index):
            if c >= 0 and c not in first_token:
                first_token[c] = p
        changed = 0
        for c, p in first_token.items():
            trained_under = s.tokens[:p]
            assert decode(trained_under) == decode(calls[c].prompt_ids)  # texts line up
            changed += trained_under != calls[c].prompt_ids
        assert s.stitched_calls == changed
    # Stitching only ever joins more: never more samples than prefix merging.
    assert len(samples) <= len(merge("prefix", calls))


def test_stitch_replaces_a_retokenized_response_and_says_so() -> None:
    # "ab" sampled as [a, b]; the harness sends back its canonical retokenization [ab].
    first = ModelCall([9], [1, 2], [-0.1, -0.2])
    second = ModelCall([9, 5, 8, 3], [4], [-0.3])
    (s,) = merge("stitch", [first, second])
    assert s.tokens == [9, 1, 2, 8, 3, 4] and s.stitched_calls == 1
    prefix = merge("prefix", [first, second])
    assert len(prefix) == 2 and prefix[1].break_reason is BreakReason.RESPONSE_RETOKENIZED
    assert prefix[1].diverged_at == 1
    with pytest.raises(ValueError, match="decode"):
        get("merge", "stitch")([first, second], "r", "g")


def test_break_reasons_name_the_place_of_divergence() -> None:
    first = ModelCall([9, 1, 1], [2, 2], [-1.0, -1.0])
    rewritten = ModelCall([9, 3], [4], [-1.0])
    samples = merge("prefix", [first, rewritten])
    assert (samples[1].break_reason, samples[1].diverged_at) == (BreakReason.HISTORY_REWRITTEN, 1)
    assert [s.break_reason for s in merge("independent", [first, rewritten])] == [
        None,
        BreakReason.INDEPENDENT,
    ]


def test_dedup_keeps_the_last_of_identical_prompts() -> None:
    a1, b, a2 = (
        ModelCall([1], [2], [-1.0]),
        ModelCall([3], [4], [-1.0]),
        ModelCall([1], [5], [-2.0]),
    )
    assert dedup([a1, b, a2]) == [b, a2]


def test_unknown_strategy_lists_the_registered_ones() -> None:
    with pytest.raises(ValueError, match="independent, prefix, stitch, tree"):
        get("merge", "greedy")
    assert names("merge") == ["independent", "prefix", "stitch", "tree"]


@settings(max_examples=20)
@given(calls=traces(max_calls=12))
def test_tree_is_never_larger_than_independent(calls: list[ModelCall]) -> None:
    calls = dedup(calls)
    (tree,) = merge("tree", calls)
    assert len(tree) <= sum(len(s) for s in merge("independent", calls))
    assert len(tree) <= sum(len(s) for s in merge("prefix", calls)) or len(calls) == 0


def test_an_empty_rollout_has_no_samples() -> None:
    for name in names("merge"):
        assert merge(name, []) == []


@given(st.data())
def test_identical_calls_dedup_to_one(data: st.DataObject) -> None:
    calls = data.draw(traces(max_calls=3))
    assert dedup(calls + calls[-1:]) == dedup(calls)


def test_calls_from_events_keeps_trainable_model_requests_in_order() -> None:
    from agl.core.contracts.records import Event
    from agl.core.trainer.calls import calls_from_events

    def event(seq: int, type: str, data: dict) -> Event:
        return Event(
            rollout_id="r",
            attempt=1,
            event_id=str(seq),
            sequence=seq,
            type=type,
            data=data,
            time=0.0,
        )

    call = {"prompt_ids": [1, 2], "response_ids": [3], "logprobs": [-0.5], "policy_version": 2}
    events = [
        event(7, "model_request", {**call, "prompt_ids": [1, 2, 3, 4]}),
        event(3, "model_request", call),
        event(4, "reward", {"value": 1.0}),
        event(5, "model_request", {**call, "prompt_ids": None}),  # endpoint gave no ids
    ]
    assert calls_from_events(events) == [
        ModelCall([1, 2], [3], [-0.5], 2),
        ModelCall([1, 2, 3, 4], [3], [-0.5], 2),
    ]


def test_merge_metrics_count_breaks_and_stitches() -> None:
    from agl.strategies.merge_metrics import merge_metrics

    first = ModelCall([9], [1, 2], [-0.1, -0.2])
    retokenized = ModelCall([9, 5, 8, 3], [4], [-0.3])
    prefix = [merge("prefix", [first, retokenized]), merge("prefix", [first])]
    m = merge_metrics(prefix, calls=3)
    assert m["merge/samples_per_rollout"] == 1.5 and m["merge/single_sample_rollouts"] == 0.5
    assert m["merge/breaks/response_retokenized"] == 0.5
    assert m["merge/breaks/history_rewritten"] == 0.0
    assert m["merge/tokens_per_action"] == (3 + 5 + 3) / 5
    stitched = merge_metrics([merge("stitch", [first, retokenized])], calls=2)
    assert stitched["merge/stitched_calls"] == 0.5 and stitched["merge/samples_per_rollout"] == 1
