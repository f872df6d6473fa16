"""The scheduler: samples → optimizer mini-batches → data-parallel ranks → micro-batches.

Pure Python (no torch), so it runs and is tested on any CPU. The result holds indices into
the caller's sample list, so the caller keeps its tensors and only gathers rows:
``schedule(...).mini_batches[m].ranks[r].micro_batches[k]`` is a ``list[int]``.

How a training step is cut (the paper's "Training Backend Complexity", eq. 17):

1. **Mini-batches.** A rollout's samples are one indivisible item (a rollout must be seen
   by one optimizer update, else its parts are scored under different policy versions).
   Rollouts are split into ``num_mini_batches`` groups of balanced workload, or into one
   per rollout when fewer rollouts made samples (a rollout its agent failed before its
   first model call enters the batch with no sample): a short step then takes fewer
   updates rather than stopping the run.
2. **Ranks.** Within a mini-batch, *samples* (not rollouts: any rank may take any sample,
   gradients are summed across ranks before the update) are split into ``ranks`` groups
   of balanced workload.
3. **Micro-batches.** Each rank's samples are packed (first-fit decreasing, on tokens)
   into micro-batches of at most ``max_tokens_per_micro_batch`` tokens. A sample longer
   than the cap cannot be cut, so it gets a micro-batch of its own, the only kind allowed
   over the cap; ``Schedule.oversize_samples`` lists them so the caller can warn.
4. **Lockstep.** DDP/FSDP ranks must run the same number of forward/backward passes per
   update, so every rank of a mini-batch gets the same number of micro-batches, ``K`` = the
   most any rank needed. A rank that packed into fewer is *rebalanced*: its heaviest
   micro-batch with two or more samples is split in two (balanced), until it has ``K``.
   This costs nothing (the ranks wait for the slowest anyway) and lowers peak memory.
   Only a rank with fewer than ``K`` samples is *padded* with empty micro-batches (an
   empty list); the caller must still run a pass there (e.g. one pad token with loss
   weight 0) so that the rank joins the collectives. Micro-batches are ordered heaviest
   first on every rank, so micro-step ``k`` pairs the k-th heaviest of every rank.

``group_id`` is not a constraint: advantages are computed over the whole batch before
scheduling, so a group may span mini-batches. Loss weights are computed per mini-batch,
over ``MiniBatch.sample_indices``, so that any cut into ranks and micro-batches is exact.

Workload ("cost") is a sample's token count by default; pass ``cost=attention_cost(alpha)``
(``tokens + alpha * tokens**2``) or any ``Callable[[sample], float]`` to model attention.
Cost balances mini-batches and ranks; the micro-batch cap is on tokens (memory).

The partitioner is Karmarkar-Karp's largest differencing method (k-way), followed by a
local search that moves or swaps one item between the heaviest and the lightest part
while that lowers the heavier of the two ("or better": on ``[4, 5, 6, 7, 8]`` into 2,
KK alone gives 16/14, the search then finds 15/15).

Invariants guaranteed by :func:`schedule` (asserted by
``tests/backends/training/test_schedule.py``):
  - every sample index appears in exactly one micro-batch of one rank of one mini-batch;
  - all samples of a rollout are in one mini-batch; every mini-batch has ≥ 1 rollout;
  - there are ``min(num_mini_batches, rollouts)`` mini-batches;
  - **balance bound**, for mini-batches (items = rollouts) and, within each mini-batch, for
    ranks (items = samples): ``max part cost - min part cost ≤ max item cost``, hence
    ``max part cost ≤ mean part cost + (1 - 1/k) · max item cost`` for ``k`` parts.
    (Proof: a KK merge of two states with spreads s₁, s₂ has spread ≤ max(s₁, s₂), and a
    single item's state has spread = its cost; each local-search step and each fill of an
    empty part never raises the max nor lowers the min.) Also, the local search only
    lowers the max, so the known KK worst-case ratio holds: ``max ≤ (4/3 - 1/(3k)) · OPT``
    (7/6 for k = 2; Fischetti & Martello 1987, Michiels et al. 2007);
  - every rank gets ≥ 1 sample when its mini-batch has ≥ ``ranks`` samples;
  - every micro-batch has ≤ ``max_tokens_per_micro_batch`` tokens, except a micro-batch
    holding exactly one sample that alone exceeds the cap;
  - within a mini-batch every rank has the same number ``K`` ≥ 1 of micro-batches, and
    rank ``r`` has exactly ``max(0, K - samples on r)`` empty ones;
  - deterministic: the same input gives the same schedule, in any process (nothing
    depends on hash order); indices inside a micro-batch are ascending.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol


class SchedulableSample(Protocol):
    """What the scheduler reads from a sample (``agl.core.contracts.samples.Sample`` has it)."""

    @property
    def rollout_id(self) -> str: ...

    @property
    def tokens(self) -> Sequence[int]: ...


CostFn = Callable[[SchedulableSample], float]


def token_cost(sample: SchedulableSample) -> float:
    """The default workload: one unit per token (linear layers dominate)."""
    return len(sample.tokens)


def attention_cost(alpha: float) -> CostFn:
    """Workload ``tokens + alpha * tokens**2``: the quadratic term models attention."""
    if not (math.isfinite(alpha) and alpha >= 0):
        raise ValueError(f"attention_cost needs a finite alpha >= 0, got {alpha}")

    def cost(sample: SchedulableSample) -> float:
        n = len(sample.tokens)
        return n + alpha * n * n

    return cost


@dataclass(frozen=True)
class RankBatch:
    """One data-parallel rank's share of a mini-batch.

    ``micro_batches[k]`` lists sample indices (ascending; empty = a padding pass).
    ``micro_batch_tokens[k]`` is its token count; ``tokens``/``cost`` are the rank's totals.
    """

    micro_batches: list[list[int]]
    micro_batch_tokens: list[int]
    tokens: int
    cost: float

    @property
    def sample_indices(self) -> list[int]:
        return sorted(i for micro in self.micro_batches for i in micro)


@dataclass(frozen=True)
class MiniBatch:
    """The samples of one optimizer update: whole rollouts, cut across ranks."""

    rollout_ids: list[str]  # in order of first appearance in the input
    ranks: list[RankBatch]

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per rank (the same on every rank)."""
        return len(self.ranks[0].micro_batches)

    @property
    def sample_indices(self) -> list[int]:
        """All samples of the update: what the loss strategy's weights are computed over."""
        return sorted(i for rank in self.ranks for i in rank.sample_indices)

    @property
    def tokens(self) -> int:
        return sum(rank.tokens for rank in self.ranks)

    @property
    def cost(self) -> float:
        return sum(rank.cost for rank in self.ranks)

    @property
    def imbalance(self) -> float:
        """Max rank cost / mean rank cost (1.0 = perfect); worth logging every step."""
        mean = self.cost / len(self.ranks)
        return max(rank.cost for rank in self.ranks) / mean if mean > 0 else 1.0


@dataclass(frozen=True)
class Schedule:
    mini_batches: list[MiniBatch]
    oversize_samples: list[int]  # longer than the micro-batch cap: each ran alone

    @property
    def num_ranks(self) -> int:
        return len(self.mini_batches[0].ranks)


# --- the partitioner ----------------------------------------------------------------------


def karmarkar_karp(costs: Sequence[float], k: int) -> list[list[int]]:
    """Split item indices into ``k`` parts of balanced cost sum (largest differencing).

    Each item starts as a k-tuple of parts (itself, then k-1 empty ones). Repeatedly the
    two tuples with the largest spread (max - min part sum) are merged, pairing the
    heaviest part of one with the lightest part of the other, which cancels their
    differences. Parts come back heaviest first; parts may be empty when len(costs) < k.
    """
    if k < 1:
        raise ValueError(f"need k >= 1 parts, got {k}")
    if k == 1:
        return [list(range(len(costs)))]
    if not costs:
        return [[] for _ in range(k)]
    # A heap entry: (-spread, -heaviest, tiebreak, sums, parts), parts heaviest first.
    # The tiebreak counter makes the pop order, hence the result, deterministic.
    heap: list[tuple[float, float, int, list[float], list[list[int]]]] = []
    order = sorted(range(len(costs)), key=lambda i: (costs[i], i))
    for tiebreak, i in enumerate(order):
        sums = [costs[i]] + [0.0] * (k - 1)
        parts: list[list[int]] = [[i]] + [[] for _ in range(k - 1)]
        heap.append((-costs[i], -costs[i], tiebreak, sums, parts))
    heapq.heapify(heap)
    tiebreak = len(order)
    while len(heap) > 1:
        _, _, _, sums_a, parts_a = heapq.heappop(heap)
        _, _, _, sums_b, parts_b = heapq.heappop(heap)
        merged = [
            (sums_a[j] + sums_b[k - 1 - j], _union(parts_a[j], parts_b[k - 1 - j]))
            for j in range(k)
        ]
        merged.sort(key=lambda entry: -entry[0])  # stable, so ties keep a fixed order
        sums = [s for s, _ in merged]
        heapq.heappush(heap, (sums[-1] - sums[0], -sums[0], tiebreak, sums, [p for _, p in merged]))
        tiebreak += 1
    return heap[0][4]


def _union(a: list[int], b: list[int]) -> list[int]:
    # Extend the longer list with the shorter: O(n log n) copying over the whole run.
    if len(a) < len(b):
        a, b = b, a
    a.extend(b)
    return a


def balanced_partition(costs: Sequence[float], k: int) -> list[list[int]]:
    """KK, then fill empty parts, then local search; each part's indices ascending.

    Guarantees ``max - min part sum ≤ max(costs)`` and, when ``len(costs) >= k``, no empty
    part. Parts come back in a deterministic order (not sorted by anything meaningful).
    """
    parts = karmarkar_karp(costs, k)
    _fill_empty_parts(costs, parts)
    _improve(costs, parts)
    return [sorted(part) for part in parts]


def _fill_empty_parts(costs: Sequence[float], parts: list[list[int]]) -> None:
    # With positive costs KK leaves no part empty when n >= k; zero costs can. An empty
    # rank would mean a wasted GPU, so give it the cheapest item of the most crowded part:
    # the max does not rise and the min (0) cannot fall, so the balance bound holds.
    for empty in [j for j, part in enumerate(parts) if not part]:
        donor = max(range(len(parts)), key=lambda j: (len(parts[j]), -j))
        if len(parts[donor]) < 2:
            return
        item = min(parts[donor], key=lambda i: (costs[i], -i))
        parts[donor].remove(item)
        parts[empty].append(item)


def _improve(costs: Sequence[float], parts: list[list[int]]) -> None:
    """Move or swap one item between the heaviest and lightest part while it helps.

    A transfer of t (a move: t = cost(x); a swap: t = cost(x) - cost(y)) with 0 < t < gap
    leaves both parts strictly inside (min, max), so the max never rises, the min never
    falls, and the loop ends. t nearest gap/2 is taken: it evens the pair out the most.
    """
    sums = [sum(costs[i] for i in part) for part in parts]
    for _ in range(4 * len(costs)):  # a safety net; it stops far earlier in practice
        heavy = max(range(len(parts)), key=lambda j: (sums[j], -j))
        light = min(range(len(parts)), key=lambda j: (sums[j], j))
        gap = sums[heavy] - sums[light]
        if gap <= 0:
            return
        best = _best_transfer(costs, parts[heavy], parts[light], gap)
        if best is None:
            return
        give, take, t = best
        parts[heavy].remove(give)
        parts[light].append(give)
        if take is not None:
            parts[light].remove(take)
            parts[heavy].append(take)
        sums[heavy] -= t
        sums[light] += t


def _best_transfer(
    costs: Sequence[float], heavy: list[int], light: list[int], gap: float
) -> tuple[int, int | None, float] | None:
    """The move (x, None) or swap (x, y) whose transfer t is nearest gap/2, 0 < t < gap."""
    best: tuple[int, int | None, float] | None = None
    best_miss = math.inf
    half = gap / 2
    light_sorted = sorted(light, key=lambda i: (costs[i], i))
    light_costs = [costs[i] for i in light_sorted]
    for x in sorted(heavy):
        cx = costs[x]
        if 0 < cx < gap and abs(cx - half) < best_miss:
            best, best_miss = (x, None, cx), abs(cx - half)
        # The partner y whose cost is nearest cx - gap/2: look at the two neighbours.
        at = bisect_left(light_costs, cx - half)
        for pos in (at - 1, at):
            if 0 <= pos < len(light_sorted):
                t = cx - light_costs[pos]
                if 0 < t < gap and abs(t - half) < best_miss:
                    best, best_miss = (x, light_sorted[pos], t), abs(t - half)
    return best


# --- micro-batches ------------------------------------------------------------------------


def pack_micro_batches(lengths: Sequence[int], cap: int) -> list[list[int]]:
    """First-fit decreasing: item indices into bins of at most ``cap`` tokens.

    An item longer than ``cap`` gets a bin of its own. Any two bins together hold more
    than ``cap`` tokens (else the later bin's first item would have fit the earlier one),
    so there are fewer than ``2 * sum(lengths) / cap + 1`` bins.
    """
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, load in enumerate(loads):
            if load + lengths[i] <= cap:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return bins


def _split_to_count(bins: list[list[int]], lengths: Sequence[int], count: int) -> None:
    # Split the heaviest splittable bin in two (balanced) until there are ``count``; the
    # halves are subsets of a bin within the cap, so they are within it too. Pad with
    # empty bins only when every bin already holds a single item.
    while len(bins) < count:
        splittable = [b for b in range(len(bins)) if len(bins[b]) >= 2]
        if not splittable:
            bins.extend([] for _ in range(count - len(bins)))
            return
        b = max(splittable, key=lambda b: (sum(lengths[i] for i in bins[b]), -b))
        items = bins[b]
        halves = balanced_partition([lengths[i] for i in items], 2)
        bins[b] = [items[j] for j in halves[0]]
        bins.append([items[j] for j in halves[1]])


# --- the schedule -------------------------------------------------------------------------


def schedule(
    samples: Sequence[SchedulableSample],
    *,
    num_mini_batches: int,
    ranks: int,
    max_tokens_per_micro_batch: int,
    cost: CostFn = token_cost,
) -> Schedule:
    """Cut ``samples`` into mini-batches, ranks and micro-batches (see the module doc)."""
    _check_positive_int("num_mini_batches", num_mini_batches)
    _check_positive_int("ranks", ranks)
    _check_positive_int("max_tokens_per_micro_batch", max_tokens_per_micro_batch)
    lengths = [len(s.tokens) for s in samples]
    for i, n in enumerate(lengths):
        if n == 0:
            raise ValueError(f"sample {i} (rollout {samples[i].rollout_id!r}) has no tokens")
    costs = [cost(s) for s in samples]
    for i, c in enumerate(costs):
        if not _is_finite_nonnegative(c):
            raise ValueError(f"cost of sample {i} must be a finite number >= 0, got {c!r}")

    # Rollouts in order of first appearance (a dict keeps insertion order, never hash order).
    by_rollout: dict[str, list[int]] = {}
    for i, s in enumerate(samples):
        by_rollout.setdefault(s.rollout_id, []).append(i)
    rollout_ids = list(by_rollout)
    if not rollout_ids:
        raise ValueError("no samples to schedule: a step with no sample has no update")

    rollout_costs = [sum(costs[i] for i in by_rollout[r]) for r in rollout_ids]
    groups = balanced_partition(rollout_costs, min(num_mini_batches, len(rollout_ids)))
    groups.sort(key=lambda group: group[0])  # present updates in input order
    mini_batches = []
    for group in groups:
        members = sorted(i for g in group for i in by_rollout[rollout_ids[g]])
        mini_batches.append(
            _mini_batch(
                [rollout_ids[g] for g in group],
                members,
                lengths,
                costs,
                ranks,
                max_tokens_per_micro_batch,
            )
        )
    oversize = [i for i, n in enumerate(lengths) if n > max_tokens_per_micro_batch]
    return Schedule(mini_batches=mini_batches, oversize_samples=oversize)


def _mini_batch(
    rollout_ids: list[str],
    members: list[int],
    lengths: Sequence[int],
    costs: Sequence[float],
    ranks: int,
    cap: int,
) -> MiniBatch:
    shares = [
        [members[j] for j in part]
        for part in balanced_partition([costs[i] for i in members], ranks)
    ]
    packed = []
    for share in shares:
        bins = pack_micro_batches([lengths[i] for i in share], cap)
        packed.append([[share[j] for j in b] for b in bins])
    count = max(len(bins) for bins in packed)
    rank_batches = []
    for share, bins in zip(shares, packed, strict=True):
        _split_to_count(bins, lengths, count)
        micro = sorted(
            (sorted(b) for b in bins),
            key=lambda b: (-sum(lengths[i] for i in b), b[0] if b else math.inf),
        )
        rank_batches.append(
            RankBatch(
                micro_batches=micro,
                micro_batch_tokens=[sum(lengths[i] for i in b) for b in micro],
                tokens=sum(lengths[i] for i in share),
                cost=sum(costs[i] for i in share),
            )
        )
    return MiniBatch(rollout_ids=rollout_ids, ranks=rank_batches)


def _check_positive_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def _is_finite_nonnegative(value: object) -> bool:
    try:
        return math.isfinite(value) and value >= 0  # type: ignore[arg-type, operator]
    except TypeError:
        return False
