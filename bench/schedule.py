"""Scheduler benchmark: rank balance of agl's scheduler vs simple and known partitioners.

One synthetic training batch shaped like agentic RL: about 400 rollouts, 1,000 samples
(most rollouts give 1-3 samples, a few give many), heavy-tailed lengths (log-normal, a
per-rollout scale on top, clipped to 32k). Every method keeps rollouts whole across
mini-batches, then assigns samples to 8 ranks; read the ratios side by side:

- ours: ``agl.backends.training.schedule.schedule`` (KK + local search at both levels);
- KK only: ``karmarkar_karp`` at both levels, without the local search;
- greedy: longest first onto the least-loaded part, at both levels;
- naive: contiguous equal rollout counts per mini-batch, equal sample counts per rank;
- verl: ``verl.utils.seqlen_balancing.get_seqlen_balanced_partitions`` at both levels,
  when ``import verl`` works (it is not a dependency of agl).

    python -m bench.schedule
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from agl.backends.training.schedule import karmarkar_karp, pack_micro_batches, schedule

RANKS = 8
CAP = 16_384  # tokens per micro-batch; longer samples run alone
MAX_LEN = 32_768
MINI_BATCHES = (1, 4, 16)  # 16: ~60 samples per update, ~8 per rank, a harder case


@dataclass(frozen=True)
class BenchSample:
    rollout_id: str
    tokens: range  # only its length is read: a range costs no memory


def make_batch(seed: int, num_samples: int = 1000, num_rollouts: int = 400) -> list[BenchSample]:
    """Rollouts with geometric sample counts (mean 2.5), log-normal lengths, shuffled."""
    rng = random.Random(seed)
    mean_count = num_samples / num_rollouts
    samples: list[BenchSample] = []
    r = 0
    while len(samples) < num_samples:
        count = 1
        while rng.random() < 1 - 1 / mean_count:  # geometric: P(count = n) ~ (1 - 1/mean)^n
            count += 1
        scale = rng.lognormvariate(0, 0.5)  # long-horizon tasks have long samples throughout
        for _ in range(min(count, num_samples - len(samples))):
            length = round(scale * rng.lognormvariate(math.log(2000), 0.9))
            samples.append(BenchSample(f"rollout-{r}", range(min(max(length, 64), MAX_LEN))))
        r += 1
    rng.shuffle(samples)  # samples of a rollout need not be adjacent in the input
    return samples


# --- the methods: each maps (samples, mini-batches) -> [mini-batch][rank] -> indices ------

Plan = list[list[list[int]]]
Partition = Callable[[Sequence[int], int], list[list[int]]]


def _rollouts(samples: Sequence[BenchSample]) -> list[list[int]]:
    by_rollout: dict[str, list[int]] = {}
    for i, s in enumerate(samples):
        by_rollout.setdefault(s.rollout_id, []).append(i)
    return list(by_rollout.values())


def _two_level(samples: Sequence[BenchSample], minis: int, partition: Partition) -> Plan:
    """Partition rollouts into mini-batches, then each mini-batch's samples into ranks."""
    rollouts = _rollouts(samples)
    groups = partition([sum(len(samples[i].tokens) for i in r) for r in rollouts], minis)
    plan = []
    for group in groups:
        members = [i for g in group for i in rollouts[g]]
        parts = partition([len(samples[i].tokens) for i in members], RANKS)
        plan.append([[members[j] for j in part] for part in parts])
    return plan


def greedy_longest_first(costs: Sequence[int], k: int) -> list[list[int]]:
    parts: list[list[int]] = [[] for _ in range(k)]
    loads = [(0, j) for j in range(k)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, j = heapq.heappop(loads)
        parts[j].append(i)
        heapq.heappush(loads, (load + costs[i], j))
    return parts


def contiguous(costs: Sequence[int], k: int) -> list[list[int]]:
    """Equal item counts, in input order (what a plain DistributedSampler does)."""
    n = len(costs)
    return [list(range(j * n // k, (j + 1) * n // k)) for j in range(k)]


def ours(samples: Sequence[BenchSample], minis: int) -> Plan:
    plan = schedule(samples, num_mini_batches=minis, ranks=RANKS, max_tokens_per_micro_batch=CAP)
    return [[rank.sample_indices for rank in mini.ranks] for mini in plan.mini_batches]


def _verl_partition() -> Partition | None:
    try:
        from verl.utils.seqlen_balancing import get_seqlen_balanced_partitions
    except ImportError:
        return None
    return lambda costs, k: get_seqlen_balanced_partitions(list(costs), k, equal_size=False)


# --- measuring ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    method: str
    mini_imbalance: float  # max/mean tokens over mini-batches
    rank_imbalance: float  # max/mean tokens over ranks, worst mini-batch
    rank_spread: int  # max - min tokens over ranks, worst mini-batch
    micro_steps: int  # lockstep micro-batches per rank, summed over mini-batches
    ms_per_call: float


def measure(
    name: str, method: Callable[[], Plan], samples: Sequence[BenchSample], repeats: int
) -> Row:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        plan = method()
        times.append(time.perf_counter() - started)
    _check(plan, samples)
    lengths = [len(s.tokens) for s in samples]
    mini_tokens = [sum(lengths[i] for rank in mini for i in rank) for mini in plan]
    worst = 0.0
    spread = 0
    steps = 0
    for mini in plan:
        rank_tokens = [sum(lengths[i] for i in rank) for rank in mini]
        worst = max(worst, max(rank_tokens) / statistics.mean(rank_tokens))
        spread = max(spread, max(rank_tokens) - min(rank_tokens))
        # The same packer for every method, so this column compares the rank split only.
        steps += max(len(pack_micro_batches([lengths[i] for i in rank], CAP)) for rank in mini)
    return Row(
        name,
        max(mini_tokens) / statistics.mean(mini_tokens),
        worst,
        spread,
        steps,
        statistics.median(times) * 1000,
    )


def rank_lower_bound(plan: Plan, lengths: Sequence[int]) -> float:
    """No split of these mini-batches beats max(mean, longest sample) / mean, per mini-batch."""
    worst = 0.0
    for mini in plan:
        members = [lengths[i] for rank in mini for i in rank]
        mean = sum(members) / len(mini)
        worst = max(worst, max(mean, max(members)) / mean)
    return worst


def _check(plan: Plan, samples: Sequence[BenchSample]) -> None:
    seen = sorted(i for mini in plan for rank in mini for i in rank)
    if seen != list(range(len(samples))):
        raise AssertionError("a method lost or repeated a sample")
    for mini in plan:
        if len(mini) != RANKS:
            raise AssertionError("a method returned the wrong number of ranks")
    home = {samples[i].rollout_id: m for m, mini in enumerate(plan) for rank in mini for i in rank}
    for m, mini in enumerate(plan):
        if any(home[samples[i].rollout_id] != m for rank in mini for i in rank):
            raise AssertionError("a method split a rollout across mini-batches")


def _rollouts_cut_by_sample_count(samples: Sequence[BenchSample], minis: int) -> int:
    """Rollouts a contiguous split by sample count (ppo_mini_batch_size style) would cut."""
    n = len(samples)
    where: dict[str, set[int]] = {}
    for i, s in enumerate(samples):
        where.setdefault(s.rollout_id, set()).add(i * minis // n)
    return sum(1 for chunks in where.values() if len(chunks) > 1)


def report(seed: int = 0) -> str:
    samples = make_batch(seed)
    lengths = sorted(len(s.tokens) for s in samples)
    num_rollouts = len(_rollouts(samples))
    verl = _verl_partition()
    methods: list[tuple[str, Callable[[Sequence[BenchSample], int], Plan]]] = [
        ("ours (KK + local search)", ours),
        ("KK only", lambda s, m: _two_level(s, m, karmarkar_karp)),
        ("greedy longest-first", lambda s, m: _two_level(s, m, greedy_longest_first)),
        ("naive contiguous", lambda s, m: _two_level(s, m, contiguous)),
    ]
    if verl is not None:
        methods.append(("verl get_seqlen_balanced", lambda s, m: _two_level(s, m, verl)))
    lines = [
        f"scheduler benchmark (seed {seed}): {len(samples)} samples from {num_rollouts} "
        f"rollouts, {RANKS} ranks, micro-batch cap {CAP} tokens",
        f"sample tokens: median {lengths[len(lengths) // 2]}, mean "
        f"{statistics.mean(lengths):.0f}, p99 {lengths[len(lengths) * 99 // 100]}, max "
        f"{lengths[-1]}; {sum(n > CAP for n in lengths)} over the cap; every method keeps "
        "rollouts whole",
        "",
        f"{'mini-batches':>12}  {'method':<26} {'mini-batch':>10} {'rank':>8} {'rank':>8} "
        f"{'micro-steps':>11} {'ms/call':>8}",
        f"{'':>12}  {'':<26} {'max/mean':>10} {'max/mean':>8} {'max-min':>8} {'per rank':>11}",
    ]
    for minis in MINI_BATCHES:
        for name, method in methods:
            row = measure(name, lambda m=method, k=minis: m(samples, k), samples, repeats=5)
            lines.append(
                f"{minis:>12}  {row.method:<26} {row.mini_imbalance:>10.4f} "
                f"{row.rank_imbalance:>8.4f} {row.rank_spread:>8} {row.micro_steps:>11} "
                f"{row.ms_per_call:>8.1f}"
            )
        bound = rank_lower_bound(ours(samples, minis), [len(s.tokens) for s in samples])
        lines.append(f"{minis:>12}  {'(lower bound, our updates)':<26} {'':>10} {bound:>8.4f}")
        lines.append("")
    lines.append(
        "rank columns: the worst mini-batch, in tokens; target max/mean <= 1.05. micro-steps: "
        "lockstep micro-batches per rank, summed over the step (same packer for all). Lower "
        "bound: max(mean, longest sample) / mean; at 16 updates one sample outweighs a rank's "
        "mean share."
    )
    lines.append(
        "A contiguous split by sample count (ppo_mini_batch_size style) into 4 would cut "
        f"{_rollouts_cut_by_sample_count(samples, 4)} of {num_rollouts} rollouts across updates."
    )
    if verl is None:
        lines.append("verl: not importable here, so its rows are skipped.")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())
