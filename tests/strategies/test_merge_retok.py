"""Merge strategies on rollouts with real drift: the testbed's tokenizer and template."""

from __future__ import annotations

import pytest

from agl.core.contracts.samples import BreakReason
from agl.strategies.dedup import dedup
from agl.strategies.registry import get
from agl.testing.retok import load_tokenizer
from agl.testing.retok.traces import MECHANISMS, Rates, generate_traces
from tests.helpers.sample_positions import action_positions, contexts

RATES = Rates(noncanonical=0.5, toolcall=0.6, subagent=0.3, summary=0.2, retry=0.0)


def traces(mechanisms: frozenset[str], n: int = 12):
    return generate_traces(7, n, mechanisms, turns_range=(3, 6), rates=RATES)


@pytest.mark.parametrize("mechanism", sorted(MECHANISMS - {"retry"}))
def test_prefix_breaks_exactly_at_the_drifted_transitions(mechanism: str) -> None:
    for trace in traces(frozenset({mechanism})):
        samples = get("merge", "prefix")(trace.calls, trace.rollout_id, trace.group_id)
        starts = {min(c for c in s.call_index if c >= 0) for s in samples}
        for i, label in enumerate(trace.labels):
            assert ((i + 1) in starts) == bool(label), (i, label)


@pytest.mark.parametrize("name", ["independent", "prefix", "tree"])
def test_exact_strategies_on_real_drift(name: str) -> None:
    for trace in traces(MECHANISMS):
        calls = dedup(trace.calls)
        samples = get("merge", name)(calls, trace.rollout_id, trace.group_id)
        expected = {(i, j) for i, c in enumerate(calls) for j in range(len(c.response_ids))}
        seen = action_positions(samples)
        assert set(seen) == expected and set(seen.values()) == {1}
        for s in samples:
            done: dict[int, int] = {}
            for p, context in enumerate(contexts(s)):
                c = s.call_index[p]
                if c < 0:
                    continue
                j = done.get(c, 0)
                done[c] = j + 1
                assert context == calls[c].prompt_ids + calls[c].response_ids[:j]


def test_stitch_rejoins_noncanonical_drift_and_counts_each_changed_prompt() -> None:
    decode = load_tokenizer().decode
    for trace in traces(frozenset({"noncanonical"})):
        (sample,) = get("merge", "stitch")(trace.calls, trace.rollout_id, "g", decode=decode)
        # Once a retokenized response is replaced by its sampled tokens, every later call
        # is trained under a prompt that differs from the one it was sampled under.
        drifted = [any(trace.labels[:j]) for j in range(1, len(trace.calls))]
        assert sample.stitched_calls == sum(drifted)
        prefix = get("merge", "prefix")(trace.calls, trace.rollout_id, "g")
        assert all(s.break_reason is BreakReason.RESPONSE_RETOKENIZED for s in prefix[1:])


@pytest.mark.parametrize("mechanism", ["think", "toolcall"])
def test_stitch_cannot_rejoin_text_level_changes(mechanism: str) -> None:
    decode = load_tokenizer().decode
    for trace in traces(frozenset({mechanism})):
        stitched = get("merge", "stitch")(trace.calls, trace.rollout_id, "g", decode=decode)
        prefix = get("merge", "prefix")(trace.calls, trace.rollout_id, "g")
        assert len(stitched) == len(prefix) and sum(s.stitched_calls for s in stitched) == 0
