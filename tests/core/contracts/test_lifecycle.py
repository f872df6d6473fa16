"""The rollout state machine as a pure function, with Hypothesis for its invariants."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agl.core.contracts.records import TRANSITIONS, Rollout, Status, StatusPatch
from agl.core.gateway.store.lifecycle import IllegalTransition, apply_patch


def fresh(max_attempts: int = 3) -> Rollout:
    return Rollout(
        rollout_id="r",
        group_id="g",
        input=None,
        mode="train",
        metadata={},
        max_attempts=max_attempts,
        timeout_s=None,
        status=Status.QUEUING,
        attempt=1,
        version=1,
        created_at=0.0,
        updated_at=0.0,
    )


patches = st.builds(
    StatusPatch, status=st.sampled_from(list(Status)), attempt=st.none() | st.integers(1, 4)
)


@given(max_attempts=st.integers(1, 3), sequence=st.lists(patches, max_size=30))
def test_invariants_hold_for_any_patch_sequence(
    max_attempts: int, sequence: list[StatusPatch]
) -> None:
    rollout = fresh(max_attempts)
    for now, patch in enumerate(sequence, start=1):
        try:
            after = apply_patch(rollout, patch, float(now))
        except IllegalTransition as refused:
            assert refused.current == rollout  # a refusal carries the unchanged state
            continue
        if after is None:  # no-op: the patch was already in effect
            assert patch.status == rollout.status or (
                patch.status is Status.QUEUING
                and patch.attempt is not None
                and patch.attempt < rollout.attempt
            )
            continue
        assert after.status in TRANSITIONS[rollout.status]
        assert after.version == rollout.version + 1
        assert after.attempt - rollout.attempt == (after.status is Status.QUEUING)
        assert 1 <= after.attempt <= max_attempts
        if after.status is Status.RUNNING:
            assert after.started_at == now and after.ended_at is None
        elif after.status is Status.QUEUING:
            assert after.started_at is None and after.ended_at is None and after.error is None
        else:
            assert after.ended_at == now
        # Repeating a patch that just took effect is a no-op: clients retry blindly.
        assert (
            apply_patch(after, patch.model_copy(update={"attempt": after.attempt}), float(now))
            is None
        )
        rollout = after


def test_requeue_starts_a_clean_attempt() -> None:
    r = apply_patch(fresh(), StatusPatch(status=Status.RUNNING), 1.0)
    assert r is not None and r.started_at == 1.0
    r = apply_patch(r, StatusPatch(status=Status.FAILED, error="boom"), 2.0)
    assert r is not None and (r.ended_at, r.error) == (2.0, "boom")
    r = apply_patch(r, StatusPatch(status=Status.QUEUING, attempt=1), 3.0)
    assert r is not None
    assert (r.attempt, r.status, r.started_at, r.ended_at, r.error, r.version) == (
        2,
        Status.QUEUING,
        None,
        None,
        None,
        4,
    )


def test_patch_for_another_attempt_is_refused() -> None:
    r = apply_patch(fresh(), StatusPatch(status=Status.RUNNING), 1.0)
    assert r is not None
    with pytest.raises(IllegalTransition, match="not the current attempt"):
        apply_patch(r, StatusPatch(status=Status.SUCCEEDED, attempt=2), 2.0)
