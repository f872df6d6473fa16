"""The coding task at CPU scale (issue 49): bugs a small model can find by reading a
few lines, and fix with one ``sed``.

Every string the agent copies is preceded by a punctuation mark where it is copied from
and where it is written (``::test_name`` and ``'def.name(``, `` `id` `` and ``./id``,
``./path-57-`` and ``./path``): the tiny model's BPE then splits it into the same tokens
in both, and a copy is a copy (with a space before it, ``name`` is other tokens, and the
warmed model wrote names it had never seen instead). Swapped arguments are the exception:
moving an argument changes what precedes it.

A 2-layer model with 2,048 tokens of context cannot read a project (toolz's
``itertoolz.py`` alone is ~8k of its tokens) but can read a function's candidate lines.
The command forms here are what its warm-up teaches (``experiments.swe.warmup``) and
what a task must be fixable with, each run for real on the bugged checkout when a task
is made (``readable``):

- ``read_command(f)``: the lines of ``f``'s first ``WINDOW`` lines after its ``def`` that
  hold a site of the three kinds (a comparison, a ``return True``/``False``, a call of
  two plain arguments), as ``grep -rn -A`` prints them: ``./path-LINE-text``;
- ``edit_command(path, line, old, new)``: ``sed -i 'LINEs/OLD/NEW/' PATH``;
- ``try_command(edit, test)``: the edit, the failing test, and on a pass the submission
  (mini-swe-agent's ``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`` as the output's first
  line), else the edit undone (its ``sed`` the other way round): one command that leaves
  the checkout as it found it unless the test passes;
- ``submit_command(edit)``: the edit and the submission, untested.

The kinds are the three whose change undoes itself, so the fix can be read off the
bugged line (``flip_comparison``, ``change_return`` between ``True`` and ``False``,
``swap_arguments`` of two plain names). A task qualifies (``readable``) when its function
``f`` is a module's top-level function, defined once in the checkout; the project has a
test named ``test_f``; the read prints ``MIN_SHOWN``..``MAX_SHOWN`` lines, the bug's among
them; the canonical fix (``canonical_fix``) run on the bugged file gives back the base
file byte for byte; and it is among the first ``MAX_TRIES`` edits ``tries`` lists. Which
shown line is the bug cannot be known without running the test: that is what the agent
can learn.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from experiments.swe.mutations import Mutation

KINDS = ("flip_comparison", "change_return", "swap_arguments")
WINDOW = 12  # lines after the def the read looks at
MIN_SHOWN, MAX_SHOWN = 2, 6  # lines a qualifying read prints (one would name the bug)
MAX_TRIES = 4  # the fix is among the first of the read's candidate edits (``tries``)
SUBMIT = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
# a site of the three kinds: a comparison operator between spaces, a bool return, a call
# whose first two arguments are plain names
SITES = (
    r"' [<>]=? | [=!]= | (not )?in | is (not )?|return (True|False)"
    r"|\w\([[:alnum:]_.]+, [[:alnum:]_.]+'"
)
# SITES as Python reads it, for what simulates the read (experiments.swe.invented); grep's
# \w and [[:alnum:]] on the ASCII code here
SITE_PATTERN = re.compile(
    r" [<>]=? | [=!]= | (not )?in | is (not )?|return (True|False)"
    r"|\w\([A-Za-z0-9_.]+, [A-Za-z0-9_.]+",
    re.ASCII,
)
# the operators flip_comparison turns around, longest first (" not in " holds " in ")
_FLIPS = (
    ("not in", "in"),
    ("is not", "is"),
    ("in", "not in"),
    ("is", "is not"),
    (">=", "<"),
    ("<=", ">"),
    ("==", "!="),
    ("!=", "=="),
    ("<", ">="),
    (">", "<="),
)
_FOR_TARGET = re.compile(r"\bfor [\w, ()]+$")  # what precedes a for clause's " in "
_CALL = re.compile(r"( ?)(\w+)\(([\w.]+), ([\w.]+)")
# characters that would make a sed pattern or replacement mean more than its text (a
# "." may match another character: the real sed's result is checked against the base)
_SED_SPECIAL = set("[]*^$\\/&")
_SHOWN = re.compile(r"^\./(.+?)-(\d+)-(.*)$")


@dataclass(frozen=True)
class Shown:
    """One line a read prints: its file (checkout-relative), number and text."""

    path: str
    line: int
    text: str


@dataclass(frozen=True)
class Fix:
    """The ``sed`` that undoes a bug: ``old`` to ``new``, first match on ``line``."""

    path: str
    line: int
    old: str
    new: str


def read_command(function: str) -> str:
    # "def." (the dot matches the space): the name then follows a punctuation mark, as in
    # the test id it is copied from (``::test_name``), and is split into the same tokens
    return f"grep -rn -A {WINDOW} 'def.{function}(' . | grep -E {SITES}"


def edit_command(fix: Fix) -> str:
    return f"sed -i '{fix.line}s/{fix.old}/{fix.new}/' ./{fix.path}"


def undo(fix: Fix) -> Fix:
    return Fix(fix.path, fix.line, fix.new, fix.old)


def pytest_command(test: str) -> str:
    # "./": the test id follows a punctuation mark, as in the statement (`` `id` ``)
    return f"python -m pytest -q ./{test} >/dev/null"


def try_command(fix: Fix, test: str) -> str:
    tested = f"{pytest_command(test)} && echo {SUBMIT}"
    return f"{edit_command(fix)} && {tested} || {edit_command(undo(fix))}"


def submit_command(fix: Fix) -> str:
    return f"{edit_command(fix)} && echo {SUBMIT}"


def parse_shown(output: str) -> list[Shown]:
    """The lines a read printed (context lines of ``grep -A``: ``./path-N-text``)."""
    found = [_SHOWN.match(line) for line in output.splitlines()]
    return [Shown(m[1], int(m[2]), m[3]) for m in found if m]


def plain(text: str) -> bool:
    """Whether ``text`` means itself in a sed pattern and replacement."""
    return not _SED_SPECIAL & set(text) and "'" not in text


def _flip_applies(text: str, old: str) -> bool:
    """Whether ``s/ old / ... /`` would change a comparison operator: its first match is
    not part of a longer one (`` in `` of `` not in ``, `` is `` of `` is not ``) nor a
    ``for`` clause's ``in``."""
    at = text.find(f" {old} ")
    if at < 0:
        return False
    before, after = text[:at], text[at + len(old) + 2 :]
    if old in ("in", "is") and before.endswith(" not"):
        return False
    if old == "is" and after.startswith("not "):
        return False
    return not (old == "in" and _FOR_TARGET.search(before))


def fixes_for(kind: str, text: str) -> list[tuple[str, str]]:
    """The candidate ``(old, new)`` edits of ``kind`` on a line ``text``: what undoes a
    bug of that kind there, if it is one, in the order an agent tries them."""
    if kind == "flip_comparison":
        return [(f" {a} ", f" {b} ") for a, b in _FLIPS if _flip_applies(text, a)]
    if kind == "change_return":
        pairs = (("True", "False"), ("False", "True"))
        return [(f"return {a}", f"return {b}") for a, b in pairs if f"return {a}" in text]
    if kind == "swap_arguments":  # with the space before the call's name, if any
        return [(m[0], f"{m[1]}{m[2]}({m[4]}, {m[3]}") for m in _CALL.finditer(text)]
    raise ValueError(f"{kind!r} is not a CPU-scale kind; choose one of {KINDS}")


def tries(shown: Sequence[Shown]) -> list[Fix]:
    """Every candidate fix of the lines a read showed, in the order the warm-up's player
    tries them: line by line, each line's edits of each kind (``fixes_for``)."""
    return [
        Fix(s.path, s.line, old, new)
        for s in shown
        for kind in KINDS
        for old, new in fixes_for(kind, s.text)
        if plain(old) and plain(new)
    ]


def sed_once(text: str, old: str, new: str) -> str:
    """``s/old/new/`` on one line, for plain ``old`` and ``new``."""
    return text.replace(old, new, 1)


def canonical_fix(mutation: Mutation, base: str) -> Fix | None:
    """The canonical fix of a one-line bug of the three kinds: the first candidate edit
    (``fixes_for``) on the bugged line that gives back the base line; None when the bug
    is not one line or no plain edit undoes it."""
    before, after = base.splitlines(), mutation.source.splitlines()
    if mutation.kind not in KINDS or len(before) != len(after):
        return None
    changed = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if a != b]
    if len(changed) != 1:
        return None
    bugged, fixed = after[changed[0]], before[changed[0]]
    for old, new in fixes_for(mutation.kind, bugged):
        if plain(old) and plain(new) and sed_once(bugged, old, new) == fixed:
            return Fix(mutation.path, changed[0] + 1, old, new)
    return None


def test_function(test: str) -> str:
    """A test id less its parameters: what the agent runs (every parameter of it)."""
    return test.partition("[")[0]


def named_test(function: str, tests: Sequence[str]) -> str | None:
    """The first test id (less its parameters) named after ``function``: ``test_<function>``."""
    named = [test_function(t) for t in tests]
    return next((t for t in named if t.rpartition("::")[2] == f"test_{function}"), None)


def run_read(checkout: Path, function: str) -> str:
    """The read's output in ``checkout`` (the real ``grep``, as the agent's shell runs it)."""
    done = subprocess.run(
        ["bash", "-c", read_command(function)], cwd=checkout, capture_output=True, text=True
    )
    return done.stdout


def run_sed(checkout: Path, fix: Fix) -> None:
    subprocess.run(shlex.split(edit_command(fix)), cwd=checkout, check=True)


@dataclass(frozen=True)
class Readable:
    """A qualifying candidate: its canonical fix and what the read shows."""

    fix: Fix
    shown: tuple[Shown, ...]


def readable(mutation: Mutation, base: Path, tests: Sequence[str]) -> Readable | str:
    """Whether ``mutation`` of the checkout ``base`` qualifies (the module's docstring),
    checked with the real ``grep`` and ``sed`` on a copy holding the bug; the reason
    when it does not."""
    if mutation.kind not in KINDS:
        return f"kind {mutation.kind} is not read off a line"
    source = (base / mutation.path).read_text(encoding="utf-8")
    function = mutation.function.partition(".")[0]  # a closure's: its enclosing function's
    if not re.search(rf"^def {re.escape(function)}\(", source, re.M):
        return "not in a top-level function"
    if named_test(function, tests) is None:
        return f"no test named test_{function}"
    canonical = canonical_fix(mutation, source)
    if canonical is None:
        return "no one-line plain edit undoes it"
    with tempfile.TemporaryDirectory(prefix="agl-swe-cpu-") as scratch:
        copy = Path(scratch) / "repo"
        subprocess.run(["cp", "-a", str(base), str(copy)], check=True)
        (copy / mutation.path).write_text(mutation.source, encoding="utf-8")
        output = run_read(copy, function)
        defs = subprocess.run(
            ["grep", "-rn", f"def.{function}(", "."], cwd=copy, capture_output=True, text=True
        ).stdout.splitlines()
        run_sed(copy, canonical)
        undone = (copy / mutation.path).read_text(encoding="utf-8") == source
    if len(defs) != 1:
        return f"def.{function}( is in the checkout {len(defs)} times"
    shown = parse_shown(output)
    if not MIN_SHOWN <= len(shown) <= MAX_SHOWN:
        return f"the read shows {len(shown)} lines"
    if (mutation.path, canonical.line) not in {(s.path, s.line) for s in shown}:
        return "the read does not show the bug"
    if not undone:
        return "the fix does not give back the base"
    if canonical not in tries(shown)[:MAX_TRIES]:
        return f"the fix is not among the read's first {MAX_TRIES} candidate edits"
    return Readable(canonical, tuple(shown))
