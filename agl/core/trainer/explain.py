"""How one rollout's recorded calls were assembled into samples under a merge strategy:
which calls each sample holds, where and why a sample broke off from the one before, and
which recorded prompts a strategy changed (stitch). Pure (no HTTP, no torch): the
``python -m agl.rollouts show`` command and the browser viewer both render it.

What holds (tested in tests/core/trainer/test_explain.py), for calls with non-empty responses (what
``calls_from_events`` gives):

- every deduplicated call is in exactly one ``SampleSpan`` (its response tokens are);
  ``tree`` makes one sample per rollout, so its one span holds every call;
- ``breaks`` are the samples with a ``break_reason``, one each, in sample order; ``tree``
  has none and ``independent`` breaks at every call after the first;
- ``before`` and ``after`` start at the same token index, ``at - min(at, window)``, so
  both share the context tokens before ``at``; from ``at`` on, each runs until the two
  texts line up again (a retokenization: ``same_text``), else ``window`` tokens;
- ``stitches`` are the calls trained under a context other than their recorded prompt;
  the exact strategies (independent, prefix, tree) have none, and for stitch there is one
  per call it counts in ``Sample.stitched_calls``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from agl.core.contracts.records import Event
from agl.core.contracts.samples import BreakReason, ModelCall, Sample
from agl.core.contracts.strategies import Merge
from agl.core.trainer.calls import read_calls
from agl.strategies.dedup import dedup
from agl.strategies.merging import common_prefix_len

DecodeToken = Callable[[int], str]


@dataclass(frozen=True)
class BreakDetail:
    sample: int  # index of the sample that starts at this break
    call: int  # index (in the deduplicated calls) of the call whose prompt did not continue
    reason: BreakReason
    at: int  # token index where the prompt left the previous sequence
    before: list[str]  # previous sequence's tokens around `at`, each decoded alone
    after: list[str]  # the new prompt's tokens around `at`
    before_ids: list[int]
    after_ids: list[int]
    same_text: bool  # both windows decode to the same text: a retokenization, not an edit


@dataclass(frozen=True)
class Stitch:
    call: int  # a call whose prompt stitch changed
    at: int  # first token where its recorded prompt differs from what it was trained under
    recorded: list[str]
    trained: list[str]


@dataclass(frozen=True)
class SampleSpan:
    index: int
    calls: list[int]  # deduplicated call indices whose responses are in this sample
    tokens: int
    actions: int
    break_reason: BreakReason | None


@dataclass(frozen=True)
class Explanation:
    calls: list[ModelCall]  # after dedup
    duplicates_dropped: int
    samples: list[SampleSpan]
    breaks: list[BreakDetail]
    stitches: list[Stitch]


def calls_from_events(
    events: Sequence[Event],
    attempt: int | None = None,
    decode: Callable[[list[int]], str] | None = None,
) -> list[ModelCall]:
    """The calls the trainer reads for a rollout: the valid ``model_request`` events of
    ``attempt`` (default: the last attempt that has events), in order, not deduplicated.
    ``decode`` (the policy's tokenizer, as the trainer has it) also leaves out calls whose
    ids do not decode to the text the harness got."""
    if attempt is None:
        attempt = max((e.attempt for e in events), default=0)
    return read_calls((e for e in events if e.attempt == attempt), decode).calls


def explain(
    calls: list[ModelCall],
    merge: Merge,
    decode_token: DecodeToken | None = None,
    window: int = 3,
) -> Explanation:
    """Dedup ``calls`` as the trainer does, merge them with ``merge`` and say how.

    ``decode_token`` decodes one token id alone; without it tokens show as ``<id>`` and no
    two different windows count as the same text.
    """
    kept = dedup(calls)
    empty = [i for i, c in enumerate(kept) if not c.response_ids]
    if empty:
        raise ValueError(f"calls {empty} have no response tokens: they are in no sample")
    samples = merge(kept, "", "") if kept else []
    tokens = _Tokens(decode_token, window)
    return Explanation(
        calls=kept,
        duplicates_dropped=len(calls) - len(kept),
        samples=[_span(i, s) for i, s in enumerate(samples)],
        breaks=[
            _break(i, samples, kept, tokens)
            for i, s in enumerate(samples)
            if s.break_reason is not None
        ],
        stitches=[st for s in samples for st in _stitches(s, kept, tokens)],
    )


def _span(index: int, sample: Sample) -> SampleSpan:
    return SampleSpan(
        index=index,
        calls=sorted({c for c in sample.call_index if c >= 0}),
        tokens=len(sample.tokens),
        actions=sample.num_actions,
        break_reason=sample.break_reason,
    )


def _break(
    index: int, samples: list[Sample], calls: list[ModelCall], tokens: _Tokens
) -> BreakDetail:
    sample = samples[index]
    assert sample.break_reason is not None
    # A linear sample starts with the call that broke off: its first call.
    call = min(c for c in sample.call_index if c >= 0)
    previous = samples[index - 1].tokens if index else []
    prompt = calls[call].prompt_ids
    # ``independent`` breaks without looking: say where the prompt would have left it.
    at = sample.diverged_at
    if at is None:
        at = common_prefix_len(previous, prompt)
    before_ids, after_ids = tokens.windows(previous, prompt, at)
    return BreakDetail(
        sample=index,
        call=call,
        reason=sample.break_reason,
        at=at,
        before=tokens.pieces(before_ids),
        after=tokens.pieces(after_ids),
        before_ids=before_ids,
        after_ids=after_ids,
        same_text=tokens.text(before_ids) == tokens.text(after_ids),
    )


def _stitches(sample: Sample, calls: list[ModelCall], tokens: _Tokens) -> list[Stitch]:
    """The sample's calls whose first response token is trained after other tokens than
    the recorded prompt (its ancestors in a tree sample, the tokens before it otherwise)."""
    first: dict[int, int] = {}
    for position, call in enumerate(sample.call_index):
        if call >= 0:
            first.setdefault(call, position)
    out = []
    for call, position in first.items():
        trained = _context(sample, position)
        prompt = calls[call].prompt_ids
        if trained == prompt:
            continue
        at = common_prefix_len(prompt, trained)
        recorded_ids, trained_ids = tokens.windows(prompt, trained, at)
        out.append(Stitch(call, at, tokens.pieces(recorded_ids), tokens.pieces(trained_ids)))
    return out


def _context(sample: Sample, position: int) -> list[int]:
    """The tokens the token at ``position`` is trained after."""
    if sample.parents is None:
        return sample.tokens[:position]
    path = []
    node = sample.parents[position]
    while node >= 0:
        path.append(sample.tokens[node])
        node = sample.parents[node]
    return path[::-1]


@dataclass(frozen=True)
class _Tokens:
    """Tokens as shown (``pieces``) and as compared (``text``), and the windows of two
    sequences where they part."""

    decode_token: DecodeToken | None
    window: int

    def pieces(self, ids: list[int]) -> list[str]:
        if self.decode_token is None:
            return [f"<{t}>" for t in ids]
        return [self.decode_token(t) for t in ids]

    def spell(self, token: int) -> str:
        """A token's text for comparisons. One that decodes alone to U+FFFD (part of a
        UTF-8 character, or an invalid byte) spells only itself: such pieces all look
        alike whatever their bytes, and an invalid byte the server decoded lossily comes
        back as a real U+FFFD, an edit. A character split into byte tokens on one side
        only then counts as an edit too: the safe error."""
        (text,) = self.pieces([token])
        return f"\0{token}\0" if "\ufffd" in text else text

    def text(self, ids: list[int]) -> str:
        return "".join(self.spell(t) for t in ids)

    def windows(self, a: list[int], b: list[int], at: int) -> tuple[list[int], list[int]]:
        """``a`` and ``b`` around ``at`` (where they part): up to ``window`` shared tokens
        before it, then each side until their texts line up again, else ``window``
        tokens."""
        start = max(0, at - self.window)
        i, j = self._realigned(a[at:], b[at:])
        return a[start : at + i], b[start : at + j]

    def _realigned(self, a: list[int], b: list[int]) -> tuple[int, int]:
        """The shortest non-empty heads of ``a`` and ``b`` that spell the same text,
        found by extending the shorter text a token at a time; when the texts part or one
        side runs out, ``window`` tokens of each (or as many as were read)."""
        text_a = text_b = ""
        i = j = 0
        while True:
            if i and j and text_a == text_b:
                return i, j
            if not (text_a.startswith(text_b) or text_b.startswith(text_a)):
                break
            if len(text_a) <= len(text_b):
                if i == len(a):
                    break
                text_a += self.spell(a[i])
                i += 1
            else:
                if j == len(b):
                    break
                text_b += self.spell(b[j])
                j += 1
        return min(max(i, self.window), len(a)), min(max(j, self.window), len(b))
