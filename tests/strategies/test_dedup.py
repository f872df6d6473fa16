"""Which recorded calls the trainer keeps (``agl.core.trainer.calls.dedup``): every call the harness
went on with, never a retry or an unused choice; the paper's rule on request."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from agl.core.contracts.samples import ModelCall
from agl.strategies.dedup import dedup


def call(prompt: list[int], response: list[int], choice: int = 0) -> ModelCall:
    return ModelCall(prompt, response, [-1.0] * len(response), choice=choice)


def test_an_unused_choice_is_dropped_and_the_used_one_kept() -> None:
    """n = 2: the harness went on with choice 1. Before: dedup kept the last choice of the
    prompt whichever it was, and so trained an unused response with the reward."""
    first, second = call([1], [2], choice=0), call([1], [3], choice=1)
    went_on = call([1, 3, 9], [4])
    assert dedup([first, second, went_on]) == [second, went_on]
    took_first = call([1, 2, 9], [4])
    assert dedup([first, second, took_first]) == [first, took_first]


def test_a_final_n_call_keeps_the_choice_a_client_takes_by_default() -> None:
    first, second = call([1], [2], choice=0), call([1], [3], choice=1)
    assert dedup([first, second]) == [first]


def test_a_prompt_sent_again_after_it_was_continued_keeps_both_calls() -> None:
    """A context reset or a subagent opens with an earlier prompt. Before: the earlier
    call, which the conversation continued, was deleted."""
    opening = call([1], [2])
    continued = call([1, 2, 9], [5])
    again = call([1], [7])
    assert dedup([opening, continued, again]) == [opening, continued, again]
    assert dedup([opening, continued, again], "last") == [continued, again]


def test_a_retry_is_dropped() -> None:
    lost, retried = call([1], [2]), call([1], [3])
    assert dedup([lost, retried, call([1, 3, 9], [4])])[0] is retried
    assert dedup([lost, retried]) == [retried]


@st.composite
def conversations(draw: st.DrawFn) -> tuple[list[ModelCall], list[bool]]:
    """A harness's calls with the truth of which it used: requests of 1-3 choices (one
    continued, at random), lost requests sent again, context resets to an earlier prompt.
    Responses are distinct tokens, so the truth is unambiguous. A request that nothing
    continues (the last, or one followed by a reset) was taken as choice 0, as clients
    do; its prompt is never sent again, which would make it indistinguishable from a
    lost one."""
    fresh = itertools.count(100)
    calls: list[ModelCall] = []
    used: list[bool] = []
    prompt = [1, 2]
    openings = [prompt]
    steps = draw(st.integers(1, 8))
    for step in range(steps):
        last = step == steps - 1
        while draw(st.booleans()) and draw(st.booleans()):  # lost: sent again
            for k in range(draw(st.integers(1, 3))):
                calls.append(call(prompt, [next(fresh)], choice=k))
                used.append(False)
        n = draw(st.integers(1, 3))
        # A reset goes to an earlier opening that was continued: sending an uncontinued
        # prompt again would make its first answer a retry.
        others = [o for o in openings if o != prompt]
        reset = (
            None if last or not others or draw(st.integers(0, 4)) else draw(st.sampled_from(others))
        )
        pick = 0 if last or reset is not None else draw(st.integers(0, n - 1))
        choices = [call(prompt, [next(fresh), next(fresh)], choice=k) for k in range(n)]
        calls.extend(choices)
        used.extend(k == pick for k in range(n))
        if reset is not None:
            if prompt in openings:
                openings.remove(prompt)
            prompt = reset
        else:
            prompt = choices[pick].prompt_ids + choices[pick].response_ids + [next(fresh)]
            openings.append(prompt)
    return calls, used


@settings(max_examples=300, deadline=None)
@given(conversations())
def test_dedup_keeps_exactly_the_calls_the_harness_used(
    conversation: tuple[list[ModelCall], list[bool]],
) -> None:
    calls, used = conversation
    assert dedup(calls) == [c for c, u in zip(calls, used, strict=True) if u]


@settings(max_examples=200, deadline=None)
@given(conversations(), st.sampled_from(["continued", "last"]))
def test_dedup_is_a_subsequence_with_one_call_per_uncontinued_prompt(
    conversation: tuple[list[ModelCall], list[bool]], rule: str
) -> None:
    calls, _ = conversation
    kept = dedup(calls, rule)
    position = iter(range(len(calls)))
    assert all(any(calls[i] is c for i in position) for c in kept)  # in order, no repeats
    prompts = {tuple(c.prompt_ids) for c in calls}
    assert {tuple(c.prompt_ids) for c in kept} == prompts  # every prompt keeps a call


def test_last_is_the_papers_rule() -> None:
    a1, b, a2 = call([1], [2]), call([3], [4]), call([1], [5])
    assert dedup([a1, b, a2], "last") == [b, a2]
