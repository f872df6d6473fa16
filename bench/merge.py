"""Merge benchmark: what each merge strategy makes of rollouts with each drift mechanism.

Traces come from the retokenization testbed (real byte-level BPE, a Qwen-like template,
a simulated harness). For every mechanism and strategy, one run prints:

- tokens/unique: training tokens computed per distinct token prefix (1.0 is ideal; an
  independent count, not the tree's own);
- samples/rollout and the share of rollouts kept as one sample;
- stitch's prompt changes: calls trained under a prompt they were not sampled under;
- why samples broke (response retokenized / history rewritten);
- seconds per 10k calls (dedup + merge).

Then the scheduler table (``bench/schedule.py``).

    python -m bench.merge                 # 150 rollouts per mechanism
    python -m bench.merge --rollouts 50
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

from agl.core.contracts.samples import BreakReason, ModelCall, Sample
from agl.strategies.dedup import dedup
from agl.strategies.merge_metrics import merge_metrics
from agl.strategies.merge_metrics import unique_tokens as distinct_prefixes
from agl.strategies.registry import get, names
from agl.testing.retok import load_tokenizer
from agl.testing.retok.traces import MECHANISMS, generate_traces
from bench import schedule as schedule_bench
from bench.tables import table

SETTINGS: list[tuple[str, frozenset[str]]] = [
    ("none", frozenset()),
    *((m, frozenset({m})) for m in sorted(MECHANISMS)),
    ("all", MECHANISMS),
]


def unique_tokens(calls: Sequence[ModelCall]) -> int:
    """Distinct token prefixes over a rollout's calls: the least any strategy must compute."""
    return distinct_prefixes([[*c.prompt_ids, *c.response_ids] for c in calls])


def run_setting(
    rollouts: list[list[ModelCall]], strategy: str, decode: object
) -> tuple[list[list[Sample]], float]:
    merge = get("merge", strategy)
    options = {"decode": decode} if strategy == "stitch" else {}
    started = time.perf_counter()
    out = [merge(dedup(calls), f"r{i}", "g", **options) for i, calls in enumerate(rollouts)]
    return out, time.perf_counter() - started


def report(n_rollouts: int, seed: int) -> str:
    decode = load_tokenizer().decode
    rows = []
    for label, mechanisms in SETTINGS:
        traces = generate_traces(seed, n_rollouts, mechanisms, turns_range=(6, 10))
        rollouts = [t.calls for t in traces]
        n_calls = sum(len(dedup(c)) for c in rollouts)
        unique = sum(unique_tokens(dedup(c)) for c in rollouts)
        for strategy in names("merge"):
            merged, seconds = run_setting(rollouts, strategy, decode)
            m = merge_metrics(merged, n_calls)
            computed = sum(len(s) for per_rollout in merged for s in per_rollout)
            retokenized = m[f"merge/breaks/{BreakReason.RESPONSE_RETOKENIZED}"]
            rewritten = m[f"merge/breaks/{BreakReason.HISTORY_REWRITTEN}"]
            breaks = retokenized + rewritten
            rows.append(
                [
                    label,
                    strategy,
                    f"{computed / unique:.3f}",
                    f"{m['merge/samples_per_rollout']:.2f}",
                    f"{m['merge/single_sample_rollouts']:.0%}",
                    f"{m['merge/stitched_calls']:.1%}" if strategy == "stitch" else "-",
                    f"{retokenized / breaks:.0%}" if breaks else "-",
                    f"{rewritten / breaks:.0%}" if breaks else "-",
                    f"{seconds / n_calls * 10_000:.2f}",
                ]
            )
    header = [
        "mechanism",
        "merge",
        "tokens/unique",
        "samples/rollout",
        "one sample",
        "stitch changed",
        "retokenized",
        "rewritten",
        "s/10k calls",
    ]
    return (
        f"Merge strategies on {n_rollouts} rollouts per mechanism (6-10 turns, seed {seed})\n"
        f"{table(header, rows)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rollouts", type=int, default=150)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(report(args.rollouts, args.seed))
    print()
    print(schedule_bench.report(args.seed))


if __name__ == "__main__":
    main()
