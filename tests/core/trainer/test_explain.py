"""agl.core.trainer.explain: how a rollout's calls were assembled, checked against the samples
the merge strategies make, on toy traces (every drift operation) and on the retokenization
testbed (real BPE drift with its ground truth)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agl.core.contracts.records import Event
from agl.core.contracts.samples import BreakReason, ModelCall, Sample
from agl.core.trainer.explain import Explanation, calls_from_events, explain
from agl.strategies.dedup import dedup
from agl.strategies.merging import common_prefix_len
from agl.strategies.registry import get
from agl.testing.retok import load_tokenizer
from agl.testing.retok.traces import MECHANISMS, Rates, generate_rollout
from tests.helpers.toy_traces import VOCAB, decode, traces

NAMES = ("independent", "prefix", "stitch", "tree")
WINDOW = 3


def merger(name: str, decode_ids=decode):
    strategy = get("merge", name)
    if name == "stitch":
        return lambda calls, r, g: strategy(calls, r, g, decode=decode_ids)
    return strategy


def check_consistent(calls: list[ModelCall], name: str, e: Explanation, window: int) -> None:
    """Every property explain.py promises, against the samples the strategy makes."""
    kept = dedup(calls)
    samples: list[Sample] = merger(name)(kept, "", "")
    assert e.calls == kept and e.duplicates_dropped == len(calls) - len(kept)
    # Every deduplicated call is in exactly one span, and the spans are the samples.
    assert Counter(c for span in e.samples for c in span.calls) == Counter(range(len(kept)))
    assert [(s.index, s.tokens, s.actions, s.break_reason) for s in e.samples] == [
        (i, len(s.tokens), s.num_actions, s.break_reason) for i, s in enumerate(samples)
    ]
    assert sum(s.actions for s in e.samples) == sum(len(c.response_ids) for c in kept)
    # One break per sample with a break reason, at its first call.
    broken = [s for s in e.samples if s.break_reason is not None]
    assert [(b.sample, b.reason, b.call) for b in e.breaks] == [
        (s.index, s.break_reason, min(s.calls)) for s in broken
    ]
    for b in e.breaks:
        previous, prompt = samples[b.sample - 1].tokens, kept[b.call].prompt_ids
        assert b.at == common_prefix_len(previous, prompt)
        start = max(0, b.at - window)
        assert b.before_ids == previous[start : start + len(b.before_ids)]
        assert b.after_ids == prompt[start : start + len(b.after_ids)]
        # The windows reach `at` and show the first differing token of each side.
        assert len(b.before_ids) >= min(b.at, window) + (b.at < len(previous))
        assert len(b.after_ids) >= min(b.at, window) + (b.at < len(prompt))
        assert b.before == [VOCAB[t] for t in b.before_ids]
        assert b.after == [VOCAB[t] for t in b.after_ids]
        assert b.same_text == (decode(b.before_ids) == decode(b.after_ids))
    if name == "stitch":
        assert len(e.stitches) == sum(s.stitched_calls for s in samples)
        for s in e.stitches:
            assert s.recorded != s.trained
    else:  # the exact strategies train every action under its recorded prompt
        assert e.stitches == []


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=150, deadline=None)
@given(calls=traces(), window=st.integers(1, 4))
def test_explanation_matches_the_samples(name: str, calls: list[ModelCall], window: int) -> None:
    e = explain(calls, merger(name), VOCAB.__getitem__, window=window)
    check_consistent(calls, name, e, window)


@settings(max_examples=150, deadline=None)
@given(calls=traces())
def test_per_strategy_shape(calls: list[ModelCall]) -> None:
    n = len(dedup(calls))
    tree = explain(calls, merger("tree"), VOCAB.__getitem__)
    assert [s.calls for s in tree.samples] == [list(range(n))] and tree.breaks == []
    independent = explain(calls, merger("independent"), VOCAB.__getitem__)
    assert [b.call for b in independent.breaks] == list(range(1, n))
    assert {b.reason for b in independent.breaks} <= {BreakReason.INDEPENDENT}


def test_the_toy_traces_exercise_every_case() -> None:
    """The property above is not vacuous: its examples hold both kinds of break, and
    stitches (a fixed trace per case, so this does not hang on Hypothesis's luck)."""
    ab, a_b = [5], [1, 2]  # "ab" and "a" "b": one text, two segmentations
    base = ModelCall([9, 3], a_b, [-1.0, -1.0])
    retokenized = ModelCall([9, 3, *ab, 8, 4], [10], [-1.0])
    edited = ModelCall([9, 3, 4, 8, 4], [10], [-1.0])
    for follow, same in ((retokenized, True), (edited, False)):
        e = explain([base, follow], merger("prefix"), VOCAB.__getitem__)
        check_consistent([base, follow], "prefix", e, WINDOW)
        (b,) = e.breaks
        after = ["<s>", "c", "ab"] if same else ["<s>", "c", "d", "|", "d"]
        assert (b.at, b.before, b.after, b.same_text) == (2, ["<s>", "c", "a", "b"], after, same)
    e = explain([base, retokenized], merger("stitch"), VOCAB.__getitem__)
    check_consistent([base, retokenized], "stitch", e, WINDOW)
    assert e.breaks == [] and [(s.call, s.at) for s in e.stitches] == [(1, 2)]
    (stitch,) = e.stitches
    assert (stitch.recorded, stitch.trained) == (["<s>", "c", "ab"], ["<s>", "c", "a", "b"])


# ------------------------------------------------------------------ real BPE drift

TOK = load_tokenizer()


def retok_piece(token: int) -> str:
    return TOK.decode([token])


@pytest.mark.parametrize("mechanism", sorted(MECHANISMS - {"retry"}))
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32), turns=st.integers(2, 5))
def test_real_drift_breaks_where_the_ground_truth_says(
    mechanism: str, seed: int, turns: int
) -> None:
    trace = generate_rollout(
        random.Random(seed), {mechanism}, turns, rates=Rates(noncanonical=0.5, retry=0.0)
    )
    e = explain(trace.calls, get("merge", "prefix"), retok_piece)
    assert e.duplicates_dropped == 0
    starts = {b.call for b in e.breaks}
    assert starts == {i + 1 for i, label in enumerate(trace.labels) if label}
    for b in e.breaks:
        # A non-canonical segmentation keeps the text: a retokenization; every other
        # mechanism changes the text (think dropped, JSON reserialized, history replaced).
        assert b.same_text == (mechanism == "noncanonical")
        if b.same_text:
            assert b.reason is BreakReason.RESPONSE_RETOKENIZED


def test_retokenized_word_shows_both_segmentations() -> None:
    """The paper's Figure 3: the model sampled " h|aving", the harness sent " hav|ing"."""
    h, aving, hav, ing = (TOK.token_to_id(t) for t in ("Ġh", "aving", "Ġhav", "ing"))
    assert None not in (h, aving, hav, ing)
    prompt = TOK.encode("<|im_start|>user\nHow are you?<|im_end|>\n<|im_start|>assistant\n")
    said, end = TOK.encode("I am"), TOK.encode(" fun<|im_end|>")
    sampled = [*said, h, aving, *end]
    first = ModelCall(prompt, sampled, [-0.5] * len(sampled))
    sent_back = [*said, hav, ing, *end]
    turn = TOK.encode("\n<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n")
    second = ModelCall(prompt + sent_back + turn, TOK.encode("Because."), [-0.5] * 3)
    at = len(prompt) + sampled.index(h)

    e = explain([first, second], get("merge", "prefix"), retok_piece)
    (b,) = e.breaks
    assert (b.reason, b.call, b.at, b.same_text) == (BreakReason.RESPONSE_RETOKENIZED, 1, at, True)
    assert b.before == ["I", " a", "m", " h", "aving"]
    assert b.after == ["I", " a", "m", " hav", "ing"]
    assert [s.calls for s in e.samples] == [[0], [1]]

    stitched = explain([first, second], merger("stitch", TOK.decode), retok_piece)
    assert stitched.breaks == [] and [s.calls for s in stitched.samples] == [[0, 1]]
    (s,) = stitched.stitches
    assert (s.call, s.at) == (1, at)
    assert (s.recorded, s.trained) == (b.after, b.before)

    bare = explain([first, second], get("merge", "prefix"))
    (b,) = bare.breaks
    # No texts to line up: ``window`` tokens past ``at`` on each side.
    assert b.before[3:5] == [f"<{h}>", f"<{aving}>"] and b.after[3:5] == [f"<{hav}>", f"<{ing}>"]
    assert len(b.before) == len(b.after) == 6
    assert not b.same_text  # without a decoder nothing says the texts agree


def test_a_lossy_byte_is_an_edit_not_a_retokenization() -> None:
    """An invalid byte sampled alone decodes to U+FFFD, and so does the first byte of the
    real U+FFFD the harness sends back: they look alike but are different text."""
    lone = next(t for t in range(TOK.vocab_size) if TOK.token_bytes(t) == b"\xb0")
    prompt = TOK.encode("<|im_start|>assistant\n")
    first = ModelCall(prompt, [lone], [-1.0])
    second = ModelCall(prompt + TOK.encode("\ufffd|"), [lone], [-1.0])
    (b,) = explain([first, second], get("merge", "prefix"), retok_piece).breaks
    assert b.before[-1] == b.after[-3] == "\ufffd" and not b.same_text


# ------------------------------------------------------------------ calls from events


def event(attempt: int, sequence: int, type: str, data: object) -> Event:
    return Event(
        rollout_id="r",
        attempt=attempt,
        event_id=f"e{sequence}",
        sequence=sequence,
        type=type,
        data=data,
        time=0.0,
    )


def request(prompt: list[int], response: list[int], version: int = 0) -> dict[str, object]:
    return {
        "prompt_ids": prompt,
        "response_ids": response,
        "logprobs": [-0.25] * len(response),
        "policy_version": version,
        "finish_reason": "stop",
    }


def test_calls_from_events_reads_the_last_attempt_in_order() -> None:
    events = [
        event(1, 1, "model_request", request([1], [2])),
        event(2, 5, "model_request", request([1, 2, 3], [4], version=2)),
        event(2, 3, "model_request", request([1], [3], version=1)),
        event(2, 4, "model_request_failed", {"status": 500, "error": "boom"}),
        event(2, 6, "model_request", {"prompt_ids": [7], "response_ids": []}),  # no ids
        event(2, 7, "reward", {"value": 1.0}),
    ]
    assert calls_from_events(events) == [
        ModelCall([1], [3], [-0.25], 1),
        ModelCall([1, 2, 3], [4], [-0.25], 2),
    ]
    assert calls_from_events(events, attempt=1) == [ModelCall([1], [2], [-0.25], 0)]
    assert calls_from_events([]) == []


def test_calls_from_events_checks_ids_against_the_text_given_a_decoder() -> None:
    """As the trainer does with the policy's tokenizer: ids that do not spell the answer
    the harness got are left out."""
    told = {**request([9, 1], [1, 2]), "response": "ab"}
    lied = {**request([9, 1, 1, 2, 8], [3]), "response": "ab"}  # id 3 is "c"
    events = [event(1, 1, "model_request", told), event(1, 2, "model_request", lied)]
    assert len(calls_from_events(events)) == 2
    assert calls_from_events(events, decode=decode) == [ModelCall([9, 1], [1, 2], [-0.25] * 2)]


def test_a_call_without_response_tokens_is_refused() -> None:
    with pytest.raises(ValueError, match="no response tokens"):
        explain([ModelCall([1], [2], [0.0]), ModelCall([1, 2, 3], [], [])], get("merge", "prefix"))


def test_no_calls_no_samples() -> None:
    assert explain([], get("merge", "prefix")) == Explanation([], 0, [], [], [])
