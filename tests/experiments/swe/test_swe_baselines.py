"""The coding task's baselines (``experiments/swe/baselines.py``): the no-edit policy and
the fixed edits that never read the code, applied as the statement names their scope and
graded by the real grader."""

from __future__ import annotations

from pathlib import Path

import pytest

from agl.sandbox.launch import unavailable
from experiments.swe import mirror
from experiments.swe.baselines import (
    Policy,
    edited,
    evaluate,
    family,
    main,
    named_test,
    table,
)
from experiments.swe.instances import Instance
from experiments.swe.mutations import mutations
from experiments.swe.projects import Project

PROJECT = Project(
    name="p",
    version="1",
    sources=("p/*.py",),
    tests=("p/tests",),
    pythonpath=(".",),
    test_files=("**/tests/**",),
    pytest_args=(),
)
BASE = (
    "def take(n, xs):\n"
    "    if n < 0:\n"
    "        return []\n"
    "    return xs[:n]\n"
    "\n\n"
    "def last(xs):\n"
    "    return xs[-1] if xs != [] else None\n"
)
BUGGED = BASE.replace("if n < 0", "if n >= 0")
STATEMENT = (
    "Since the last change to p, 2 of its tests fail:\n\n"
    "- `p/tests/test_core.py::TestTake::test_take[1-x]`\n- `p/tests/test_core.py::test_last`\n"
)


def _tree(tmp_path: Path) -> Path:
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "core.py").write_text(BUGGED)
    (tmp_path / "p" / "other.py").write_text("def take(n):\n    return n == 1\n")
    return tmp_path


def test_the_statement_names_its_first_failing_test() -> None:
    assert named_test(STATEMENT) == ("p/tests/test_core.py", "test_take")
    assert named_test("Make these tests pass.") is None


def test_a_self_undoing_edit_at_the_named_function_restores_the_code(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    assert edited(Policy("flip_comparison", "function"), PROJECT, root, STATEMENT) == (
        "p/core.py",
        BASE,
    )
    # the module named after the test file (core.py), its first comparison: the same site
    assert edited(Policy("flip_comparison", "module"), PROJECT, root, STATEMENT) == (
        "p/core.py",
        BASE,
    )
    # a kind with no site in scope, no statement, or no edit at all: nothing changes
    assert edited(Policy("invert_if", "function"), PROJECT, root, STATEMENT) is None
    assert edited(Policy("flip_comparison", "function"), PROJECT, root, "") is None
    assert edited(Policy(), PROJECT, root, STATEMENT) is None


def test_the_family_is_no_edit_and_every_kind_in_every_scope() -> None:
    policies = family()
    assert policies[0] == Policy() and len(set(policies)) == len(policies) == 1 + 6 * 2
    results = {Policy(): [0.0, 0.0], Policy("off_by_one", "module"): [1.0, 0.0]}
    assert "| off_by_one, first in the module (best fixed edit) | 0.500 | 1 of 2 |" in table(
        results
    )


def test_each_policys_rewards_come_back_in_the_tasks_order() -> None:
    tasks = [Instance("a", "r", ("t",), ("u",)), Instance("b", "r", ("t",), ("u",))]
    policies = [Policy(), Policy("flip_comparison", "module")]

    def grade(policy: Policy, instance: Instance, root: Path) -> float:
        return float(instance.instance_id == "b") + (policy.kind is not None)

    results = evaluate(tasks, Path("."), policies, grade=grade)
    assert results == {policies[0]: [0.0, 1.0], policies[1]: [1.0, 2.0]}


TESTS = (
    "from p.core import last, take\n\n\n"
    "def test_take():\n    assert take(2, [1, 2, 3]) == [1, 2]\n\n\n"
    "def test_last():\n    assert last([1, 2]) == 2\n"
)


@pytest.mark.skipif(unavailable() is not None, reason=f"no namespaces here: {unavailable()}")
def test_graded_no_edit_earns_0_and_an_edit_that_undoes_the_bug_earns_1(tmp_path: Path) -> None:
    root = tmp_path / "mirror"
    base = mirror.repo_folder(root, PROJECT.repo) / mirror.BASE
    (base / "p" / "tests").mkdir(parents=True)
    (base / "p" / "__init__.py").write_text("")
    (base / "p" / "core.py").write_text(BASE)
    (base / "p" / "tests" / "test_core.py").write_text(TESTS)
    mirror.write_project(root, PROJECT)
    bug = next(mutations(BASE, "p/core.py", kinds=("flip_comparison",)))
    mirror.add_branch(root, PROJECT.repo, "p.1.bug", bug.diff)
    task = Instance(
        "p.1.bug",
        PROJECT.repo,
        ("p/tests/test_core.py::test_take",),
        ("p/tests/test_core.py::test_last",),
        problem_statement="- `p/tests/test_core.py::test_take`\n",
    )
    policies = [
        Policy(),
        Policy("flip_comparison", "function"),  # undoes it: the bug's is take's first
        Policy("off_by_one", "function"),  # a change that leaves the bug in place
    ]
    assert evaluate([task], root, policies) == {
        policies[0]: [0.0],
        policies[1]: [1.0],
        policies[2]: [0.0],
    }


def test_a_task_without_its_branch_is_one_line(tmp_path: Path, capsys) -> None:
    root = tmp_path / "mirror"
    (mirror.repo_folder(root, PROJECT.repo) / mirror.BASE).mkdir(parents=True)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        '{"instance_id": "p.1.gone", "repo": "p.1", "FAIL_TO_PASS": ["t"], "PASS_TO_PASS": ["u"]}\n'
    )
    assert main(["--tasks", str(tasks), "--mirror", str(root)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "1 tasks have no branch" in err and "p.1.gone" in err
