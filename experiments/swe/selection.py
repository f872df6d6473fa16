"""The pipeline's choices after the static filters, as pure functions: the model-based
difficulty filter and the train/test split (paper, Section 4.3.1).

Difficulty: with ``k`` rollouts of the current policy per task (the paper: k = 4 with
Qwen3.5-9B), a task solved every time teaches nothing and is removed; one solved
sometimes is kept; of those never solved, a seeded sample is added back so the set is
not made too easy (the paper: ~5,000 mixed, 1,000 of the never-solved). Invariants:

- every kept task was rolled out ``k`` times; a task with fewer results is removed as
  such (never silently kept or dropped);
- the mixed tasks are all kept, the always-solved none;
- the never-solved kept are ``min(n, never_solved)`` of them, the same ones for the same
  seed whatever order the tasks came in.

Split: a seeded permutation of the instance ids; ``test`` instances (a count, or a
fraction of them when below 1) go to the test set, the rest to training, no instance in
both. Split by a group (``by_function``: the bug's project and function), whole groups go
to the test set in a seeded order until it holds ``test`` instances (the last group may
take it past), so no group is on both sides: validation asks about held-out functions.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from experiments.swe.filters import Removed
from experiments.swe.instances import Instance

ALWAYS_SOLVED = "always solved"
NEVER_SOLVED = "never solved, not sampled"
TOO_FEW_ROLLOUTS = "too few rollouts"


@dataclass(frozen=True)
class Tally:
    """One task's rollouts in the difficulty stage."""

    solved: int
    rollouts: int


def by_difficulty(
    instances: Sequence[Instance],
    tallies: Mapping[str, Tally],
    k: int,
    never_solved: int,
    seed: int,
) -> tuple[list[Instance], list[Removed], dict[str, int]]:
    """The tasks the difficulty filter keeps (in their order), those it removes, and how
    many were mixed, always solved, never solved and kept of the never solved."""
    if k < 1 or never_solved < 0:
        raise ValueError("k is at least 1 and never_solved at least 0")
    mixed: list[Instance] = []
    never: list[Instance] = []
    removed: list[Removed] = []
    always = 0
    for item in instances:
        tally = tallies.get(item.instance_id)
        if tally is None or tally.rollouts < k:
            got = 0 if tally is None else tally.rollouts
            removed.append(Removed(item.instance_id, f"{TOO_FEW_ROLLOUTS}: {got} of {k}"))
        elif tally.solved >= tally.rollouts:
            always += 1
            removed.append(
                Removed(item.instance_id, f"{ALWAYS_SOLVED}: {tally.solved}/{tally.rollouts}")
            )
        elif tally.solved == 0:
            never.append(item)
        else:
            mixed.append(item)
    ids = sorted(item.instance_id for item in never)
    chosen = set(random.Random(seed).sample(ids, min(never_solved, len(ids))))
    removed += [Removed(i.instance_id, NEVER_SOLVED) for i in never if i.instance_id not in chosen]
    keep = {item.instance_id for item in mixed} | chosen
    counts = {
        "mixed": len(mixed),
        "always_solved": always,
        "never_solved": len(never),
        "never_solved_kept": len(chosen),
    }
    return [i for i in instances if i.instance_id in keep], removed, counts


def by_function(item: Instance) -> str:
    """A bug's project and function (``extra.bug`` is ``kind:function:line``); a closure's
    bug is its enclosing function's."""
    function = str(item.extra.get("bug", "::")).split(":")[1].partition(".")[0]
    return f"{item.repo}:{function}"


def split(
    instances: Sequence[Instance],
    test: float,
    seed: int,
    group: Callable[[Instance], str] | None = None,
) -> tuple[list[Instance], list[Instance]]:
    """``(train, test)``: a seeded choice of ``test`` instances (a count, or a fraction
    when below 1), of whole groups when ``group`` is given, each set in the input's
    order."""
    if test < 0 or (test >= 1 and test != int(test)):
        raise ValueError("test is a fraction below 1 or a whole count")
    n = round(test * len(instances)) if test < 1 else int(test)
    if n > len(instances):
        raise ValueError(f"a test set of {n} from {len(instances)} instances")
    ids = sorted(item.instance_id for item in instances)
    if group is None:
        chosen = set(random.Random(seed).sample(ids, n))
    else:
        groups: dict[str, list[str]] = {}
        for item in sorted(instances, key=lambda i: i.instance_id):
            groups.setdefault(group(item), []).append(item.instance_id)
        chosen = set()
        for name in random.Random(seed).sample(sorted(groups), len(groups)):
            if len(chosen) >= n:
                break
            chosen.update(groups[name])
    train = [i for i in instances if i.instance_id not in chosen]
    held = [i for i in instances if i.instance_id in chosen]
    return train, held
