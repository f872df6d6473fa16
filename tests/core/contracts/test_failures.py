"""Failures named by cause (``agl.core.contracts.failures``) and what validation makes of them."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from agl.core.contracts.execution import LOST, NO_STATUS, ORPHANED, STOPPED
from agl.core.contracts.failures import Cause, failure_cause, is_final
from agl.core.contracts.records import Rollout, Status
from agl.core.run.tasks import Task, TaskConfig
from agl.core.trainer.assemble import FinishedRollout
from agl.core.trainer.loop import validation_metrics

CASES = [
    # (status, error, reward?, failed calls) -> cause
    (Status.SUCCEEDED, None, True, [], None),
    (Status.SUCCEEDED, None, False, [], Cause.NO_REWARD),
    (Status.FAILED, NO_STATUS, False, [], Cause.NO_REWARD),
    (Status.FAILED, "ValueError: the input is bad", False, [], Cause.HARNESS_ERROR),
    (Status.FAILED, "exit code 3", False, [], Cause.HARNESS_ERROR),
    (Status.FAILED, "timed out after 60 s", False, [], Cause.TIMEOUT),
    (Status.FAILED, "attempt timed out", False, [], Cause.TIMEOUT),
    (Status.FAILED, "Job failed (DeadlineExceeded): too long", False, [], Cause.TIMEOUT),
    (Status.FAILED, "worker killed by signal SIGKILL", False, [], Cause.EXECUTOR),
    (Status.FAILED, "no live worker to run it", False, [], Cause.EXECUTOR),
    (Status.FAILED, "interrupted: the trainer restarted", False, [], Cause.EXECUTOR),
    (Status.FAILED, LOST, False, [], Cause.EXECUTOR),
    (Status.FAILED, ORPHANED, False, [], Cause.EXECUTOR),
    (Status.FAILED, STOPPED, False, [], Cause.EXECUTOR),
    (Status.FAILED, "APIConnectionError: Connection error.", False, [], Cause.GATEWAY),
    # A graded task's grader raised on what the agent left, whatever it raised.
    (Status.FAILED, "grader raised: IsADirectoryError: x", False, [], Cause.GRADER),
    (Status.FAILED, "grader raised: ConnectError: refused", False, [], Cause.GRADER),
    (Status.FAILED, "cannot report the grade: ConnectError: x", False, [], Cause.GATEWAY),
    # The model's own text in a harness's message names no cause but the harness's: were
    # it read as the gateway's, the attempt would be retried instead of scored.
    (Status.FAILED, "ValueError: the tool said ConnectError", False, [], Cause.HARNESS_ERROR),
    (Status.FAILED, "RuntimeError: APIConnectionError: x", False, [], Cause.HARNESS_ERROR),
    # The harness raised because its model call failed at the endpoint: not its fault.
    (Status.FAILED, "model call refused: 502", False, [{"status": 502}], Cause.UPSTREAM),
    # A 400 the harness provoked is its own doing.
    (Status.FAILED, "BadRequestError: 400", False, [{"status": 400}], Cause.HARNESS_ERROR),
]


@pytest.mark.parametrize(("status", "error", "reward", "failed", "cause"), CASES)
def test_each_failure_has_its_cause(status, error, reward, failed, cause) -> None:
    assert failure_cause(status, error, reward, failed) == cause


def test_agent_failures_are_final_infrastructure_ones_wait_for_their_retry() -> None:
    def rollout(error: str, attempt: int = 1) -> Rollout:
        return Rollout.model_validate(
            {
                "rollout_id": "r",
                "group_id": "g",
                "input": {},
                "mode": "train",
                "metadata": {},
                "timeout_s": None,
                "status": "failed",
                "attempt": attempt,
                "max_attempts": 2,
                "error": error,
                "version": 1,
                "created_at": 0.0,
                "updated_at": 0.0,
            }
        )

    crashed = rollout("ValueError: boom")
    assert is_final(crashed, failure_cause(Status.FAILED, crashed.error, False))
    died = rollout("worker exited with code 1")
    assert not is_final(died, failure_cause(Status.FAILED, died.error, False))
    again = rollout("worker exited with code 1", attempt=2)
    assert is_final(again, failure_cause(Status.FAILED, again.error, False))
    with pytest.raises(ValueError, match="has not ended"):
        failure_cause(Status.RUNNING, None, False)


def _finished(rid: str, reward: float | None, error: str | None = None) -> FinishedRollout:
    status = Status.FAILED if error else Status.SUCCEEDED
    return FinishedRollout(rid, "v", "val", status, reward, [], error=error)


def test_validation_counts_agent_failures_as_zero() -> None:
    """Before: 5 wins and 5 harness failures scored 1.0, above 5 wins and 5 losses."""
    wins = [_finished(f"w{i}", 1.0) for i in range(5)]
    crashes = [_finished(f"c{i}", None, "ValueError: no number") for i in range(5)]
    losses = [_finished(f"l{i}", 0.0) for i in range(5)]
    lost = [_finished("x", None, "worker exited with code -9")]
    crashed = validation_metrics(wins + crashes + lost, "val", "zero")
    lost_games = validation_metrics(wins + losses, "val", "zero")
    assert crashed["val/reward"] == lost_games["val/reward"] == 0.5
    assert crashed["val/failed"] == 5 and crashed["val/left_out"] == 1
    assert crashed["val/rollouts"] == 10
    assert crashed["val/reward_se"] == pytest.approx(math.sqrt(0.25 * 10 / 9 / 10))
    dropped = validation_metrics(wins + crashes, "val", "drop")
    assert dropped["val/reward"] == 1.0 and dropped["val/left_out"] == 5


def test_extra_validation_sets_merge_their_options_and_sampling(tmp_path: Path) -> None:
    (tmp_path / "vs_task.py").write_text(
        "def inputs(n, seed=0, **o):\n    return [dict(o, i=i) for i in range(n)]\n"
        "def val(n, **o):\n    return [dict(o, i=i) for i in range(n)]\n"
    )
    config = TaskConfig(
        name="t",
        harness="vs_task:inputs",
        train_inputs="vs_task:inputs",
        val_inputs="vs_task:val",
        options={"a": 1, "b": 2},
        sampling={"temperature": 1.0, "max_tokens": 5},
        val_sets={"hot": {"options": {"b": 3}, "sampling": {"temperature": 0.7}}},
    )
    task = Task(config, tmp_path)
    assert task.val_sets == ["hot"]
    (default,) = task.val_inputs(1)
    (hot,) = task.val_inputs(1, "hot")
    assert default == {"temperature": 1.0, "max_tokens": 5, "a": 1, "b": 2, "i": 0}
    assert hot == {"temperature": 0.7, "max_tokens": 5, "a": 1, "b": 3, "i": 0}
    with pytest.raises(ValueError, match="no validation set"):
        task.val_inputs(1, "cold")
    with pytest.raises(ValueError, match="only 'options' and 'sampling'"):
        TaskConfig(**{**vars(config), "val_sets": {"x": {"seed": 1}}})
