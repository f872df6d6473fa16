"""The scheduler's invariants (agl/backends/training/schedule.py's docstring), as properties.

Each invariant is one ``check_*`` function, run by a Hypothesis property over random
sample sets (1-6 samples per rollout, 1-4000 tokens each, shuffled so a rollout's samples
are not contiguous). ``test_checks_catch_broken_schedules`` feeds each check a schedule
broken in its way, so no property passes vacuously.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agl.backends.training.schedule import (
    MiniBatch,
    RankBatch,
    Schedule,
    attention_cost,
    balanced_partition,
    karmarkar_karp,
    pack_micro_batches,
    schedule,
    token_cost,
)
from agl.core.contracts.samples import Sample

FAST = settings(max_examples=60, deadline=None)


def make_sample(rollout_id: str, length: int) -> Sample:
    return Sample(
        tokens=[1] * length,
        action_mask=[1] * length,
        logprobs=[0.0] * length,
        rollout_id=rollout_id,
        group_id=f"g-{rollout_id}",
    )


@st.composite
def sample_sets(draw: st.DrawFn, max_rollouts: int = 30) -> list[Sample]:
    per_rollout = draw(st.lists(st.integers(1, 6), min_size=1, max_size=max_rollouts))
    flat = [
        (f"r{r}", draw(st.integers(1, 4000))) for r, n in enumerate(per_rollout) for _ in range(n)
    ]
    order = draw(st.permutations(range(len(flat))))
    return [make_sample(*flat[i]) for i in order]


@st.composite
def problems(draw: st.DrawFn) -> tuple[list[Sample], dict[str, int]]:
    samples = draw(sample_sets())
    num_rollouts = len({s.rollout_id for s in samples})
    config = {
        # More mini-batches than rollouts too: a step whose rollouts made no samples.
        "num_mini_batches": draw(st.integers(1, num_rollouts + 2)),
        "ranks": draw(st.integers(1, 8)),
        # Small caps force oversize samples and many micro-batches; large ones, few.
        "max_tokens_per_micro_batch": draw(
            st.one_of(st.integers(1, 4000), st.integers(4000, 20000))
        ),
    }
    return samples, config


# --- the invariants, one check each -------------------------------------------------------


def check_exactly_once(samples: list[Sample], plan: Schedule) -> None:
    seen = [
        i
        for mini in plan.mini_batches
        for rank in mini.ranks
        for micro in rank.micro_batches
        for i in micro
    ]
    assert sorted(seen) == list(range(len(samples))), "a sample is missing or repeated"


def check_rollouts_whole(samples: list[Sample], plan: Schedule) -> None:
    home: dict[str, int] = {}
    for m, mini in enumerate(plan.mini_batches):
        assert mini.sample_indices, f"mini-batch {m} is empty"
        for i in mini.sample_indices:
            rid = samples[i].rollout_id
            assert home.setdefault(rid, m) == m, f"rollout {rid} split across mini-batches"
        assert mini.rollout_ids == sorted(
            {samples[i].rollout_id for i in mini.sample_indices},
            key=lambda r: min(j for j, s in enumerate(samples) if s.rollout_id == r),
        )


def check_mini_batch_count(samples: list[Sample], plan: Schedule, requested: int) -> None:
    rollouts = len({s.rollout_id for s in samples})
    assert len(plan.mini_batches) == min(requested, rollouts), "wrong number of updates"


def check_balance(samples: list[Sample], plan: Schedule, cost=token_cost) -> None:
    """max - min ≤ max item, for mini-batches over rollouts and ranks over samples."""
    eps = 1e-6
    rollout_cost: dict[str, float] = {}
    for s in samples:
        rollout_cost[s.rollout_id] = rollout_cost.get(s.rollout_id, 0) + cost(s)
    mini_costs = [sum(rollout_cost[r] for r in mini.rollout_ids) for mini in plan.mini_batches]
    biggest_rollout = max(rollout_cost.values())
    assert max(mini_costs) - min(mini_costs) <= biggest_rollout + eps
    for mini in plan.mini_batches:
        rank_costs = [sum(cost(samples[i]) for i in rank.sample_indices) for rank in mini.ranks]
        biggest_sample = max(cost(samples[i]) for i in mini.sample_indices)
        assert max(rank_costs) - min(rank_costs) <= biggest_sample + eps, rank_costs
        k = len(rank_costs)
        mean = sum(rank_costs) / k
        assert max(rank_costs) <= mean + (1 - 1 / k) * biggest_sample + eps


def check_ranks_used(samples: list[Sample], plan: Schedule) -> None:
    for mini in plan.mini_batches:
        if len(mini.sample_indices) >= len(mini.ranks):
            assert all(rank.sample_indices for rank in mini.ranks), "a rank got no sample"


def check_cap(samples: list[Sample], plan: Schedule, cap: int) -> None:
    oversize = []
    for mini in plan.mini_batches:
        for rank in mini.ranks:
            for micro in rank.micro_batches:
                tokens = sum(len(samples[i]) for i in micro)
                if tokens > cap:
                    assert len(micro) == 1, f"micro-batch {micro} has {tokens} > {cap} tokens"
                    oversize.append(micro[0])
    assert sorted(oversize) == plan.oversize_samples
    assert plan.oversize_samples == [i for i, s in enumerate(samples) if len(s) > cap]


def check_lockstep(samples: list[Sample], plan: Schedule) -> None:
    for mini in plan.mini_batches:
        counts = {len(rank.micro_batches) for rank in mini.ranks}
        assert len(counts) == 1, f"ranks step {counts} times in one mini-batch"
        (count,) = counts
        assert count >= 1
        for rank in mini.ranks:
            empty = sum(1 for micro in rank.micro_batches if not micro)
            assert empty == max(0, count - len(rank.sample_indices)), "needless padding"


def check_bookkeeping(samples: list[Sample], plan: Schedule) -> None:
    for mini in plan.mini_batches:
        for rank in mini.ranks:
            assert rank.tokens == sum(len(samples[i]) for i in rank.sample_indices)
            assert rank.micro_batch_tokens == [
                sum(len(samples[i]) for i in micro) for micro in rank.micro_batches
            ]
            assert rank.micro_batch_tokens == sorted(rank.micro_batch_tokens, reverse=True)
            assert all(micro == sorted(micro) for micro in rank.micro_batches)


# --- properties ---------------------------------------------------------------------------


@FAST
@given(problems())
def test_every_sample_exactly_once(problem: tuple[list[Sample], dict[str, int]]) -> None:
    samples, config = problem
    check_exactly_once(samples, schedule(samples, **config))


@FAST
@given(problems())
def test_rollouts_stay_in_one_mini_batch(problem: tuple[list[Sample], dict[str, int]]) -> None:
    samples, config = problem
    check_rollouts_whole(samples, schedule(samples, **config))


@FAST
@given(problems())
def test_as_many_mini_batches_as_asked_or_as_rollouts(
    problem: tuple[list[Sample], dict[str, int]],
) -> None:
    samples, config = problem
    check_mini_batch_count(samples, schedule(samples, **config), config["num_mini_batches"])


@FAST
@given(problems())
def test_balance_bound(problem: tuple[list[Sample], dict[str, int]]) -> None:
    samples, config = problem
    check_balance(samples, schedule(samples, **config))


@FAST
@given(problems(), st.sampled_from([1e-4, 1e-3, 0.05]))
def test_balance_bound_with_attention_cost(
    problem: tuple[list[Sample], dict[str, int]], alpha: float
) -> None:
    samples, config = problem
    cost = attention_cost(alpha)
    plan = schedule(samples, **config, cost=cost)
    check_balance(samples, plan, cost)
    for mini in plan.mini_batches:
        for rank in mini.ranks:
            assert rank.cost == pytest.approx(sum(cost(samples[i]) for i in rank.sample_indices))


@FAST
@given(problems())
def test_no_idle_rank_when_there_is_enough_work(
    problem: tuple[list[Sample], dict[str, int]],
) -> None:
    samples, config = problem
    check_ranks_used(samples, schedule(samples, **config))


@FAST
@given(problems())
def test_micro_batches_respect_the_cap(problem: tuple[list[Sample], dict[str, int]]) -> None:
    samples, config = problem
    check_cap(samples, schedule(samples, **config), config["max_tokens_per_micro_batch"])


@FAST
@given(problems())
def test_ranks_step_together(problem: tuple[list[Sample], dict[str, int]]) -> None:
    samples, config = problem
    check_lockstep(samples, schedule(samples, **config))


@FAST
@given(problems())
def test_bookkeeping_and_order(problem: tuple[list[Sample], dict[str, int]]) -> None:
    samples, config = problem
    check_bookkeeping(samples, schedule(samples, **config))


@FAST
@given(problems())
def test_deterministic(problem: tuple[list[Sample], dict[str, int]]) -> None:
    samples, config = problem
    fresh = [make_sample(s.rollout_id, len(s)) for s in samples]
    assert schedule(samples, **config) == schedule(fresh, **config)


_CHILD = """
import json, random
from types import SimpleNamespace
from agl.backends.training.schedule import schedule
rng = random.Random(7)
samples = [
    SimpleNamespace(rollout_id=f"rollout-{rng.randrange(60)}", tokens=[1] * rng.randint(1, 4000))
    for _ in range(150)
]
plan = schedule(samples, num_mini_batches=3, ranks=4, max_tokens_per_micro_batch=6000)
print(json.dumps([[r.micro_batches for r in m.ranks] for m in plan.mini_batches]))
"""


def test_deterministic_across_processes() -> None:
    """String hashing is salted per process: nothing may depend on set or hash order."""
    outputs = {
        subprocess.run(
            [sys.executable, "-c", _CHILD],
            env={"PYTHONHASHSEED": seed, "PATH": ""},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2")
    }
    assert len(outputs) == 1
    assert json.loads(outputs.pop())


# --- each check can fail ------------------------------------------------------------------


def _reference() -> tuple[list[Sample], Schedule]:
    lengths = [("a", 900), ("a", 100), ("b", 500), ("b", 500), ("c", 300), ("d", 700)]
    lengths += [("e", 3000), ("f", 50), ("f", 60), ("g", 400)]
    samples = [make_sample(rid, n) for rid, n in lengths]
    return samples, schedule(samples, num_mini_batches=2, ranks=2, max_tokens_per_micro_batch=1000)


def _with_rank(plan: Schedule, m: int, r: int, rank: RankBatch) -> Schedule:
    ranks = list(plan.mini_batches[m].ranks)
    ranks[r] = rank
    minis = list(plan.mini_batches)
    minis[m] = replace(minis[m], ranks=ranks)
    return replace(plan, mini_batches=minis)


def _moved(plan: Schedule, src: tuple[int, int], dst: tuple[int, int], index: int) -> Schedule:
    """Move sample ``index`` from (mini, rank) ``src`` to ``dst``, as its own micro-batch."""
    rank = plan.mini_batches[src[0]].ranks[src[1]]
    micros = [[i for i in micro if i != index] for micro in rank.micro_batches]
    plan = _with_rank(plan, *src, replace(rank, micro_batches=micros))
    rank = plan.mini_batches[dst[0]].ranks[dst[1]]
    return _with_rank(plan, *dst, replace(rank, micro_batches=[*rank.micro_batches, [index]]))


def test_reference_schedule_passes_every_check() -> None:
    samples, plan = _reference()
    for check in (
        check_exactly_once,
        check_rollouts_whole,
        check_balance,
        check_ranks_used,
        check_lockstep,
        check_bookkeeping,
    ):
        check(samples, plan)
    check_cap(samples, plan, 1000)
    check_mini_batch_count(samples, plan, 2)
    assert plan.oversize_samples == [6]


def test_checks_catch_broken_schedules() -> None:
    samples, plan = _reference()
    rank00 = plan.mini_batches[0].ranks[0]
    first = rank00.micro_batches[0][0]
    other_rollout_mini = 1
    # Repeated sample.
    doubled = _with_rank(
        plan, 0, 0, replace(rank00, micro_batches=[*rank00.micro_batches, [first]])
    )
    with pytest.raises(AssertionError):
        check_exactly_once(samples, doubled)
    # A sample of a rollout moved to the other mini-batch.
    split = _moved(plan, (0, 0), (other_rollout_mini, 0), first)
    with pytest.raises(AssertionError):
        check_rollouts_whole(samples, split)
    # A mini-batch too few, and one more than there are rollouts.
    with pytest.raises(AssertionError):
        check_mini_batch_count(samples, replace(plan, mini_batches=plan.mini_batches[:1]), 2)
    with pytest.raises(AssertionError):
        check_mini_batch_count(samples[:2], plan, 2)  # rollout "a" alone
    # All of a mini-batch's samples on one rank.
    mini = plan.mini_batches[0]
    lumped = _with_rank(
        _with_rank(plan, 0, 0, replace(mini.ranks[0], micro_batches=[[]])),
        0,
        1,
        replace(mini.ranks[1], micro_batches=[[i] for i in mini.sample_indices]),
    )
    with pytest.raises(AssertionError):
        check_balance(samples, lumped)
    with pytest.raises(AssertionError):
        check_ranks_used(samples, lumped)
    with pytest.raises(AssertionError):
        check_lockstep(samples, lumped)  # the ranks now step 1 and n times
    # Two samples over the cap together.
    merged = _with_rank(plan, 0, 0, replace(rank00, micro_batches=[sorted(rank00.sample_indices)]))
    if sum(len(samples[i]) for i in rank00.sample_indices) > 1000:
        with pytest.raises(AssertionError):
            check_cap(samples, merged, 1000)
    with pytest.raises(AssertionError):
        check_cap(samples, plan, 100_000)  # oversize_samples must then be empty
    # A needless empty micro-batch on every rank.
    padded = plan
    for r, rank in enumerate(plan.mini_batches[0].ranks):
        padded = _with_rank(padded, 0, r, replace(rank, micro_batches=[*rank.micro_batches, []]))
    with pytest.raises(AssertionError):
        check_lockstep(samples, padded)
    # Stale token counts.
    stale = _with_rank(plan, 0, 0, replace(rank00, tokens=rank00.tokens + 1))
    with pytest.raises(AssertionError):
        check_bookkeeping(samples, stale)


# --- the partitioner ----------------------------------------------------------------------


def sums(costs: list[float], parts: list[list[int]]) -> list[float]:
    return [sum(costs[i] for i in part) for part in parts]


def test_karmarkar_karp_textbook_case() -> None:
    """LDM on {4,5,6,7,8}: 8-7, 6-5, then 4-1-1 leaves a difference of 2 (16/14)."""
    costs = [4, 5, 6, 7, 8]
    assert sorted(sums(costs, karmarkar_karp(costs, 2))) == [14, 16]


def test_local_search_finds_the_perfect_split() -> None:
    costs = [4, 5, 6, 7, 8]
    parts = balanced_partition(costs, 2)
    assert sums(costs, parts) == [15, 15]
    assert sorted(map(sorted, parts)) == [[0, 1, 2], [3, 4]]


@pytest.mark.parametrize(
    ("costs", "k", "expected"),
    [
        ([1, 1, 1, 1, 1, 1], 3, [2, 2, 2]),
        ([100, 1, 1, 1], 2, [3, 100]),  # one item dominates: spread 97 <= 100
        ([3, 3, 2, 2, 2], 2, [6, 6]),  # greedy longest-first gets 7/5 here
        ([8, 7, 6, 5, 4, 3, 2, 1], 4, [9, 9, 9, 9]),
        ([5, 5, 4, 3, 3], 3, [5, 7, 8]),  # optimal: max 7 would leave 4+3+3 together
        ([2, 1], 4, [0, 0, 1, 2]),  # fewer items than parts
        ([], 3, [0, 0, 0]),
    ],
)
def test_balanced_partition_known_cases(costs: list[int], k: int, expected: list[int]) -> None:
    parts = balanced_partition(costs, k)
    assert len(parts) == k
    assert sorted(sums(costs, parts)) == expected


def test_partition_rejects_zero_parts() -> None:
    with pytest.raises(ValueError, match="k >= 1"):
        karmarkar_karp([1, 2], 0)


def test_zero_cost_items_never_leave_a_part_empty() -> None:
    costs = [0, 0, 0, 0, 9]
    parts = balanced_partition(costs, 3)
    assert all(parts) and sorted(i for p in parts for i in p) == list(range(5))


@FAST
@given(st.lists(st.integers(0, 10_000), max_size=60), st.integers(1, 9))
def test_partition_properties(costs: list[int], k: int) -> None:
    parts = balanced_partition(costs, k)
    assert sorted(i for part in parts for i in part) == list(range(len(costs)))
    assert all(part == sorted(part) for part in parts)
    totals = sums(costs, parts)
    assert max(totals) - min(totals) <= max(costs, default=0)
    if len(costs) >= k:
        assert all(parts)
    # The local search only ever lowers the max: never worse than plain KK.
    assert max(totals) <= max(sums(costs, karmarkar_karp(costs, k)))


@FAST
@given(st.lists(st.integers(1, 100), min_size=1, max_size=8), st.integers(2, 3))
def test_within_the_known_kk_ratio_of_optimal(costs: list[int], k: int) -> None:
    optimum = min(
        max(sums(costs, [[i for i, p in enumerate(labels) if p == j] for j in range(k)]))
        for labels in itertools.product(range(k), repeat=len(costs))
    )
    ours = max(sums(costs, balanced_partition(costs, k)))
    assert ours <= (4 / 3 - 1 / (3 * k)) * optimum + 1e-9


# --- packing ------------------------------------------------------------------------------


@FAST
@given(st.lists(st.integers(1, 4000), max_size=80), st.integers(1, 12_000))
def test_first_fit_decreasing(lengths: list[int], cap: int) -> None:
    bins = pack_micro_batches(lengths, cap)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in b) for b in bins]
    for b, load in zip(bins, loads, strict=True):
        assert load <= cap or len(b) == 1
    # First fit: any two bins hold more than the cap together.
    for a, b in itertools.combinations(loads, 2):
        assert a + b > cap


def test_oversize_samples_run_alone_and_are_reported() -> None:
    samples = [make_sample("a", 5000), make_sample("a", 10), make_sample("b", 20)]
    plan = schedule(samples, num_mini_batches=1, ranks=1, max_tokens_per_micro_batch=100)
    assert plan.oversize_samples == [0]
    assert plan.mini_batches[0].ranks[0].micro_batches == [[0], [1, 2]]


def test_splits_rather_than_pads() -> None:
    # One rank packs into 2 micro-batches, the other into 1: the second splits its
    # micro-batch in two (balanced) instead of running an empty pass.
    samples = [make_sample("a", 1000) for _ in range(3)] + [
        make_sample("b", 300) for _ in range(10)
    ]
    plan = schedule(samples, num_mini_batches=1, ranks=2, max_tokens_per_micro_batch=3000)
    mini = plan.mini_batches[0]
    packed = [
        len(pack_micro_batches([len(samples[i]) for i in rank.sample_indices], 3000))
        for rank in mini.ranks
    ]
    assert sorted(packed) == [1, 2]
    assert mini.num_micro_batches == 2
    assert all(micro for rank in mini.ranks for micro in rank.micro_batches)
    split = mini.ranks[packed.index(1)]
    assert split.micro_batch_tokens == [1600, 1300]  # 1000+300+300 | 1000+300


def test_pads_only_a_rank_with_too_few_samples() -> None:
    samples = [make_sample("a", 900), make_sample("b", 400), make_sample("b", 400)]
    samples += [make_sample("c", 100), make_sample("c", 100)]
    plan = schedule(samples, num_mini_batches=1, ranks=2, max_tokens_per_micro_batch=450)
    lone, other = sorted(plan.mini_batches[0].ranks, key=lambda rank: len(rank.sample_indices))
    assert lone.micro_batches == [[0], [], []]  # one sample, three passes: two are padding
    assert other.micro_batch_tokens == [400, 400, 200]
    assert plan.oversize_samples == [0]


def test_fewer_samples_than_ranks() -> None:
    samples = [make_sample("a", 10), make_sample("b", 20)]
    plan = schedule(samples, num_mini_batches=1, ranks=4, max_tokens_per_micro_batch=100)
    ranks = plan.mini_batches[0].ranks
    assert [len(rank.micro_batches) for rank in ranks] == [1, 1, 1, 1]
    assert sorted(rank.tokens for rank in ranks) == [0, 0, 10, 20]
    assert plan.mini_batches[0].imbalance == pytest.approx(20 / 7.5)


# --- validation ---------------------------------------------------------------------------


def _ok() -> dict[str, int]:
    return {"num_mini_batches": 1, "ranks": 2, "max_tokens_per_micro_batch": 100}


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"ranks": 0}, "ranks must be an integer >= 1, got 0"),
        ({"num_mini_batches": 0}, "num_mini_batches must be an integer >= 1"),
        ({"max_tokens_per_micro_batch": 0}, "max_tokens_per_micro_batch must be"),
        ({"max_tokens_per_micro_batch": 1.5}, "max_tokens_per_micro_batch must be"),
        ({"ranks": True}, "ranks must be"),
    ],
)
def test_bad_arguments(override: dict[str, object], message: str) -> None:
    samples = [make_sample("a", 10), make_sample("b", 10), make_sample("a", 5)]
    with pytest.raises(ValueError, match=message):
        schedule(samples, **{**_ok(), **override})  # type: ignore[arg-type]


def test_no_samples() -> None:
    with pytest.raises(ValueError, match="no samples to schedule"):
        schedule([], **_ok())


def test_fewer_rollouts_than_mini_batches_take_one_update_each() -> None:
    samples = [make_sample("a", 10), make_sample("b", 10), make_sample("a", 5)]
    plan = schedule(samples, **{**_ok(), "num_mini_batches": 4})
    assert [mini.rollout_ids for mini in plan.mini_batches] == [["a"], ["b"]]


def test_empty_sample() -> None:
    with pytest.raises(ValueError, match=r"sample 1 \(rollout 'b'\) has no tokens"):
        schedule([make_sample("a", 3), make_sample("b", 0)], **_ok())


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), "3"])
def test_bad_cost(bad: object) -> None:
    with pytest.raises(ValueError, match="cost of sample 0 must be a finite number >= 0"):
        schedule([make_sample("a", 3)], **_ok(), cost=lambda s: bad)  # type: ignore[arg-type, return-value]


def test_bad_alpha() -> None:
    with pytest.raises(ValueError, match="alpha"):
        attention_cost(-1.0)


def test_mini_batch_helpers() -> None:
    samples, plan = _reference()
    assert isinstance(plan.mini_batches[0], MiniBatch)
    assert plan.num_ranks == 2
    assert sum(mini.tokens for mini in plan.mini_batches) == sum(len(s) for s in samples)
    assert all(mini.imbalance >= 1.0 for mini in plan.mini_batches)
