"""The CPU-scale coding tasks (experiments/swe/cpu.py): the command forms run for real
(bash, grep, sed, pytest), the rules a task must meet, the pipeline's ``--cpu`` and
``split --by function``, and the scripted paths on real tasks in the real jail."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from agl.sandbox.launch import unavailable
from experiments.swe import cpu, harness, mirror, pipeline, scripted, selection
from experiments.swe.instances import Instance, read_instances
from experiments.swe.invented import simulated_read
from experiments.swe.mutations import mutations
from experiments.swe.sandbox import ROOT
from experiments.swe.stages import INSTANCES
from tests.helpers import swe_tasks

MODULE = textwrap.dedent(
    """\
    import os


    def clamp(value, low, high):
        total = 0
        if value < low:
            return low
        if value >= high:
            return high
        for item in range(3):
            total = max(total, item)
        return value


    def is_hidden(name):
        if name == '.' or name == '..':
            return False
        return name.startswith('.')


    def joined(head, tail):
        return os.path.join(head, tail)
    """
)
TESTS = textwrap.dedent(
    """\
    from pkg.mod import clamp, is_hidden, joined


    def test_clamp():
        assert clamp(5, 0, 3) == 3
        assert clamp(-1, 0, 3) == 0
        assert clamp(2, 0, 3) == 2


    def test_is_hidden():
        assert is_hidden('.git') and not is_hidden('..') and not is_hidden('a')


    def test_joined():
        assert joined('a', 'b') == 'a/b'
    """
)


def _checkout(root: Path, module: str = MODULE) -> Path:
    (root / "pkg" / "tests").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "mod.py").write_text(module)
    (root / "pkg" / "tests" / "test_mod.py").write_text(TESTS)
    return root


def _bash(command: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    path = f"{Path(sys.executable).parent}:/usr/bin:/bin"
    return subprocess.run(
        ["bash", "-c", command], cwd=cwd, capture_output=True, text=True, env={"PATH": path}
    )


def test_the_read_shows_the_file_then_the_sites_after_the_def(tmp_path: Path) -> None:
    checkout = _checkout(tmp_path)
    output = cpu.run_read(checkout, "clamp")
    # the window runs into the next function: its sites are decoys, as in real code; the
    # def's own parameters, assignments and a for clause's " in " are no sites; a site
    # shows once (" == " twice in is_hidden), so the n-th line is the n-th candidate edit
    assert output == "./pkg/mod.py\n < \n >= \n max(total, item\n == \n"
    assert cpu.parse_shown(output) == [
        cpu.Shown("pkg/mod.py", s) for s in (" < ", " >= ", " max(total, item", " == ")
    ]
    assert (checkout / cpu.SITES_FILE).read_text() == output  # for a failed try to print
    assert len(cpu.tries("clamp", cpu.parse_shown(output))) == 4
    # what simulates it (the warm-up's shell, the probe) prints the same
    assert simulated_read("pkg/mod.py", MODULE, "clamp") == output
    joined = cpu.run_read(checkout, "joined")
    assert (
        joined
        == simulated_read("pkg/mod.py", MODULE, "joined")
        == "./pkg/mod.py\n.join(head, tail\n"
    )
    assert cpu.parse_shown(cpu.run_read(checkout, "absent")) == []


def test_the_candidate_edits_follow_the_sites_and_skip_what_sed_would_misplace() -> None:
    def edits(*sites: str) -> list[tuple[str, str]]:
        return [
            (f.pattern, f.replacement)
            for f in cpu.tries("f", [cpu.Shown("m.py", s) for s in sites])
        ]

    swap = cpu.fixes_for("swap_arguments", "f(a, b)")[0][0].removeprefix("f(")
    assert edits(" not in ") == [(" not in ", " in ")]
    assert edits(" is not ") == [(" is not ", " is ")]
    assert edits("return False") == [("return False", "return True")]
    # the mark before the call's name kept, as the read shows it
    assert edits(" f(a, b.c") == [(f" f({swap}", " f(\\2, \\1")]
    assert edits(".get(a, b") == [(f".get({swap}", ".get(\\2, \\1")]
    assert edits(" < ", " == ") == [(" < ", " >= "), (" == ", " != ")]
    # the same site later is the earlier one's edit: listed once
    assert edits(" < ", " < ") == [(" < ", " >= ")]
    # on a whole line (the canonical fix's), a for clause's in is no comparison, and an
    # in that sed would find after a for clause's is none either
    assert cpu.fixes_for("flip_comparison", "    for x in seq:") == []
    assert cpu.fixes_for("flip_comparison", "    return [x for x in s if x in t]") == []


def test_every_canonical_fix_gives_back_the_base_with_the_real_sed(tmp_path: Path) -> None:
    found = 0
    for m in mutations(MODULE, "pkg/mod.py", cpu.KINDS):
        fix = cpu.canonical_fix(m, MODULE)
        if fix is None:
            continue
        checkout = tmp_path / f"c{found}"
        _checkout(checkout, m.source)
        cpu.run_sed(checkout, fix)
        assert (checkout / "pkg" / "mod.py").read_text() == MODULE, (m.label, fix)
        found += 1
    assert found >= 5


def _fix(kind: str, text: str, function: str = "clamp") -> cpu.Fix:
    pattern, replacement = cpu.fixes_for(kind, text)[0]
    return cpu.Fix("pkg/mod.py", function, pattern, replacement)


def test_an_edit_changes_the_first_line_after_the_def_with_its_site(tmp_path: Path) -> None:
    checkout = _checkout(tmp_path)
    flip = _fix("flip_comparison", "if value < low:")
    assert _bash(cpu.edit_command(flip), checkout).returncode == 0
    edited = MODULE.replace("if value < low:", "if value >= low:")
    assert (checkout / "pkg" / "mod.py").read_text() == edited == cpu.apply(flip, MODULE)
    swap = _fix("swap_arguments", "os.path.join(head, tail)", "joined")
    assert _bash(cpu.edit_command(swap), checkout).returncode == 0
    swapped = edited.replace("join(head, tail)", "join(tail, head)")
    assert (checkout / "pkg" / "mod.py").read_text() == swapped == cpu.apply(swap, edited)
    # what reads the commands back (the simulated shell, the probe) reads these
    assert [cpu.parse_edit(cpu.edit_command(f)) for f in (flip, swap)] == [flip, swap]
    assert cpu.parse_edit(cpu.submit_command(flip)) is None  # a whole edit command only


def test_a_try_submits_a_passing_edit_and_undoes_a_failing_one(tmp_path: Path) -> None:
    bugged = MODULE.replace("return False", "return True")
    checkout = _checkout(tmp_path, bugged)
    test = "pkg/tests/test_mod.py::test_is_hidden"
    read = _bash(cpu.read_command("is_hidden"), checkout).stdout
    # the next def's parameters look like a call: a decoy, as in real code
    assert read == "./pkg/mod.py\n == \nreturn True\n joined(head, tail\n.join(head, tail\n"
    first, second = cpu.tries("is_hidden", cpu.parse_shown(read))[:2]
    done = _bash(cpu.try_command(first, test), checkout)
    # the read again less the site tried: the next candidate is the first one shown
    left = "./pkg/mod.py\nreturn True\n joined(head, tail\n.join(head, tail\n"
    assert (done.returncode, done.stdout) == (0, left)
    assert cpu.tries("is_hidden", cpu.parse_shown(done.stdout))[0] == second
    assert (checkout / "pkg" / "mod.py").read_text() == bugged  # put back
    assert not (checkout / "pkg" / f"mod.py{cpu.BACKUP}").exists()
    done = _bash(cpu.try_command(second, test), checkout)
    assert (done.returncode, done.stdout) == (0, f"{cpu.SUBMIT}\n")
    assert (checkout / "pkg" / "mod.py").read_text() == MODULE  # kept
    # the backup and the kept read stay beside it: the grader reads source files only
    assert (checkout / "pkg" / f"mod.py{cpu.BACKUP}").read_text() == bugged
    wrong = _fix("swap_arguments", "total = max(total, item)")
    untested = _bash(cpu.submit_command(wrong), _checkout(tmp_path / "b", bugged))
    assert untested.stdout == f"{cpu.SUBMIT}\n"


def test_a_bug_qualifies_only_when_read_and_fix_work(tmp_path: Path) -> None:
    base = _checkout(tmp_path)
    tests = ["pkg/tests/test_mod.py::test_clamp", "pkg/tests/test_mod.py::test_is_hidden"]
    by_label = {m.label: m for m in mutations(MODULE, "pkg/mod.py", cpu.KINDS)}
    flip = by_label["flip_comparison:clamp:6"]
    found = cpu.readable(flip, base, tests)
    assert isinstance(found, cpu.Readable)
    assert found.fix == _fix("flip_comparison", "if value >= low:")
    # line 8's " < " is after line 6's: the edit of the form would change line 6
    later = cpu.readable(by_label["flip_comparison:clamp:8"], base, tests)
    assert later == "no one-line edit of the forms undoes it"
    hidden = cpu.readable(by_label["change_return:is_hidden:17"], base, tests)
    assert isinstance(hidden, cpu.Readable)  # the second candidate edit of its read
    assert cpu.tries("is_hidden", hidden.shown).index(hidden.fix) == 1
    swap = by_label["swap_arguments:joined:22"]
    assert cpu.readable(swap, base, tests) == "no test named test_joined"
    assert not cpu.one_edit_a_site(
        "f", [cpu.Shown("m.py", s) for s in (".islice(n, seq", " == ", ".islice(seq, 0")]
    )
    with_test = [*tests, "pkg/tests/test_mod.py::test_joined[a-b]"]  # parameters or not
    assert cpu.readable(swap, base, with_test) == "the read shows 1 sites"
    other = next(m for m in mutations(MODULE, "pkg/mod.py", ("off_by_one",)))
    assert cpu.readable(other, base, tests) == "kind off_by_one is not read off a line"


def _instance(iid: str, bug: str, repo: str = "r") -> Instance:
    return Instance(iid, repo, ("t::a",), ("t::b",), extra={"bug": bug})


def test_a_relative_mirror_is_under_agl_and_the_config_one_of_minis() -> None:
    assert harness.mirror_root({"mirror": "data/x/mirror"}) == ROOT / "data/x/mirror"
    assert harness.mirror_root({"mirror": "/abs/mirror"}) == Path("/abs/mirror")
    assert harness.config_file({}).name == "mini.yaml"
    assert harness.config_file({"config": "mini_cpu.yaml"}).name == "mini_cpu.yaml"
    with pytest.raises(ValueError, match=r"mini_cpu\.yaml"):
        harness.config_file({"config": "../../etc/passwd"})


def test_a_split_by_function_holds_out_whole_functions() -> None:
    items = [
        _instance(f"i{k}", f"flip_comparison:{f}:{k}")
        for k, f in enumerate("aabbbcdddeffg" + "h" * 5)
    ]
    items.append(_instance("j", "flip_comparison:a.inner:3"))  # a closure is its function's
    for seed in range(20):
        train, test = selection.split(items, 6, seed, selection.by_function)
        held = {selection.by_function(i) for i in test}
        assert not held & {selection.by_function(i) for i in train}
        assert len(test) >= 6 and len(train) + len(test) == len(items)


# --------------------------------------------------------------------------- on toolz


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return swe_tasks.toolz_cpu_made(tmp_path_factory)


def test_make_cpu_keeps_whole_records_each_fixed_by_its_sed(made: Path, tmp_path: Path) -> None:
    tasks = read_instances([made / pipeline.MAKE / INSTANCES])
    assert tasks
    root = made / pipeline.MIRROR
    for task in tasks:
        function = str(task.extra["bug"]).split(":")[1].partition(".")[0]
        assert task.problem_statement  # the CPU set has no statement left out
        assert cpu.test_function(task.FAIL_TO_PASS[0]).endswith(f"::test_{function}")
        checkout = tmp_path / task.instance_id
        mirror.checkout(root, task.repo, task.instance_id, checkout)
        path = task.patch.split(" b/", 1)[1].split("\n", 1)[0]
        assert cpu.parse_edit(str(task.extra["fix"])) is not None
        subprocess.run(["bash", "-c", str(task.extra["fix"])], cwd=checkout, check=True)
        base = mirror.repo_folder(root, task.repo) / mirror.BASE / path
        assert (checkout / path).read_text() == base.read_text()
    report = json.loads((made / pipeline.MAKE / "report.json").read_text())
    assert report["options"]["cpu"] is True


@pytest.mark.skipif(unavailable() is not None, reason=f"no namespaces here: {unavailable()}")
def test_the_scripted_paths_in_the_real_jail(made: Path) -> None:
    tasks = read_instances([made / pipeline.MAKE / INSTANCES])[:3]
    results = scripted.evaluate(tasks, (made / pipeline.MIRROR).resolve())
    tested, untested = results[scripted.PATHS[0]], results[scripted.PATHS[1]]
    assert [r["reward"] for r in tested] == [1.0] * len(tasks)
    assert all(r["read_matches_simulation"] for r in tested + untested)
    assert all(r["tries_follow_the_read"] for r in tested)
    assert all(r["submitted"] for r in tested)
    assert all(r["commands"] == 2 for r in untested)
