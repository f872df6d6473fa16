"""``python -m experiments.search.baselines``: what answering without searching scores on
the validation questions, exactly (no model). A no-search policy sees only the question,
so per question kind it can at best echo the name the question holds (a capital named
after its country) or give one fixed answer; the best of those, kind by kind, bounds
every policy that never searches, the tiny model's memory of training answers included
(validation asks only about held-out countries)."""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from experiments.search.answers import exact_match
from experiments.search.facts import val_inputs

# The two-hop form holds "capital of" too: it is tried first.
_NAMES = [
    re.compile(r"country where (.+) is\?$"),
    re.compile(r"city of (.+)\?$"),
    re.compile(r"capital of (.+)\?$"),
]


def echo(question: str) -> str:
    """The name a question asks about."""
    for pattern in _NAMES:
        if match := pattern.search(question):
            return match.group(1)
    return ""


def no_search_baselines(questions: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Mean exact match of ``echo``, of the best fixed answer per kind, and of the best of
    the two per kind (``best``)."""
    by_kind: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for q in questions:
        by_kind[q["kind"]].append(q)
    echo_hits = best_hits = fixed_hits = 0.0
    for qs in by_kind.values():
        echoed = sum(exact_match(echo(q["question"]), q["answers"]) for q in qs)
        answer = Counter(q["answers"][0] for q in qs).most_common(1)[0][0]
        fixed = sum(exact_match(answer, q["answers"]) for q in qs)
        echo_hits, fixed_hits = echo_hits + echoed, fixed_hits + fixed
        best_hits += max(echoed, fixed)
    n = len(questions)
    return {"echo": echo_hits / n, "fixed": fixed_hits / n, "best": best_hits / n}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.search.baselines")
    parser.add_argument(
        "--n", type=int, default=256, help="validation questions (trainer.val_size)"
    )
    parser.add_argument("--two-hop", type=float, default=0.0, help="weight of two-hop questions")
    args = parser.parse_args()
    kinds = {"capital": 1.0, "country": 1.0, "two_hop": args.two_hop}
    for name, value in no_search_baselines(val_inputs(args.n, kinds=kinds)).items():
        print(f"{name}: {value:.3f}")


if __name__ == "__main__":
    main()
