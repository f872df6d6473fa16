"""The W&B trajectory table (``agl.core.trainer.trajectories``): which rollouts, and what
each row says of one, under the run's merge."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from agl.core.contracts.records import Status
from agl.core.contracts.samples import ModelCall
from agl.core.trainer.assemble import FinishedRollout, MergeStrategy
from agl.core.trainer.trajectories import COLUMNS, cut, pick, trajectory_rows
from agl.strategies.registry import get

PREFIX = MergeStrategy(get("merge", "prefix"), decode=lambda ids: "".join(chr(97 + i) for i in ids))


def rollout(rid: str, calls: list[ModelCall], **fields: object) -> FinishedRollout:
    options = {"status": Status.SUCCEEDED, "reward": 1.0, "input": {"q": rid}} | fields
    return FinishedRollout(rid, "g", "train", calls=calls, **options)  # type: ignore[arg-type]


@given(st.integers(0, 40), st.integers(0, 10), st.text(max_size=5))
def test_the_same_key_picks_the_same_rollouts_and_no_more_than_asked(
    n: int, limit: int, key: str
) -> None:
    rollouts = [rollout(f"r{i}", []) for i in range(n)]
    picked = pick(rollouts, limit, key)
    assert len(picked) == min(n, limit)
    assert [r.rollout_id for r in picked] == sorted(r.rollout_id for r in picked)
    assert picked == pick(list(reversed(rollouts)), limit, key)


@given(st.text(max_size=300), st.integers(0, 200))
def test_a_cut_text_fits_and_keeps_both_ends(text: str, chars: int) -> None:
    short = cut(text, chars)
    assert len(short) <= max(chars, 0)
    if len(text) <= chars:
        assert short == text
    elif chars >= 60:  # room for the marker and some of each end
        assert text.startswith(short[:5]) and text.endswith(short[-5:])
        assert "characters …" in short


def test_a_row_shows_the_samples_and_why_they_broke() -> None:
    first = ModelCall([0, 1], [2, 3], [-0.1, -0.2])
    extends = ModelCall([0, 1, 2, 3, 4], [5], [-0.3])  # continues the first call
    rewritten = ModelCall([0, 9], [6], [-0.4])  # the history changed before the response
    rows = trajectory_rows(
        [rollout("r", [first, extends, rewritten], error=None)], PREFIX, limit=5, key="train:1"
    )
    (row,) = rows
    cell = dict(zip(COLUMNS, row, strict=True))
    assert cell["rollout_id"] == "r" and cell["input"] == '{"q": "r"}' and cell["reward"] == 1.0
    assert (cell["turns"], cell["response_tokens"], cell["samples"]) == (3, 4, 2)
    assert cell["sample_tokens"] == 6 + 3
    assert cell["breaks"] == "history_rewritten"
    assert cell["outcome"] == "succeeded"
    assert cell["conversation"] == (
        "── sample 1 ──\nabcdef\n── sample 2 (after a break: history_rewritten) ──\najg"
    )


def test_a_failed_rollout_says_why_and_a_long_conversation_is_cut() -> None:
    long = ModelCall(list(range(20)) * 50, [1], [-0.1])
    failed = rollout("f", [long], status=Status.FAILED, reward=None, error="exit code 3")
    (row,) = trajectory_rows([failed], PREFIX, limit=1, key="val:0", text_chars=100)
    cell = dict(zip(COLUMNS, row, strict=True))
    assert cell["outcome"] == "failed: exit code 3" and cell["reward"] is None
    assert len(cell["conversation"]) <= 100 and "characters …" in cell["conversation"]
