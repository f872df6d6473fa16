"""``python -m experiments.swe.pipeline STAGE ...``: SWE-smith tasks to a training set, in
resumable stages (experiments/swe/README.md).

- ``filter --instances FILE... (--mirror DIR | --branches FILE) --out DIR``: the paper's
  static filters (empty problem statement, problem branch missing, more than
  ``--max-tests`` tests) into ``DIR/1-filter/``;
- ``difficulty --tallies FILE --out DIR``: the model-based filter over ``1-filter``'s
  instances, from each task's rollouts (``{"instance_id": [solved, rollouts]}``, as
  ``python -m experiments.swe.tally`` counts them from a run) into ``DIR/2-difficulty/``;
- ``split --out DIR``: a seeded train/test split of the last stage's instances into
  ``DIR/3-split/`` (``train.jsonl``, ``test.jsonl``).

Every stage writes ``instances.jsonl`` and ``report.json`` (what it removed and why) and
is skipped when run again on the same inputs and options; ``status --out DIR`` prints
one line a stage.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from agl.core.run.datasets import DatasetError
from agl.core.run.errors import UserError
from experiments.swe import filters, mirror, selection
from experiments.swe.instances import Instance, read_instances, write_instances
from experiments.swe.stages import INSTANCES, REPORT, Outcome, run_stage, summary_line

FILTER = "1-filter"
DIFFICULTY = "2-difficulty"
SPLIT = "3-split"
STAGES = (FILTER, DIFFICULTY, SPLIT)


def _progress(items: Sequence[Instance], what: str) -> Sequence[Instance]:
    return tqdm(items, desc=what, unit="task", disable=not sys.stderr.isatty(), leave=False)


def stage_filter(args: argparse.Namespace) -> list[Instance]:
    if (args.mirror is None) == (args.branches is None):
        raise UserError("give the branches with exactly one of --mirror and --branches")
    instances = read_instances(args.instances)
    held = mirror.branches(args.mirror) if args.mirror else mirror.branches_from_file(args.branches)
    checks = [
        filters.empty_statement,
        filters.missing_branch(held),
        filters.too_many_tests(args.max_tests),
    ]
    options = {"max_tests": args.max_tests, "branches": held}

    def work(items: Sequence[Instance]) -> Outcome:
        kept, removed = filters.apply(_progress(items, "filter"), checks)
        return Outcome(kept, removed)

    return run_stage(FILTER, args.out / FILTER, instances, options, work)


def _read_tallies(path: Path) -> dict[str, selection.Tally]:
    try:
        data = json.loads(path.read_text())
        return {k: selection.Tally(int(v[0]), int(v[1])) for k, v in data.items()}
    except (OSError, ValueError, TypeError, IndexError, AttributeError) as error:
        raise UserError(
            f'{path}: expected {{"instance_id": [solved, rollouts]}} ({error})'
        ) from None


def _previous(out: Path, stage: str) -> list[Instance]:
    folder = out / stage
    if not (folder / REPORT).is_file():
        raise UserError(f"run the {stage[2:]} stage first: {folder} has no report")
    return read_instances([folder / INSTANCES])


def stage_difficulty(args: argparse.Namespace) -> list[Instance]:
    tallies = _read_tallies(args.tallies)
    instances = _previous(args.out, FILTER)
    options = {
        "k": args.k,
        "never_solved": args.never_solved,
        "seed": args.seed,
        "tallies": {k: [t.solved, t.rollouts] for k, t in sorted(tallies.items())},
    }

    def work(items: Sequence[Instance]) -> Outcome:
        kept, removed, counts = selection.by_difficulty(
            items, tallies, args.k, args.never_solved, args.seed
        )
        return Outcome(kept, removed, counts)

    return run_stage(DIFFICULTY, args.out / DIFFICULTY, instances, options, work)


def stage_split(args: argparse.Namespace) -> list[Instance]:
    source = DIFFICULTY if (args.out / DIFFICULTY / REPORT).is_file() else FILTER
    instances = _previous(args.out, source)
    folder = args.out / SPLIT
    options = {"test": args.test, "seed": args.seed, "source": source}

    def work(items: Sequence[Instance]) -> Outcome:
        train, test = selection.split(items, args.test, args.seed)
        write_instances(folder / "train.jsonl", train)
        write_instances(folder / "test.jsonl", test)
        return Outcome(list(items), [], {"train": len(train), "test": len(test), "source": source})

    return run_stage(SPLIT, folder, instances, options, work)


def status(out: Path) -> list[str]:
    return [summary_line(out / s) for s in STAGES if (out / s / REPORT).is_file()] or [
        f"{out}: no stage has run"
    ]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m experiments.swe.pipeline", description=__doc__.split("\n")[0]
    )
    sub = p.add_subparsers(dest="stage", required=True)
    f = sub.add_parser("filter", help="the static filters")
    f.add_argument(
        "--instances", type=Path, nargs="+", required=True, help="jsonl, json or parquet"
    )
    f.add_argument("--mirror", type=Path, help="a local mirror (experiments/swe/mirror.py)")
    f.add_argument("--branches", type=Path, help='a JSON file {"repo": ["branch", ...]}')
    f.add_argument("--max-tests", type=int, default=200)
    d = sub.add_parser("difficulty", help="the model-based difficulty filter")
    d.add_argument("--tallies", type=Path, required=True)
    d.add_argument("-k", type=int, default=4, help="rollouts per task")
    d.add_argument("--never-solved", type=int, default=1000, help="never-solved tasks kept")
    s = sub.add_parser("split", help="a seeded train/test split")
    s.add_argument("--test", type=float, default=400, help="a count, or a fraction below 1")
    st = sub.add_parser("status", help="one line a finished stage")
    for q in (f, d, s, st):
        q.add_argument("--out", type=Path, required=True, help="the pipeline's folder")
    for q in (d, s):
        q.add_argument("--seed", type=int, default=0)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="swe.pipeline: %(message)s")
    stages = {"filter": stage_filter, "difficulty": stage_difficulty, "split": stage_split}
    try:
        if args.stage != "status":
            stages[args.stage](args)
        for line in status(args.out):
            sys.stdout.write(line + "\n")
    except (UserError, DatasetError, ValueError) as error:
        sys.stderr.write(f"swe.pipeline: {error}\n")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
