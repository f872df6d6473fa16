"""The coding task's baselines, exact over a task file: what a policy earns that learns
nothing and never reads the code.

- **No edit**: 0 by construction (``make`` keeps a bug only when its ``FAIL_TO_PASS``
  tests fail on its branch), graded all the same, so that a grader that passed an
  untouched checkout would show here.
- **A fixed edit**: one kind of procedural change (``experiments.swe.mutations``, the
  changes bugs are made with) at the first site of a scope the problem statement names,
  then graded. The statement names failing tests (``make.statement``); from its first,
  ``toolz/tests/test_itertoolz.py::test_take``, the scope is the *module* its file is
  named after (``itertoolz.py``) or the *function* its name is (``take``). Several of the
  kinds undo themselves (a flipped comparison flipped again, ``True`` and ``False``
  swapped back, two arguments swapped back, an ``if``'s bodies swapped back), so where
  the bug is that kind at the scope's first site, this policy fixes it without reading
  a line. The best policy of the family is the baseline an agent must beat.

``python -m experiments.swe.baselines --tasks FILE --mirror DIR [--out FILE.json]``
prints each policy's reward over the tasks (the mean, and how many it fixed).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from agl.core.user_error import UserError
from experiments.swe import mirror
from experiments.swe.grader import grade_checkout, grading_row
from experiments.swe.instances import Instance, read_instances
from experiments.swe.mutations import KINDS, mutations
from experiments.swe.projects import Project

SCOPES = ("module", "function")
# a test id as make.statement lists it: - `path/test_file.py::[Class::]test_name[params]`
_TEST = re.compile(r"^- `([^`]+\.py)::(?:[^`:]+::)?([^`\[:]+)[^`]*`$", re.M)


@dataclass(frozen=True)
class Policy:
    """No edit (``kind`` None), or ``kind`` at the first site of ``scope``."""

    kind: str | None = None
    scope: str | None = None

    @property
    def name(self) -> str:
        return "no edit" if self.kind is None else f"{self.kind}, first in the {self.scope}"


def family() -> list[Policy]:
    """No edit, then every kind at the first site of each scope."""
    return [Policy(), *(Policy(kind, scope) for kind in KINDS for scope in SCOPES)]


def named_test(statement: str) -> tuple[str, str] | None:
    """The first failing test the statement names: its file and its function's name."""
    found = _TEST.search(statement)
    return (found.group(1), found.group(2)) if found else None


def scope_files(policy: Policy, project: Project, root: Path, test: tuple[str, str]) -> list[str]:
    """The source files the policy may edit: the module named after the test's file, or
    every source (the function is found by its name)."""
    sources = project.source_files(root)
    if policy.scope == "function":
        return sources
    stem = Path(test[0]).stem.removeprefix("test_")
    return [s for s in sources if Path(s).stem == stem]


def edited(policy: Policy, project: Project, root: Path, statement: str) -> tuple[str, str] | None:
    """The file the policy changes under ``root`` and its new text; None for no change."""
    test = named_test(statement)
    if policy.kind is None or test is None:
        return None
    function = test[1].removeprefix("test_")
    for path in scope_files(policy, project, root, test):
        source = (root / path).read_text(encoding="utf-8")
        for m in mutations(source, path, kinds=(policy.kind,)):
            if policy.scope == "module" or m.function.split(".")[-1] == function:
                return path, m.source
    return None


def reward(policy: Policy, instance: Instance, root: Path) -> float:
    """The grader's reward for the policy's checkout of ``instance``."""
    project = mirror.read_project(root, instance.repo)
    row = grading_row(instance, root)
    with tempfile.TemporaryDirectory(prefix="agl-swe-baseline-") as scratch:
        checkout = Path(scratch) / "repo"
        mirror.checkout(root, instance.repo, instance.instance_id, checkout)
        change = edited(policy, project, checkout, instance.problem_statement)
        if change is not None:
            (checkout / change[0]).write_text(change[1], encoding="utf-8")
        return grade_checkout(row, checkout, []).reward


def evaluate(
    instances: Sequence[Instance],
    root: Path,
    policies: Sequence[Policy],
    workers: int = 2,
    grade: Callable[[Policy, Instance, Path], float] = reward,
) -> dict[Policy, list[float]]:
    """Each policy's reward on each instance, in the instances' order."""
    jobs = [(p, i) for p in policies for i in instances]
    with ThreadPoolExecutor(workers) as pool:
        rewards = list(pool.map(lambda job: grade(job[0], job[1], root), jobs))
    n = len(instances)
    return {p: rewards[k * n : (k + 1) * n] for k, p in enumerate(policies)}


def table(results: dict[Policy, list[float]]) -> str:
    """A markdown table, the best fixed edit marked."""
    best = max((p for p in results if p.kind is not None), key=lambda p: _mean(results[p]))
    lines = ["| policy | reward | fixed |", "|---|---|---|"]
    for policy, rewards in results.items():
        mark = " (best fixed edit)" if policy == best else ""
        fixed = sum(r == 1.0 for r in rewards)
        lines.append(f"| {policy.name}{mark} | {_mean(rewards):.3f} | {fixed} of {len(rewards)} |")
    return "\n".join(lines) + "\n"


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.swe.baselines")
    parser.add_argument("--tasks", type=Path, required=True, help="a task file (jsonl, ...)")
    parser.add_argument("--mirror", type=Path, required=True, help="the pipeline's mirror")
    parser.add_argument("--out", type=Path, help="each policy's rewards, as json")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    try:
        instances = read_instances([args.tasks])
        if not instances:
            raise UserError(f"{args.tasks}: no tasks")
        held = mirror.branches(args.mirror)
        orphans = [i.instance_id for i in instances if i.branch not in held.get(i.repo, [])]
        if orphans:
            raise UserError(
                f"{len(orphans)} tasks have no branch in {args.mirror} (the pipeline's filter "
                f"removes them), {orphans[0]} first"
            )
        results = evaluate(instances, args.mirror.resolve(), family(), args.workers)
    except UserError as error:
        sys.stderr.write(f"experiments.swe.baselines: {error}\n")
        return 2
    sys.stdout.write(table(results))
    if args.out:
        ids = [i.instance_id for i in instances]
        data = {p.name: dict(zip(ids, r, strict=True)) for p, r in results.items()}
        args.out.write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
