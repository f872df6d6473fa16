"""A group's rollouts side by side: reward, and the advantage each would get under the
rollout-level and the sample-level strategy (with the run's estimator and merge), so
that the effect of a rollout splitting into several samples is visible."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from agl.core.contracts.queries import Summary
from agl.core.contracts.records import Event, Rollout, Status
from agl.core.contracts.strategies import Advantage
from agl.core.trainer.assemble import FinishedRollout, MergeStrategy, assemble
from agl.core.trainer.calls import shown_messages
from agl.core.trainer.explain import calls_from_events
from agl.ui.views import MessageView, message_view

LEVELS = ("rollout", "sample")  # the advantage strategies compared


@dataclass
class Card:
    rollout: Rollout
    summary: Summary | None
    transcript: list[MessageView] = field(default_factory=list)
    advantages: dict[str, list[float]] = field(default_factory=dict)  # level -> per sample
    in_baseline: bool = False  # the trainer would score it: a reward, or its agent failed (0)


def cards(
    rows: Sequence[tuple[Rollout, Summary | None]],
    events: Mapping[str, Sequence[Event]],
    merge: MergeStrategy | None,
    advantages: Mapping[str, Advantage],
) -> list[Card]:
    """One card per rollout; ``events`` holds the current attempt's events of those
    whose conversation and samples are shown. With a ``merge`` and ``advantages``
    (level → strategy), each card gets its samples' advantages at each level, computed
    as the trainer does (``agl.core.trainer.assemble``) over the group's finished rollouts."""
    out = []
    finished = []
    decode = None if merge is None else merge.decode  # the trainer's check of ids vs text
    for rollout, summary in rows:
        card = Card(rollout, summary)
        evs = events.get(rollout.rollout_id, [])
        card.transcript = _transcript(evs)
        reward = None if summary is None else summary.reward
        if rollout.status in (Status.SUCCEEDED, Status.FAILED):
            done = FinishedRollout(
                rollout.rollout_id,
                rollout.group_id,
                rollout.mode,
                rollout.status,
                reward,
                calls_from_events(evs, rollout.attempt, decode),
                rollout.error,
            )
            # An agent's failure scores 0 in its group; the infrastructure's is left out.
            card.in_baseline = done.scored_reward() is not None
            finished.append(done)
        out.append(card)
    if merge is not None and finished:
        by_id = {c.rollout.rollout_id: c for c in out}
        for level, advantage in advantages.items():
            batch = assemble(finished, merge, advantage)
            for sample, value in zip(batch.samples, batch.advantages, strict=True):
                by_id[sample.rollout_id].advantages.setdefault(level, []).append(value)
    return out


def _transcript(events: Sequence[Event]) -> list[MessageView]:
    """The last recorded call's messages and its response: the whole conversation of a
    chat harness."""
    last = max(
        (e for e in events if e.type == "model_request" and isinstance(e.data, dict)),
        key=lambda e: e.sequence,
        default=None,
    )
    if last is None:
        return []
    shown = [message_view(m) for m in shown_messages(last.data)]
    response = last.data.get("response")
    shown.append(MessageView("response", response if isinstance(response, str) else "", ""))
    return shown
