"""The rollout state machine as one pure function, shared by every store.

Invariants:
- ``version`` grows by exactly one on every change and never on a no-op;
- a repeated PATCH (same status, same attempt) changes nothing, so clients retry blindly;
- ``attempt`` only grows, by one, on failed -> queuing, and never beyond ``max_attempts``;
- a patch that names an older attempt cannot touch the current one.
"""

from __future__ import annotations

from agl.core.contracts.records import TERMINAL, TRANSITIONS, Rollout, Status, StatusPatch


class IllegalTransition(Exception):
    """A status change the state machine forbids; carries the rollout as it is."""

    def __init__(self, message: str, current: Rollout) -> None:
        super().__init__(message)
        self.current = current


def apply_patch(rollout: Rollout, patch: StatusPatch, now: float) -> Rollout | None:
    """The rollout after ``patch``, or None when the patch is already in effect."""
    current = rollout.status
    if patch.attempt is not None and patch.attempt != rollout.attempt:
        if patch.attempt < rollout.attempt and patch.status is Status.QUEUING:
            return None  # that attempt was re-queued already
        raise IllegalTransition(
            f"attempt {patch.attempt} is not the current attempt of rollout "
            f"{rollout.rollout_id!r} (current: attempt {rollout.attempt}, {current})",
            rollout,
        )
    if patch.status is current:
        return None
    if patch.status not in TRANSITIONS[current]:
        raise IllegalTransition(
            f"rollout {rollout.rollout_id!r} cannot go from {current} to {patch.status}",
            rollout,
        )
    changes: dict[str, object] = {
        "status": patch.status,
        "version": rollout.version + 1,
        "updated_at": now,
    }
    if patch.status is Status.QUEUING:
        if rollout.attempt >= rollout.max_attempts:
            raise IllegalTransition(
                f"rollout {rollout.rollout_id!r} has used all {rollout.max_attempts} attempts",
                rollout,
            )
        changes |= {
            "attempt": rollout.attempt + 1,
            "started_at": None,
            "ended_at": None,
            "error": None,
        }
    elif patch.status is Status.RUNNING:
        changes["started_at"] = now
    elif patch.status in TERMINAL:
        changes |= {"ended_at": now, "error": patch.error}
    return rollout.model_copy(update=changes)
