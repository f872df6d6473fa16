"""How an attempt's calls became samples, for the rollout page: ``agl.core.trainer.explain``'s
account turned into rows and token strips (which token to highlight, how each side split
the text)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from agl.core.contracts.records import Event
from agl.core.trainer.assemble import MergeStrategy
from agl.core.trainer.explain import BreakDetail, Stitch, calls_from_events, explain
from agl.strategies.merging import common_prefix_len

log = logging.getLogger(__name__)

WINDOW = 3  # shared tokens shown before the first differing one


@dataclass(frozen=True)
class Piece:
    text: str
    id: int | None


@dataclass(frozen=True)
class SpanView:
    index: int
    span: str
    tokens: int
    actions: int
    break_reason: str | None


@dataclass(frozen=True)
class BreakView:
    sample: int
    call: int
    reason: str
    at: int
    same_text: bool
    before: list[Piece]
    after: list[Piece]
    first_diff: int  # index into ``before`` and ``after`` of the first differing token
    before_split: str  # from the first differing token on, pieces joined by "|"
    after_split: str


@dataclass(frozen=True)
class StitchView:
    call: int
    at: int
    recorded: list[Piece]
    trained: list[Piece]
    first_diff: int


@dataclass(frozen=True)
class Explained:
    merge: str
    error: str | None = None
    calls: int = 0
    duplicates: int = 0
    samples: tuple[SpanView, ...] = ()
    breaks: tuple[BreakView, ...] = ()
    stitches: tuple[StitchView, ...] = ()


def explain_attempt(
    events: Sequence[Event],
    attempt: int,
    merge_name: str,
    merge: MergeStrategy,
    decode_token: Callable[[int], str] | None,
) -> Explained:
    # The trainer leaves out calls whose ids do not decode to the text, with the tokenizer
    # the run's merge strategy holds.
    calls = calls_from_events(events, attempt, merge.decode)
    try:
        x = explain(calls, merge, decode_token, window=WINDOW)
    except Exception as error:
        # Calls the trainer could not merge either, or a strategy's bug: the section says
        # so and the rest of the page still shows.
        log.warning("viewer: cannot explain attempt %d", attempt, exc_info=True)
        return Explained(merge_name, error=f"{type(error).__name__}: {error}")
    return Explained(
        merge=merge_name,
        calls=len(x.calls),
        duplicates=x.duplicates_dropped,
        samples=tuple(
            SpanView(s.index, span(s.calls), s.tokens, s.actions, s.break_reason) for s in x.samples
        ),
        breaks=tuple(_break(b) for b in x.breaks),
        stitches=tuple(_stitch(s) for s in x.stitches),
    )


def span(calls: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"calls 0-2, 5"``."""
    if not calls:
        return "no calls"
    runs: list[str] = []
    start = prev = calls[0]
    for c in [*calls[1:], None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if c is not None:
            start = prev = c
    return ("call " if len(calls) == 1 else "calls ") + ", ".join(runs)


def _pieces(texts: Sequence[str], ids: Sequence[int | None]) -> list[Piece]:
    return [Piece(t, i) for t, i in zip(texts, ids, strict=True)]


def _break(b: BreakDetail) -> BreakView:
    first = common_prefix_len(b.before_ids, b.after_ids)
    return BreakView(
        sample=b.sample,
        call=b.call,
        reason=str(b.reason),
        at=b.at,
        same_text=b.same_text,
        before=_pieces(b.before, b.before_ids),
        after=_pieces(b.after, b.after_ids),
        first_diff=first,
        before_split="|".join(b.before[first:]),
        after_split="|".join(b.after[first:]),
    )


def _stitch(s: Stitch) -> StitchView:
    # Both windows start WINDOW tokens (or fewer, at the start) before ``at``.
    return StitchView(
        call=s.call,
        at=s.at,
        recorded=_pieces(s.recorded, [None] * len(s.recorded)),
        trained=_pieces(s.trained, [None] * len(s.trained)),
        first_diff=min(s.at, WINDOW),
    )
