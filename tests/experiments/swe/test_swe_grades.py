"""An honest fix earns 1 on every project tasks are made from, the bug left in place 0:
the grader's read-only checkout, its planted tests and its jail change nothing an honest
agent relies on (issue 43). One task per project, made the pipeline's way."""

from __future__ import annotations

from pathlib import Path

import pytest

from agl.sandbox.launch import unavailable
from experiments.swe import mirror
from experiments.swe.docstrings import strip
from experiments.swe.grader import grade_checkout, grading_row
from experiments.swe.make import MakeOptions, make_project
from experiments.swe.projects import load_projects

SDISTS = Path("~/.cache/agl/sdists").expanduser()


@pytest.mark.slow
@pytest.mark.skipif(unavailable() is not None, reason=f"no namespaces here: {unavailable()}")
@pytest.mark.parametrize("name", sorted(load_projects()))
def test_an_honest_fix_earns_1_and_the_bug_0_on_every_project(tmp_path: Path, name: str) -> None:
    root = tmp_path / "mirror"
    # The pipeline's own timeout: none of these candidates loops (each run of a suite with
    # one of them takes ~1-2 s), and a run slowed by a busy machine (the other worker's
    # rollouts) past a tighter one would be taken for a loop and leave no task.
    options = MakeOptions(
        per_project=3, seed=0, timeout_s=20.0, empty_statements=0.0, missing_branches=0.0
    )
    project = load_projects()[name]
    made = make_project(project, root, SDISTS, options)
    assert made.instances, made.removed
    if project.strip_docstrings:  # the base the tasks are made on has none left
        base = mirror.repo_folder(root, project.repo) / mirror.BASE
        for source in project.source_files(base):
            assert strip((base / source).read_text()) == (base / source).read_text(), source
    instance = made.instances[0]
    row = grading_row(instance, root)
    fixed, bugged = tmp_path / "fixed", tmp_path / "bugged"
    mirror.checkout(root, instance.repo, instance.instance_id, fixed)
    mirror.apply_diff(fixed, instance.patch, reverse=True)  # the fix, written out
    mirror.checkout(root, instance.repo, instance.instance_id, bugged)
    honest = grade_checkout(row, fixed, [])
    assert honest.reward == 1.0, str({k: v for k, v in honest.details.items() if k != "diff"})
    assert "refused" not in honest.details
    left = grade_checkout(row, bugged, [])
    assert left.reward == 0.0 and "refused" not in left.details, left.details
