"""The same seed, the same run: every request is sampled under a seed of its own (the
gateway derives it from the run's seed, the rollout, the attempt and the request:
agl/core/gateway/seeding.py), and a sync step trains on its groups in submission order.
So a second run of the session's short run samples the same tokens in every call, scores
the same rewards and logs the same metrics, though its requests raced each other in
another order. Timings (time/*, train/train_s, throughput/*, inference/busy_s) vary, and
logprobs may differ in their last bits where a batch held other rows (the engine's batching is
numerically, not bitwise, invisible: 2e-5 measured on one machine, 1.1e-4 on CI's), so
logprobs are compared to 1e-3 and metrics to 1e-4 (they average over many tokens)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agl.core.contracts.records import MODEL_REQUEST
from agl.core.gateway.seeding import RequestSeeds, request_seed
from tests.conftest import SHORT_RUN, train_run
from tests.helpers.stored_events import stored_events

VARYING = ("time/", "throughput/", "inference/")

Calls = dict[tuple[str, int], list[dict[str, Any]]]


def _calls(run: Path) -> Calls:
    """Each attempt's recorded calls, in the order the attempt made them."""
    calls: Calls = {}
    for event in stored_events(run / "gateway" / "gateway.db", MODEL_REQUEST):
        calls.setdefault((event.rollout_id, event.attempt), []).append(event.data)
    return calls


def _metrics(run: Path) -> list[dict[str, float]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # Durations (time/*, train/train_s) and rates vary from run to run.
    return [
        {k: v for k, v in row.items() if not k.startswith(VARYING) and not k.endswith("_s")}
        for row in rows
    ]


@pytest.fixture(scope="module")
def twice(short_run: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The session's short run, and the same command run again."""
    return short_run, train_run(tmp_path_factory.mktemp("again") / "run", *SHORT_RUN)


@pytest.mark.slow
def test_the_same_seed_samples_the_same_tokens_in_every_call(twice: tuple[Path, Path]) -> None:
    first, second = (_calls(run) for run in twice)
    assert first.keys() == second.keys()
    for attempt, calls in first.items():
        again = second[attempt]
        assert [c["response_ids"] for c in calls] == [c["response_ids"] for c in again], attempt
        assert [c["seed"] for c in calls] == [c["seed"] for c in again]
        for a, b in zip(calls, again, strict=True):
            assert a["logprobs"] == pytest.approx(b["logprobs"], rel=1e-3, abs=1e-3)


@pytest.mark.slow
def test_every_call_is_sampled_under_its_own_seed(twice: tuple[Path, Path]) -> None:
    calls = _calls(twice[0])
    seeds = [c["seed"] for attempt in calls.values() for c in attempt]
    assert len(set(seeds)) == len(seeds)
    # The rollouts of a group play the same game, and still sample apart.
    replies: dict[str, set[tuple[int, ...]]] = {}
    for (rollout_id, _), attempt in calls.items():
        group = rollout_id.rsplit(".", 1)[0]
        replies.setdefault(group, set()).add(tuple(attempt[0]["response_ids"]))
    assert any(len(r) > 1 for r in replies.values())


@pytest.mark.slow
def test_the_same_seed_logs_the_same_metrics(twice: tuple[Path, Path]) -> None:
    first, second = (_metrics(run) for run in twice)
    assert [sorted(r) for r in first] == [sorted(r) for r in second]
    for a, b in zip(first, second, strict=True):
        for key, value in a.items():
            assert b[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key


def test_a_seed_is_a_function_of_the_run_the_rollout_the_attempt_and_the_request() -> None:
    base = request_seed(0, "t0.0.0", 1, b"request", 0)
    assert base == request_seed(0, "t0.0.0", 1, b"request", 0)
    others = {
        request_seed(1, "t0.0.0", 1, b"request", 0),
        request_seed(0, "t0.0.1", 1, b"request", 0),
        request_seed(0, "t0.0.0", 2, b"request", 0),
        request_seed(0, "t0.0.0", 1, b"other", 0),
        request_seed(0, "t0.0.0", 1, b"request", 1),
    }
    assert base not in others and len(others) == 5
    assert all(0 <= s < 2**62 for s in others)


def test_a_repeated_request_gets_a_new_seed_and_other_attempts_do_not_count() -> None:
    seeds = RequestSeeds(7)
    first = seeds.next("r", 1, b"x")
    assert seeds.next("r", 2, b"x") == request_seed(7, "r", 2, b"x", 0)
    assert seeds.next("r", 1, b"x") == request_seed(7, "r", 1, b"x", 1) != first


def test_a_forgotten_count_starts_again_and_memory_stays_bounded() -> None:
    seeds = RequestSeeds(0, capacity=2)
    for rollout in ("a", "b", "c"):
        seeds.next(rollout, 1, b"x")
    assert seeds.next("a", 1, b"x") == request_seed(0, "a", 1, b"x", 0)
    assert len(seeds) == 2


def test_a_negative_run_seed_is_refused() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        RequestSeeds(-1)
