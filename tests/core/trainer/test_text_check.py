"""The trainer's check that a call's ids produce the text the harness got
(``calls.text_mismatch``): no false positive for the text either engine returns — special
tokens kept (the embedded engine) or left out (vLLM's default), cut at a stop string —
and a response whose ids were tampered with is still caught."""

from __future__ import annotations

from functools import cache

from hypothesis import given, settings
from hypothesis import strategies as st

from agl.backends.inference.models import load_model
from agl.core.config_groups import text_decode
from agl.core.trainer.calls import TokenText, text_mismatch


@cache
def tokenizer():  # type: ignore[no-untyped-def]
    return load_model("tiny").tokenizer


@cache
def token_text() -> TokenText:
    return text_decode(tokenizer())


def ids_with_specials() -> st.SearchStrategy[list[int]]:
    specials = sorted(token_text().special_ids)  # eos and pad, <tool_call>, <think>, ...
    assert len(specials) > 2
    ordinary = st.integers(0, len(tokenizer()) - 1).filter(lambda i: i not in set(specials))
    return st.lists(
        st.one_of(ordinary, ordinary, ordinary, st.sampled_from(specials)), min_size=1, max_size=24
    )


def record(ids: list[int], text: str) -> dict:
    return {"response_ids": ids, "response": text}


@settings(max_examples=300, deadline=None)
@given(ids=ids_with_specials(), cut=st.integers(0, 100), skip=st.booleans())
def test_what_either_engine_returns_is_never_flagged(ids: list[int], cut: int, skip: bool) -> None:
    text = tokenizer().decode(ids, skip_special_tokens=skip)  # vLLM skips, embedded keeps
    text = text[: len(text) * cut // 100]  # a stop string may end it anywhere
    assert not text_mismatch(record(ids, text), token_text())


@settings(max_examples=300, deadline=None)
@given(
    ids=ids_with_specials(), at=st.integers(0, 23), other=st.integers(0, 1535), skip=st.booleans()
)
def test_tampered_ids_are_caught(ids: list[int], at: int, other: int, skip: bool) -> None:
    text = tokenizer().decode(ids, skip_special_tokens=skip)
    tampered = list(ids)
    tampered[at % len(ids)] = other
    decode = token_text()
    if text.strip() in decode(tampered) or text.strip() in decode.without_specials(tampered):
        return  # the new ids still produce the text: nothing to catch
    assert text_mismatch(record(tampered, text), decode)


def test_a_plain_decode_function_checks_with_special_tokens_kept() -> None:
    t = tokenizer()
    special = t.convert_tokens_to_ids("</tool_response>")
    ids = [
        *t.encode("maybe Se", add_special_tokens=False),
        special,
        *t.encode("may", add_special_tokens=False),
    ]
    skipped = t.decode(ids, skip_special_tokens=True)  # the text vLLM returned in issue 25
    assert not text_mismatch(record(ids, skipped), token_text())
    plain = lambda xs: t.decode(xs, skip_special_tokens=False)  # noqa: E731
    assert text_mismatch(record(ids, skipped), plain)
