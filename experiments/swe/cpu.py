"""The coding task at CPU scale (issue 49): bugs a small model can find by reading a
few lines, and fix with one ``sed``.

A 2-layer model with 2,048 tokens of context cannot read a project (toolz's
``itertoolz.py`` alone is ~8k of its tokens) but can read a function's candidate lines.
The command forms here are what its warm-up teaches (``experiments.swe.warmup``) and
what a task must be fixable with, each run for real on the bugged checkout when a task
is made (``readable``):

- ``read_command(f)``: the file that defines ``f`` (``grep -rl``), then every site of the
  three kinds (a comparison, a ``return True``/``False``, a call of two plain arguments)
  in the ``WINDOW`` lines after ``f``'s ``def``, one a line, as ``grep -o`` prints
  them (`` is not ``, `` reduce(binop, seq``), in the order of the code, each once;
  kept in ``SITES_FILE`` too;
- ``edit_command(fix)``: ``sed -i '/def.f(/,/PATTERN/s/PATTERN/REPLACEMENT/' ./PATH``,
  the first line after ``f``'s ``def`` that holds the site edited;
- ``try_command(fix, test)``: the edit (with sed's backup), the failing test, and on a
  pass the submission (mini-swe-agent's ``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`` as the
  output's first line), else the backup put back and the read's output printed again
  less the site just tried (``SITES_FILE``'s second line, deleted): one command that
  leaves the checkout as it found it unless the test passes, and whose failure shows
  the next site where the read showed the first;
- ``submit_command(fix)``: the edit and the submission, untested.

What the agent writes is copied from where it has seen it, each copy following the
same text there as here, which is how a 2-layer model copies (an induction head: the
token after the last match of the one before): the function's name after ``def.``
(``::test_name`` in the statement, then its own read), the path after ``./`` (the read's
first line), the test id after ``./`` (`` `id` `` in the statement). A site starts its
line of the read's output, so the first try copies the observation's first site (the
seed-0 pin of commit 0cc179f did, in 83 of 104 rollouts at T = 0.7). That pin's read
printed the sites once and a failed try printed nothing, so a later try had to copy the
next site of an observation two or more turns back, and did in 4 of 34 second edits
(experiments/swe/README.md): now a failed try prints the sites left, path first, so
every try copies the first site of the last observation, as the first does. The pin
that read whole lines (``./path-N-text``) wrote the right site in 1 edit of 7 at T = 1:
the site followed a variable's name there and ``/,/`` in the ``sed``, no text before it
the same, and the model wrote the operators it had seen most instead. No line number:
the first warm-up taught the line number's copy from ``./path-57-`` into ``'57s`` to no
seed (the model wrote numbers it had seen nowhere), as the copy follows other text there
than here; the range from the ``def`` to the site's first line finds the line. With a
space before it a name is other tokens of the tiny BPE than after a mark (the warmed
model wrote names it had never seen), hence ``def.`` and ``./``.

The kinds are the three whose change undoes itself, so the fix can be read off the
bugged line (``flip_comparison``, ``change_return`` between ``True`` and ``False``,
``swap_arguments`` of two plain names). A task qualifies (``readable``) when its function
``f`` is a module's top-level function, defined once in the checkout; the project has a
test named ``test_f``; the read prints ``MIN_SHOWN``..``MAX_SHOWN`` sites, each its own candidate
edit (``one_edit_a_site``); the canonical
fix (``canonical_fix``: the first line after the ``def`` with its site is the bug's) run
on the bugged file gives back the base file byte for byte; and it is among the first
``MAX_TRIES`` edits ``tries`` lists. Which shown site is the bug cannot be known without
running the test: that is what the agent can learn.
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
MIN_SHOWN, MAX_SHOWN = 2, 6  # sites a qualifying read prints (one would name the bug)
MAX_TRIES = 4  # the fix is among the first of the read's candidate edits (``tries``)
SUBMIT = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
# a site of the three kinds: a comparison operator between spaces, a bool return, a call
# whose first two arguments are plain names with the mark before its name (what a swap's
# pattern starts with). No plain " in ": out of its line a for clause's looks the same.
SITES = (
    r"' [<>]=? | [=!]= | not in | is (not )?|return (True|False)"
    r"|[ .(]?\w+\([[:alnum:]_.]+, [[:alnum:]_.]+'"
)
# SITES as Python reads it, for what simulates the read (experiments.swe.invented); grep's
# \w and [[:alnum:]] on the ASCII code here. grep -o takes the longest match at the
# leftmost place, Python the first alternative's: no two alternatives match at one place.
SITE_PATTERN = re.compile(
    r" [<>]=? | [=!]= | not in | is (not )?|return (True|False)"
    r"|[ .(]?\w+\([A-Za-z0-9_.]+, [A-Za-z0-9_.]+",
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
# a call of two plain arguments, with the mark before its name: its tokens as the read's
_CALL = re.compile(r"([ .(]?)(\w+)\(([\w.]+), ([\w.]+)")
# the two arguments as a swap's pattern takes them (sed's groups \1 and \2)
_ARGUMENTS = r"\([^ ,]*\), \([^ ,)]*\)"
BACKUP = ".orig"  # the suffix of a try's backup (sed -i.orig), which a failed try restores
# the read's output, kept in the checkout (each command runs in a fresh jail: its /tmp
# does not last) for a failed try to print again less its site; the grader reads the
# project's source files only
SITES_FILE = ".sites"
# characters that would make a sed pattern or replacement mean more than its text (a
# "." may match another character: the real sed's result is checked against the base)
_SED_SPECIAL = set("[]*^$\\/&")
_PATH = re.compile(r"^\./(\S+)$")


@dataclass(frozen=True)
class Shown:
    """One site a read prints (``text``) and the file it is in (checkout-relative)."""

    path: str
    text: str


@dataclass(frozen=True)
class Fix:
    """The ``sed`` that undoes a bug: in ``function``'s range (its ``def`` to the first
    line after it that ``pattern`` matches), ``pattern`` to ``replacement``, once a
    line. ``pattern`` is a basic regular expression, as sed reads it."""

    path: str
    function: str
    pattern: str
    replacement: str


def read_command(function: str) -> str:
    # "def." (the dot matches the space): the name then follows a punctuation mark, as in
    # the test id it is copied from (``::test_name``), and is split into the same tokens
    # tail: the def's own line is no site (its parameters, not a call)
    defined = f"'def.{function}(' ."
    window = f"grep -rh -A {WINDOW} {defined} | tail -n +2"
    # awk: each site once, in order, so that the n-th line is the n-th candidate edit
    sites = f"{window} | grep -oE {SITES} | awk '!s[$0]++'"
    return f"{{ grep -rl {defined}; {sites}; }} | tee {SITES_FILE}"


def _script(fix: Fix) -> str:
    return f"/def.{fix.function}(/,/{fix.pattern}/s/{fix.pattern}/{fix.replacement}/"


def edit_command(fix: Fix) -> str:
    return f"sed -i '{_script(fix)}' ./{fix.path}"


# edit_command's form as a regular expression ({backup}: try_command's ``-i`` suffix),
# for what reads the commands back (the simulated shell, the probe)
EDIT_FORM = (
    r"sed -i{backup} '/def\.(?P<function>\w+)\(/,/(?P<end>[^/]+)/s/(?P<pattern>[^/]+)"
    r"/(?P<replacement>[^/]*)/' \./(?P<path>\S+)"
)
_EDIT = re.compile("^" + EDIT_FORM.format(backup="") + "$")


def edit_of(found: re.Match[str]) -> Fix | None:
    """The fix a match of ``EDIT_FORM`` writes; None when its range ends at another
    pattern than it edits (no form of these)."""
    if found["end"] != found["pattern"]:
        return None
    return Fix(found["path"], found["function"], found["pattern"], found["replacement"])


def parse_edit(command: str) -> Fix | None:
    """``edit_command``'s inverse: the fix ``command`` writes, or None."""
    found = _EDIT.match(command)
    return edit_of(found) if found else None


def pytest_command(test: str) -> str:
    # "./": the test id follows a punctuation mark, as in the statement (`` `id` ``)
    return f"python -m pytest -q ./{test} >/dev/null"


def try_command(fix: Fix, test: str) -> str:
    # sed's own backup undoes a failed try exactly, whatever the edit did
    edit = f"sed -i{BACKUP} '{_script(fix)}' ./{fix.path}"
    restore = f"mv ./{fix.path}{BACKUP} ./{fix.path}"
    # the tried site is the second line (after the path) when the try copied the first
    left = f"sed -i 2d {SITES_FILE}; cat {SITES_FILE}"
    return f"{edit} && {pytest_command(test)} && echo {SUBMIT} || {{ {restore}; {left}; }}"


def submit_command(fix: Fix) -> str:
    return f"{edit_command(fix)} && echo {SUBMIT}"


def parse_shown(output: str) -> list[Shown]:
    """The sites a read printed, after the file it names first (none when it names no
    file); ``readable`` keeps only functions defined in one file."""
    lines = output.splitlines()
    found = _PATH.match(lines[0]) if lines else None
    if found is None:
        return []
    return [Shown(found[1], text) for text in lines[1:]]


def plain(text: str) -> bool:
    """Whether ``text`` means itself in a sed pattern and replacement (a ``.`` may match
    another character: what the real sed does is checked against the base)."""
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
    """The candidate ``(pattern, replacement)`` edits of ``kind`` on a line ``text``: what
    undoes a bug of that kind there, if it is one, in the order an agent tries them."""
    if kind == "flip_comparison":
        return [(f" {a} ", f" {b} ") for a, b in _FLIPS if _flip_applies(text, a)]
    if kind == "change_return":
        pairs = (("True", "False"), ("False", "True"))
        return [(f"return {a}", f"return {b}") for a, b in pairs if f"return {a}" in text]
    if kind == "swap_arguments":  # the call with what precedes its name, as the read shows it
        return [
            (f"{m[1]}{m[2]}({_ARGUMENTS}", f"{m[1]}{m[2]}(\\2, \\1")
            for m in _CALL.finditer(text)
            if plain(m[1] + m[2])
        ]
    raise ValueError(f"{kind!r} is not a CPU-scale kind; choose one of {KINDS}")


def tries(function: str, shown: Sequence[Shown]) -> list[Fix]:
    """Every candidate fix of the sites a read of ``function`` showed, in the order the
    warm-up's player tries them: site by site, each site's edits of each kind
    (``fixes_for``), each once (a site's edit that an earlier one's repeats would change
    the earlier site)."""
    found: list[Fix] = []
    for s in shown:
        for kind in KINDS:
            for pattern, replacement in fixes_for(kind, s.text):
                fix = Fix(s.path, function, pattern, replacement)
                if fix not in found:
                    found.append(fix)
    return found


def one_edit_a_site(function: str, shown: Sequence[Shown]) -> bool:
    """Whether each site the read showed gives a candidate edit of its own, so that the
    n-th line is the n-th try (two calls of one name give one swap: the edit's pattern
    takes any arguments)."""
    return len(tries(function, shown)) == len(shown)


def _bre(pattern: str) -> re.Pattern[str]:
    """A basic regular expression of the forms here as Python reads it: ``.`` any
    character, ``\\(``..``\\)`` a group, ``[...]`` a bracket expression, ``*``."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and pattern[i + 1 : i + 2] in ("(", ")"):
            out.append(pattern[i + 1])
            i += 2
        elif c == "[":
            close = pattern.index("]", i + 2)
            out.append(pattern[i : close + 1])
            i = close + 1
        elif c in ".*":
            out.append(c)
            i += 1
        else:
            out.append(re.escape(c))
            i += 1
    return re.compile("".join(out))


def apply(fix: Fix, module: str) -> str:
    """``edit_command(fix)``'s result on a module's text, as GNU sed gives it: the range
    from each line that ``def.function(`` matches to the first later line ``pattern``
    matches (or the end), the first match on each of its lines replaced."""
    start, pattern = _bre(f"def.{fix.function}("), _bre(fix.pattern)
    lines = module.split("\n")
    i = 0
    while i < len(lines):
        if not start.search(lines[i]):
            i += 1
            continue
        later = (j for j in range(i + 1, len(lines)) if pattern.search(lines[j]))
        end = next(later, len(lines) - 1)
        for j in range(i, end + 1):
            # sed's \\1 and \\2 are Python's too; nothing else in a replacement is special
            lines[j] = pattern.sub(fix.replacement, lines[j], count=1)
        i = end + 1
    return "\n".join(lines)


def bug_line(mutation: Mutation, base: str) -> int | None:
    """The line (from 1) a one-line bug changed; None when it changed more or fewer."""
    before, after = base.splitlines(), mutation.source.splitlines()
    if len(before) != len(after):
        return None
    changed = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if a != b]
    return changed[0] + 1 if len(changed) == 1 else None


def canonical_fix(mutation: Mutation, base: str) -> Fix | None:
    """The canonical fix of a one-line bug of the three kinds: the first candidate edit
    (``fixes_for``) of the bugged line that gives back the base (``apply``); None when
    the bug is not one line or no edit of the forms undoes it."""
    line = bug_line(mutation, base)
    if mutation.kind not in KINDS or line is None:
        return None
    function = mutation.function.partition(".")[0]
    for pattern, replacement in fixes_for(mutation.kind, mutation.source.splitlines()[line - 1]):
        fix = Fix(mutation.path, function, pattern, replacement)
        if apply(fix, mutation.source) == base:
            return fix
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
        return "no one-line edit of the forms undoes it"
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
        return f"the read shows {len(shown)} sites"
    if not one_edit_a_site(function, shown):
        return "two sites the read shows have one candidate edit"
    if not undone:
        return "the fix does not give back the base"
    if canonical not in tries(function, shown)[:MAX_TRIES]:
        return f"the fix is not among the read's first {MAX_TRIES} candidate edits"
    return Readable(canonical, tuple(shown))
