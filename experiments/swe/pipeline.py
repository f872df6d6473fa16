"""``python -m experiments.swe.pipeline STAGE ...``: SWE-smith tasks to a training set, in
resumable stages (experiments/swe/README.md).

- ``make --projects a,b,... --out DIR``: tasks made here from real projects
  (``experiments.swe.make``): the mirror in ``DIR/mirror/``, the records in
  ``DIR/0-make/``;
- ``filter [--instances FILE...] [--mirror DIR | --branches FILE] --out DIR``: the
  paper's static filters (empty problem statement, problem branch missing, more than
  ``--max-tests`` tests) into ``DIR/1-filter/``; by default over ``make``'s records and
  mirror;
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
import dataclasses
import json
import logging
import sys
import tarfile
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from agl.core.datasets import DatasetError
from agl.core.user_error import UserError
from experiments.swe import filters, mirror, selection
from experiments.swe.filters import Removed
from experiments.swe.instances import Instance, read_instances, write_instances
from experiments.swe.make import MakeOptions, make_project
from experiments.swe.projects import PROJECTS, load_projects
from experiments.swe.stages import INSTANCES, REPORT, Outcome, run_stage, summary_line

MAKE = "0-make"
MIRROR = "mirror"
FILTER = "1-filter"
DIFFICULTY = "2-difficulty"
SPLIT = "3-split"
SDISTS = Path("~/.cache/agl/sdists").expanduser()
STAGES = (MAKE, FILTER, DIFFICULTY, SPLIT)


def _progress(items: Sequence[Instance], what: str) -> Sequence[Instance]:
    return tqdm(items, desc=what, unit="task", disable=not sys.stderr.isatty(), leave=False)


def stage_make(args: argparse.Namespace) -> list[Instance]:
    known = load_projects(args.projects_file)
    names = [n for n in args.projects.split(",") if n]
    unknown = sorted(set(names) - set(known))
    if unknown or not names:
        raise UserError(f"no project {', '.join(unknown)}; known: {', '.join(known)}")
    options = MakeOptions(
        per_project=args.per_project, seed=args.seed, timeout_s=args.timeout, cpu=args.cpu
    )
    if args.cpu:  # a small set, kept whole: no records left without a statement or branch
        options = dataclasses.replace(options, empty_statements=0.0, missing_branches=0.0)
    root = args.out / MIRROR
    key = {"projects": [dataclasses.asdict(known[n]) for n in names], **dataclasses.asdict(options)}
    key.pop("workers")  # how many at once does not change what is made
    if not root.is_dir():  # a report without its mirror is not a finished stage
        (args.out / MAKE / REPORT).unlink(missing_ok=True)

    def work(_: Sequence[Instance]) -> Outcome:
        kept: list[Instance] = []
        removed: list[Removed] = []
        details: dict[str, object] = {}
        for name in names:
            result = make_project(known[name], root, args.sdists, options)
            kept += result.instances
            removed += result.removed
            details[known[name].repo] = result.details
        return Outcome(kept, removed, details)

    return run_stage(MAKE, args.out / MAKE, [], key, work)


def stage_filter(args: argparse.Namespace) -> list[Instance]:
    made = args.out / MAKE
    if args.instances is None and args.mirror is None and args.branches is None:
        if not (made / REPORT).is_file():
            raise UserError("give --instances and --mirror or --branches, or run make first")
        args.instances, args.mirror = [made / INSTANCES], args.out / MIRROR
    if args.instances is None:
        raise UserError("give the records to filter with --instances")
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
    options = {"test": args.test, "seed": args.seed, "source": source, "by": args.by}

    def work(items: Sequence[Instance]) -> Outcome:
        group = selection.by_function if args.by == "function" else None
        train, test = selection.split(items, args.test, args.seed, group)
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
    m = sub.add_parser("make", help="tasks from real projects, the SWE-smith way")
    m.add_argument("--projects", required=True, help="comma-separated names")
    m.add_argument("--projects-file", type=Path, default=PROJECTS)
    m.add_argument(
        "--per-project", type=int, default=100, help="candidate bugs tried (0: every one)"
    )
    m.add_argument(
        "--cpu", action="store_true", help="CPU-scale tasks only (experiments/swe/cpu.py)"
    )
    m.add_argument("--timeout", type=float, default=20.0, help="seconds a suite may run")
    m.add_argument("--sdists", type=Path, default=SDISTS, help="the source releases' cache")
    f = sub.add_parser("filter", help="the static filters")
    f.add_argument(
        "--instances", type=Path, nargs="+", help="jsonl, json or parquet (default: make's)"
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
    s.add_argument(
        "--by",
        choices=("instance", "function"),
        default="instance",
        help="function: a function's bugs all on one side (held-out functions)",
    )
    st = sub.add_parser("status", help="one line a finished stage")
    for q in (m, f, d, s, st):
        q.add_argument("--out", type=Path, required=True, help="the pipeline's folder")
    for q in (m, d, s):
        q.add_argument("--seed", type=int, default=0)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.out = args.out.resolve()  # the sandbox that runs the tests takes absolute paths
    logging.basicConfig(level=logging.INFO, format="swe.pipeline: %(message)s")
    stages = {
        "make": stage_make,
        "filter": stage_filter,
        "difficulty": stage_difficulty,
        "split": stage_split,
    }
    try:
        if args.stage != "status":
            stages[args.stage](args)
        for line in status(args.out):
            sys.stdout.write(line + "\n")
    except (UserError, DatasetError, ValueError) as error:
        sys.stderr.write(f"swe.pipeline: {error}\n")
        return 2
    except (OSError, tarfile.TarError) as error:  # a folder not writable, a broken sdist
        sys.stderr.write(f"swe.pipeline: {error}\n")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
