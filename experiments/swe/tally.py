"""``python -m experiments.swe.tally ROLLOUTS.jsonl > tallies.json``: each task's rollouts
and how many solved it, for the pipeline's difficulty stage.

The k rollouts per task come from the real system: a run of the current policy that does
not learn (``backend.lr=0``), one group of k per task, each task once
(``experiments/swe/README.md``: the difficulty stage). ``python -m agl.rollouts export``
writes its rollouts as JSON lines; this counts, per ``instance_id`` of the rollout's
input, the rollouts whose current attempt ended with a reward, and of those the ones
rewarded 1 (the grader's resolved). A rollout that failed without a reward is not a
result: the stage removes a task with fewer than k.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from agl.core.user_error import UserError


def _reward(events: Sequence[dict[str, Any]], attempt: int) -> float | None:
    rewards = [e for e in events if e.get("type") == "reward" and e.get("attempt") == attempt]
    if not rewards:
        return None
    value = (rewards[-1].get("data") or {}).get("value")
    return float(value) if isinstance(value, int | float) else None


def tallies(lines: Iterable[str]) -> dict[str, list[int]]:
    """``{instance_id: [solved, rollouts]}`` from exported rollouts."""
    out: dict[str, list[int]] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            rollout, events = record["rollout"], record["events"]
            instance = rollout["input"]["instance_id"]
        except (ValueError, KeyError, TypeError):
            raise UserError(f"line {number}: not an exported rollout of a SWE task") from None
        reward = _reward(events, rollout.get("attempt", 1))
        if reward is None:
            continue
        tally = out.setdefault(instance, [0, 0])
        tally[0] += reward >= 1.0
        tally[1] += 1
    return dict(sorted(out.items()))


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        sys.stderr.write("usage: python -m experiments.swe.tally ROLLOUTS.jsonl\n")
        return 2
    try:
        with Path(args[0]).open() as lines:
            result = tallies(lines)
    except (OSError, UnicodeDecodeError) as error:
        sys.stderr.write(f"swe.tally: cannot read {args[0]}: {error}\n")
        return 2
    except UserError as error:
        sys.stderr.write(f"swe.tally: {args[0]}: {error}\n")
        return 2
    sys.stdout.write(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
