"""The retokenization testbed: a real tokenizer, a Qwen3-like template, and drift that is real.

Merge-strategy tests trust the traces' labels, so these tests check the labels against
the tokens themselves: a transition is unlabelled exactly when the next prompt continues
the previous prompt and response token for token (eq. 9), and each mechanism breaks
continuity the way it claims (text preserved or not, eq. 8).
"""

from __future__ import annotations

import json
import random
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agl.backends.inference.qwen_chat import TINY_TOKENIZER_PATH
from agl.strategies.merging import common_prefix_len
from agl.testing.retok import SPECIAL_TOKENS, load_tokenizer
from agl.testing.retok.make_tokenizer import PROSE_WORDS, tokenizer_json
from agl.testing.retok.template import (
    parse_assistant_output,
    render,
    render_assistant_output,
    tool_call_json,
)
from agl.testing.retok.traces import (
    MECHANISMS,
    SYSTEM_PROMPT,
    TOOLS,
    Rates,
    Trace,
    generate_rollout,
    generate_traces,
)

TOK = load_tokenizer()
ROLLOUTS = 16
# Higher than the defaults, so a few rollouts show every mechanism many times.
RATES = Rates(noncanonical=0.5, toolcall=0.5, subagent=0.3, summary=0.2, retry=0.3)


@cache
def traces(mechanisms: frozenset[str]) -> tuple[Trace, ...]:
    return tuple(
        generate_rollout(random.Random(seed), mechanisms, turns=8, rates=RATES)
        for seed in range(ROLLOUTS)
    )


def transitions(mechanisms: frozenset[str]) -> list[tuple[Trace, int]]:
    return [(t, i) for t in traces(mechanisms) for i in range(len(t.labels))]


def system_ids() -> list[int]:
    return TOK.encode(render([{"role": "system", "content": SYSTEM_PROMPT}], TOOLS, False))


# --- tokenizer ---------------------------------------------------------------------------


def test_committed_tokenizer_is_what_make_tokenizer_writes() -> None:
    committed = TINY_TOKENIZER_PATH.read_text(encoding="utf-8")
    assert committed == tokenizer_json(), "run python -m agl.testing.retok.make_tokenizer"
    assert len(committed.encode()) < 200_000
    assert 1000 <= TOK.vocab_size <= 2000


def test_special_tokens_are_single_ids_that_decode_literally() -> None:
    for special in SPECIAL_TOKENS:
        ids = TOK.encode(f"a{special}b")
        assert len(ids) == 3 and TOK.is_special(ids[1])
        assert TOK.token_bytes(ids[1]) == special.encode()
        assert TOK.decode(ids) == f"a{special}b"
    assert not TOK.is_special(TOK.encode("a")[0])


texts = st.lists(st.one_of(st.text(), st.sampled_from(SPECIAL_TOKENS))).map("".join)


@settings(max_examples=200, deadline=None)
@given(texts)
def test_decode_of_encode_is_the_text(text: str) -> None:
    ids = TOK.encode(text)
    assert TOK.decode(ids) == text
    assert b"".join(TOK.token_bytes(i) for i in ids) == text.encode()


words = st.lists(st.sampled_from([w for w in PROSE_WORDS if len(w) > 2]), min_size=1, max_size=20)
words = words.map(" ".join)


@settings(max_examples=100, deadline=None)
@given(st.tuples(words, st.text()).map("".join), st.integers(1, 4), st.randoms())
def test_resegmented_ids_spell_the_text_but_are_not_its_encoding(
    text: str, splits: int, rng: random.Random
) -> None:
    ids = TOK.encode(text)
    resampled = TOK.resegment(ids, rng, splits)
    assert TOK.decode(resampled) == text  # eq. 8 would hold ...
    assert resampled != ids and TOK.encode(TOK.decode(resampled)) == ids  # ... eq. 11 breaks
    assert len(ids) < len(resampled) <= len(ids) + splits
    assert all(0 <= i < TOK.vocab_size for i in resampled)
    specials = [i for i in ids if TOK.is_special(i)]
    assert [i for i in resampled if TOK.is_special(i)] == specials  # only text tokens split


def test_resegment_refuses_a_sequence_of_single_bytes() -> None:
    with pytest.raises(ValueError, match="split"):
        TOK.resegment(TOK.encode("<think>\n"), random.Random(0))


# --- template ----------------------------------------------------------------------------

plain = st.text().filter(lambda t: not any(s in t for s in SPECIAL_TOKENS))
content = plain.filter(lambda t: not t[:1].isspace())  # see test below
reasoning = plain.filter(lambda t: t.strip("\n") == t and t != "")
arguments = st.dictionaries(st.text(max_size=8), st.one_of(st.integers(), plain), max_size=3)


@settings(max_examples=150, deadline=None)
@given(content, st.none() | reasoning, st.lists(arguments, max_size=2))
def test_history_continues_the_generated_output_token_for_token(
    text: str, thought: str | None, calls: list[dict[str, object]]
) -> None:
    """Without a new user turn, re-rendering the parsed output reproduces it exactly.

    This is what makes eq. 9 hold when no mechanism is on: the output ends with the special
    ``<|im_end|>`` and the only non-special boundary, after ``assistant\\n``, is a
    pre-token boundary unless the content starts with whitespace.
    """
    if not text and not calls:
        text = "ok"
    history = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    output = render_assistant_output(text, thought, [tool_call_json("f", a) for a in calls])
    message = parse_assistant_output(output)
    after = render([*history, message], add_generation_prompt=False)
    assert after == render(history) + output + "\n"
    before = TOK.encode(render(history)) + TOK.encode(output)
    assert TOK.encode(after)[: len(before)] == before


def test_leading_newline_in_content_would_break_the_token_boundary() -> None:
    """Why the trace generator never starts content with whitespace: BPE merges across."""
    history = [{"role": "user", "content": "u"}]
    output = render_assistant_output("\nhello")
    after = render([*history, parse_assistant_output(output)], add_generation_prompt=False)
    assert after.startswith(render(history) + output)  # the text continues ...
    before = TOK.encode(render(history)) + TOK.encode(output)
    assert TOK.encode(after)[: len(before)] != before  # ... the tokens do not


def test_reasoning_is_dropped_before_the_last_user_message_only() -> None:
    turn = {"role": "assistant", "content": "done", "reasoning_content": "why"}
    tool = {"role": "tool", "content": "result"}
    history = [{"role": "user", "content": "go"}, turn, tool, turn]
    assert render(history).count("<think>\nwhy\n</think>\n\ndone") == 2
    later = render([*history, {"role": "user", "content": "more"}])
    assert "<think>" not in later and later.count("assistant\ndone<|im_end|>") == 2


def test_tool_results_are_wrapped_in_one_user_turn() -> None:
    text = render([{"role": "tool", "content": "a"}, {"role": "tool", "content": "b"}])
    assert text == (
        "<|im_start|>user\n<tool_response>\na\n</tool_response>\n<tool_response>\nb\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_parser_reserializes_tool_call_json() -> None:
    messy = '{"arguments":{"path":"a.py"},"name":"read_file"}'
    output = render_assistant_output("Let me look.", None, [messy])
    message = parse_assistant_output(output)
    assert message["content"] == "Let me look."
    assert message["tool_calls"][0]["function"] == {
        "name": "read_file",
        "arguments": '{"path": "a.py"}',
    }
    rerendered = render([message], add_generation_prompt=False)
    assert messy not in rerendered
    assert tool_call_json("read_file", {"path": "a.py"}) in rerendered


# --- traces ------------------------------------------------------------------------------


def test_without_mechanisms_every_prompt_continues_the_previous_call() -> None:
    for trace in traces(frozenset()):
        assert trace.labels == [frozenset()] * (len(trace.calls) - 1)
        assert set(trace.agents) == {"main"} and len(trace.calls) == 8
        for i in range(len(trace.labels)):
            assert trace.text_prefix_holds(i), (trace.rollout_id, i)
            assert trace.token_prefix_holds(i), (trace.rollout_id, i)


@pytest.mark.parametrize("mechanisms", [frozenset(), *(frozenset({m}) for m in MECHANISMS)])
def test_recorded_ids_are_the_tokenizers(mechanisms: frozenset[str]) -> None:
    for trace in traces(mechanisms)[:4]:
        for call, prompt, response in zip(
            trace.calls, trace.prompt_texts, trace.response_texts, strict=True
        ):
            assert call.prompt_ids == TOK.encode(prompt)
            assert TOK.decode(call.response_ids) == response
            assert response.endswith("<|im_end|>")
            assert len(call.logprobs) == len(call.response_ids)
            assert all(lp < 0 for lp in call.logprobs)
            canonical = call.response_ids == TOK.encode(response)
            assert canonical or "noncanonical" in mechanisms


@pytest.mark.parametrize("mechanism", sorted(MECHANISMS))
def test_each_mechanism_breaks_token_continuity_exactly_where_labelled(mechanism: str) -> None:
    labelled = 0
    for trace, i in transitions(frozenset({mechanism})):
        label = trace.labels[i]
        assert label <= {mechanism}
        assert trace.token_prefix_holds(i) == (not label), (trace.rollout_id, i, label)
        labelled += bool(label)
    assert labelled >= 10


@pytest.mark.parametrize(
    ("mechanism", "text_preserved"),
    [("noncanonical", True), ("think", False), ("toolcall", False)],
)
def test_only_noncanonical_drift_preserves_the_text(mechanism: str, text_preserved: bool) -> None:
    """Eq. 8 still holds under decode-retokenize drift; template and parser change the text."""
    for trace, i in transitions(frozenset({mechanism})):
        if trace.labels[i]:
            assert trace.text_prefix_holds(i) == text_preserved, (trace.rollout_id, i)
            if text_preserved:
                # The break lies inside the previous response: the history is untouched.
                a, b = trace.calls[i], trace.calls[i + 1]
                assert common_prefix_len(a.prompt_ids + a.response_ids, b.prompt_ids) >= len(
                    a.prompt_ids
                )


def test_think_is_sampled_then_dropped_after_a_user_turn() -> None:
    for trace, i in transitions(frozenset({"think"})):
        response, following = trace.response_texts[i], trace.prompt_texts[i + 1]
        assert response.startswith("<think>\n")
        reasoning = response.split("</think>")[0]
        assert (reasoning in following) == (not trace.labels[i])
        if trace.labels[i]:
            assert trace.messages[i + 1][-1]["role"] == "user"


def test_toolcall_json_is_rewritten_in_the_history() -> None:
    for trace, i in transitions(frozenset({"toolcall"})):
        if not trace.labels[i]:
            continue
        response, following = trace.response_texts[i], trace.prompt_texts[i + 1]
        raw = response.split("<tool_call>\n")[1].split("\n</tool_call>")[0]
        call = json.loads(raw)
        canonical = tool_call_json(call["name"], call["arguments"])
        assert raw != canonical and raw not in following and canonical in following


@pytest.mark.parametrize("mechanism", ["subagent", "summary"])
def test_subagent_and_summary_prompts_share_only_the_system_prefix(mechanism: str) -> None:
    system = system_ids()
    seen = 0
    for trace, i in transitions(frozenset({mechanism})):
        if not trace.labels[i]:
            continue
        a, b = trace.calls[i], trace.calls[i + 1]
        shared = common_prefix_len(a.prompt_ids + a.response_ids, b.prompt_ids)
        assert b.prompt_ids[: len(system)] == system
        # They part inside the first message after the system prompt (a task or a summary).
        first_message = TOK.encode(render(trace.messages[i][:2], TOOLS, False))
        assert len(system) <= shared < len(first_message), (trace.rollout_id, i)
        assert trace.messages[i + 1][1] != trace.messages[i][1]
        seen += 1
    assert seen >= ROLLOUTS  # every rollout shows the mechanism at least once


def test_subagent_calls_interleave_and_continue_their_own_history() -> None:
    interleaved = False
    for trace in traces(frozenset({"subagent"})):
        for j, agent in enumerate(trace.agents):
            p = trace.prev[j]
            if p >= 0:
                assert trace.agents[p] == agent
                prompt, response = trace.calls[p].prompt_ids, trace.calls[p].response_ids
                assert trace.calls[j].prompt_ids[: len(prompt) + len(response)] == prompt + response
            else:
                assert agent != "main" or j == 0
        main = [j for j, a in enumerate(trace.agents) if a == "main"]
        interleaved |= any(a != "main" for a in trace.agents[main[0] : main[-1]])
    assert interleaved


def test_retried_calls_repeat_the_prompt_and_the_harness_keeps_the_last() -> None:
    seen = 0
    for trace, i in transitions(frozenset({"retry"})):
        if not trace.labels[i]:
            continue
        seen += 1
        assert trace.calls[i].prompt_ids == trace.calls[i + 1].prompt_ids
        assert trace.response_texts[i] != trace.response_texts[i + 1]
        later = [j for j in range(i + 2, len(trace.calls)) if trace.prev[j] == i + 1]
        assert all(trace.prev[j] != i for j in range(len(trace.calls)))
        assert later or i + 2 == len(trace.calls)
    assert seen > 0


def test_all_mechanisms_together_labels_match_token_continuity() -> None:
    counts = dict.fromkeys(MECHANISMS, 0)
    for trace, i in transitions(frozenset(MECHANISMS)):
        assert trace.token_prefix_holds(i) == (not trace.labels[i]), (trace.rollout_id, i)
        for m in trace.labels[i]:
            counts[m] += 1
    assert all(counts.values()), counts


def test_generation_is_deterministic_and_seeded() -> None:
    a = generate_traces(7, 3, MECHANISMS, (3, 5))
    b = generate_traces(7, 3, MECHANISMS, (3, 5))
    c = generate_traces(8, 3, MECHANISMS, (3, 5))
    assert [(t.calls, t.labels, t.agents) for t in a] == [(t.calls, t.labels, t.agents) for t in b]
    assert [t.calls for t in a] != [t.calls for t in c]
    assert [t.rollout_id for t in a] == ["rollout-0", "rollout-1", "rollout-2"]
    for trace in a:
        main_turns = sum(
            1
            for j, agent in enumerate(trace.agents)
            if agent == "main" and not (j > 0 and trace.labels[j - 1] == {"retry"})
        )
        assert 3 <= main_turns <= 5


def test_policy_version_advances_only_when_asked() -> None:
    rates = Rates(version_bump=1.0)
    trace = generate_rollout(random.Random(0), set(), 3, rates=rates, policy_version=5)
    assert [c.policy_version for c in trace.calls] == [6, 7, 8]
    assert {c.policy_version for t in traces(frozenset()) for c in t.calls} == {0}


def test_unknown_mechanisms_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown mechanisms"):
        generate_rollout(random.Random(0), {"typo"}, 2)
