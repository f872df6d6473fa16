"""Tasks made here the SWE-smith way: procedural bugs in real projects, kept when the
project's own tests catch them.

For each project (``conf/swe/projects.yaml``): its release is unpacked as the mirror's
base; its whole suite runs there in ``REFERENCE_RUNS`` interpreters started apart (a
test that fails without any bug is never a task's test, nor any test of a function
whose tests are not named alike in each: a function parametrized over a set of objects
hashed by address, as isodate's are, names its tests after their places in the set,
which move from one process to the next, so the grader's run would not find them); a
seeded sample of candidate bugs (``experiments.swe.mutations``) is each written into a
scratch copy and the suite run again with a timeout (some bugs loop). Every run is in
the jail the grader's are in (``jailed_tests``), so a test that needs more than pytest
(an installed package it imports if it can) is not a task's test either:

- ``FAIL_TO_PASS``: the tests that passed on the base and do not with the bug;
- ``PASS_TO_PASS``: those that pass with and without it;
- a candidate is kept when both are non-empty and the run finished in time, as
  SWE-smith's validation keeps a bug (removed otherwise, the reason recorded).

A kept bug becomes a branch of the mirror (its diff) and a record in SWE-smith's format,
with a problem statement written from what fails: which tests, and the first line of
the first failure's message, never the function or the change. A seeded share of the
records is left without a statement, and another without its branch, as the published
data has them: the pipeline's filters must find them.
"""

from __future__ import annotations

import hashlib
import logging
import random
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from queue import Queue

from tqdm import tqdm

from agl.core.user_error import UserError
from agl.sandbox.uids import lease
from experiments.swe import cpu, mirror
from experiments.swe.docstrings import strip_files
from experiments.swe.filters import Removed
from experiments.swe.instances import Instance
from experiments.swe.mutations import KINDS, Mutation, mutations
from experiments.swe.projects import Project, fetch_sdist, unpack
from experiments.swe.sandbox import check_available, tool_jail
from experiments.swe.testrun import PytestServer, SuiteRun

log = logging.getLogger(__name__)

TIMED_OUT = "timed out"
NOTHING_FAILS = "no test fails"
NOTHING_PASSES = "no test still passes"
REFERENCE_RUNS = 3  # interpreters the base's suite runs in, to keep only stable test ids


@dataclass(frozen=True)
class MakeOptions:
    per_project: int = 100  # candidates tried per project
    seed: int = 0
    timeout_s: float = 20.0  # one suite run with a bug in it
    empty_statements: float = 0.15  # share of records left without a statement
    missing_branches: float = 0.05  # share of records whose branch the mirror lacks
    workers: int = 2
    # the CPU-scale tasks (experiments.swe.cpu): only candidates a small model can read
    # off a few lines and fix with one sed, whose first failing test names the function
    cpu: bool = False


def statement(project: Project, run: SuiteRun, fail_to_pass: Sequence[str]) -> str:
    """A problem statement from what the bug breaks: the failing tests and the first
    failure's message."""
    shown = fail_to_pass[:3]
    message = next((run.messages[t] for t in shown if run.messages.get(t)), "")
    return statement_text(project.name, fail_to_pass, message)


def statement_text(name: str, fail_to_pass: Sequence[str], message: str) -> str:
    """``statement``'s text for project ``name``, its failing tests and the first
    failure's message ("": none)."""
    shown = list(fail_to_pass[:3])
    more = len(fail_to_pass) - len(shown)
    lines = [
        f"Since the last change to {name}, {len(fail_to_pass)} of its tests fail:",
        "",
        *(f"- `{t}`" for t in shown),
    ]
    if more:
        lines.append(f"- and {more} more")
    if message:
        lines += ["", "The first one stops with:", "", "```", message, "```"]
    lines += ["", "Make these tests pass again without breaking the others."]
    return "\n".join(lines) + "\n"


def instance_id(project: Project, mutation: Mutation) -> str:
    """SWE-smith's shape: ``<repo>.<kind>__<hash>``."""
    digest = hashlib.sha1(mutation.diff.encode()).hexdigest()[:8]
    return f"{project.repo}.{mutation.kind}__{digest}"


def candidates(
    project: Project,
    base: Path,
    count: int,
    seed: int,
    keep: Callable[[Mutation], bool] | None = None,
    kinds: tuple[str, ...] = KINDS,
) -> list[Mutation]:
    """A seeded sample of ``count`` candidate bugs (0: all of them) of ``kinds`` over the
    project's source modules, of those ``keep`` keeps."""
    found = [
        m
        for path in project.source_files(base)
        for m in mutations((base / path).read_text(encoding="utf-8"), path, kinds)
        if keep is None or keep(m)
    ]
    rng = random.Random(f"{project.repo}:{seed}")
    return rng.sample(found, min(count or len(found), len(found)))


def cpu_reason(mutation: Mutation, fail_to_pass: Sequence[str]) -> str | None:
    """Why a validated CPU-scale bug is not a task: its first failing test is not the
    function's own (the statement lists it first; it is what the agent runs)."""
    first = cpu.test_function(fail_to_pass[0]).rpartition("::")[2]
    function = mutation.function.partition(".")[0]
    return None if first == f"test_{function}" else f"cpu: the first failing test is {first}"


@contextmanager
def jailed_tests(repo: Path) -> Iterator[PytestServer]:
    """A warm pytest for ``repo`` in the jail the grader runs the tests in (read-only, a
    Python with pytest alone, a uid of its own): a test that needs more than the task's
    tests get there (a plugin, an installed package) is never a task's test."""
    check_available()
    jail = tool_jail(repo, env={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}, writable=False)
    with lease() as uid, PytestServer(jail, uid) as server:
        yield server


@contextmanager
def _slots(base: Path, workers: int) -> Iterator[Queue[tuple[Path, PytestServer]]]:
    """Scratch copies of the base, each with a warm pytest of its own."""
    slots: Queue[tuple[Path, PytestServer]] = Queue()
    with tempfile.TemporaryDirectory(prefix="agl-swe-make-") as scratch, ExitStack() as held:
        for i in range(workers):
            copy = Path(scratch) / f"w{i}" / "repo"
            shutil.copytree(base, copy)
            slots.put((copy, held.enter_context(jailed_tests(copy))))
        yield slots


def _try(
    project: Project,
    mutation: Mutation,
    slots: Queue[tuple[Path, PytestServer]],
    timeout: float,
) -> SuiteRun:
    copy, server = slots.get()
    target = copy / mutation.path
    original = target.read_bytes()
    try:
        target.write_text(mutation.source, encoding="utf-8")
        return server.run(copy, project.pytest_arguments(), project.pythonpath, timeout)
    finally:
        target.write_bytes(original)
        slots.put((copy, server))


def stable_passing(runs: Sequence[Mapping[str, str]]) -> tuple[list[str], int]:
    """The tests that passed in every run, less every test of a function whose tests were
    not named alike in each; and how many passing tests that leaves out."""
    named: list[dict[str, frozenset[str]]] = []
    for run in runs:
        tests: dict[str, set[str]] = {}
        for test in run:
            tests.setdefault(_function(test), set()).add(test)
        named.append({f: frozenset(ts) for f, ts in tests.items()})
    functions = set().union(*named)
    unsteady = {f for f in functions if len({n.get(f, frozenset()) for n in named}) > 1}
    passed = [{t for t, o in run.items() if o == "passed"} for run in runs]
    kept = sorted(t for t in set.intersection(*passed) if _function(t) not in unsteady)
    return kept, len(set.union(*passed)) - len(kept)


def _function(test: str) -> str:
    """A test's function: its node id less its parameters."""
    return test.partition("[")[0]


def _references(
    project: Project, base: Path, slots: Queue[tuple[Path, PytestServer]], workers: int
) -> list[SuiteRun]:
    """The base's suite in each slot's server and in fresh ones, ``REFERENCE_RUNS`` in
    all, each a process of its own (a candidate may run in any slot's)."""
    runs = []
    taken = [slots.get() for _ in range(workers)]
    try:
        for copy, server in taken:
            runs.append(server.run(copy, project.pytest_arguments(), project.pythonpath, 120.0))
    finally:
        for slot in taken:
            slots.put(slot)
    for _ in range(REFERENCE_RUNS - len(runs)):
        with jailed_tests(base) as fresh:
            runs.append(fresh.run(base, project.pytest_arguments(), project.pythonpath, 120.0))
    return runs


@dataclass
class ProjectResult:
    instances: list[Instance]
    removed: list[Removed]
    details: dict[str, object]


def make_project(project: Project, root: Path, sdists: Path, options: MakeOptions) -> ProjectResult:
    """One project's tasks: its base unpacked into the mirror at ``root`` (afresh), its
    candidates validated, the kept ones' branches written."""
    folder = mirror.repo_folder(root, project.repo)
    shutil.rmtree(folder, ignore_errors=True)
    sdist = fetch_sdist(project, sdists)
    base = folder / mirror.BASE
    unpack(sdist, base)
    release = sdist.read_bytes()
    if project.strip_docstrings:
        strip_files(base, project.source_files(base))
        release += b"\0less its docstrings"  # a base of its own: another base_commit
    mirror.write_project(root, project)
    base_commit = hashlib.sha1(release).hexdigest()
    with _slots(base, options.workers) as slots:
        references = _references(project, base, slots, options.workers)
        reference = references[0]
        passing, unstable = stable_passing([r.outcomes for r in references])
        if not passing:
            raise UserError(
                f"{project.repo}: no test passes on its base: {reference.output[-300:]}"
            )
        keep = None
        if options.cpu:
            fixes: dict[str, cpu.Readable] = {}

            def keep(m: Mutation) -> bool:
                found = cpu.readable(m, base, passing)
                if isinstance(found, cpu.Readable):
                    fixes[m.diff] = found
                return isinstance(found, cpu.Readable)

        kinds = cpu.KINDS if options.cpu else KINDS
        tried = candidates(project, base, options.per_project, options.seed, keep, kinds)
        lock = threading.Lock()
        bar = tqdm(total=len(tried), desc=project.repo, unit="bug", disable=not sys.stderr.isatty())

        def run_one(m: Mutation) -> SuiteRun:
            result = _try(project, m, slots, options.timeout_s)
            with lock:
                bar.update()
            return result

        with ThreadPoolExecutor(options.workers) as pool:
            runs = list(pool.map(run_one, tried))
        bar.close()
    instances: list[Instance] = []
    removed: list[Removed] = []
    seen: set[str] = set()
    for m, run in zip(tried, runs, strict=True):
        iid = instance_id(project, m)
        if iid in seen:
            continue
        seen.add(iid)
        fail = [t for t in passing if not run.passed(t)]
        still = [t for t in passing if run.passed(t)]
        reason = (
            TIMED_OUT
            if run.timed_out
            else NOTHING_FAILS
            if not fail
            else NOTHING_PASSES
            if not still
            else cpu_reason(m, fail)
            if options.cpu
            else None
        )
        if reason is not None:
            removed.append(Removed(iid, f"{reason}: {m.label}"))
            continue
        # a record's own draws: which others were kept (timing, a flaky test) cannot shift it
        rng = random.Random(f"{options.seed}:{iid}")
        text = "" if rng.random() < options.empty_statements else statement(project, run, fail)
        if rng.random() >= options.missing_branches:
            mirror.add_branch(root, project.repo, iid, m.diff)
        extra: dict[str, object] = {"bug": m.label}
        if options.cpu:  # the canonical fix (the scripted player's); never the agent's
            extra["fix"] = cpu.edit_command(fixes[m.diff].fix)
        instances.append(
            Instance(
                instance_id=iid,
                repo=project.repo,
                FAIL_TO_PASS=tuple(fail),
                PASS_TO_PASS=tuple(still),
                patch=m.diff,
                image_name=f"agl-swe/{project.repo}",
                base_commit=base_commit,
                problem_statement=text,
                extra={
                    "bug": m.label,
                    **({"fix": cpu.edit_command(fixes[m.diff].fix)} if options.cpu else {}),
                },
            )
        )
    details = {
        "tests": len(reference.outcomes),
        "passing_on_base": len(passing),
        "unstable_ids": unstable,
        "candidates": len(tried),
        "kept": len(instances),
        "suite_seconds_on_base": round(reference.seconds, 3),
    }
    log.info("%s: %d of %d candidates kept", project.repo, len(instances), len(tried))
    return ProjectResult(instances, removed, details)
