"""Invented coding tasks for the CPU-scale warm-up: real Python, invented surface.

The warm-up (``experiments.swe.warmup``) must teach the command forms of
``experiments.swe.cpu`` on code the validation tasks never hold. The code comes from the
Python standard library (top-level functions of ``MODULES``, less their docstrings):
real code, installed here, in none of the task projects. Every task is fresh: an invented
package, module and function name, made of words of real Python names drawn anew (names
of invented syllables were written from the model's prior, never copied: the probe's
first lesson), its ``def`` among other pooled functions at a random place of the module,
every other identifier of the module renamed too (``renaming``: builtins, keywords and
short names kept), a bug of the three kinds at one of its sites
(``experiments.swe.mutations``, the real code), kept only when it qualifies as a real
task must (``cpu.readable``'s rules, on the text), its test sometimes in a class, as
toolz's are. The search agent's lesson holds here: a fixed set of names is remembered,
not copied, so no name or line number repeats. It held for the code's own names as well:
with the pool's names kept, the warmed model wrote the pool's calls (``_siftup``,
``isinstance``) into real tasks' edits where the read had printed others.
"""

from __future__ import annotations

import ast
import builtins
import functools
import hashlib
import importlib
import inspect
import io
import keyword
import random
import re
import tokenize
from dataclasses import dataclass

from experiments.swe import cpu
from experiments.swe.docstrings import strip
from experiments.swe.make import statement_text
from experiments.swe.mutations import mutations

MODULES = (
    "textwrap",
    "shlex",
    "fnmatch",
    "posixpath",
    "heapq",
    "bisect",
    "statistics",
    "calendar",
    "difflib",
    "ipaddress",
    "urllib.parse",
    "email.utils",
    "base64",
    "html",
    "csv",
    "glob",
    "colorsys",
    "string",
    "gettext",
    "tokenize",
    "inspect",
    "dis",
    "pprint",
    "reprlib",
    "functools",
    "operator",
    "copy",
    "types",
    "enum",
    "dataclasses",
    "json.decoder",
    "json.encoder",
    "configparser",
    "argparse",
    "optparse",
    "locale",
    "mimetypes",
    "quopri",
    "uu",
    "wave",
    "chunk",
    "sre_parse",
    "sre_compile",
    "zipfile",
    "tarfile",
    "shutil",
    "tempfile",
    "genericpath",
    "ntpath",
    "warnings",
    "traceback",
    "linecache",
    "codecs",
    "random",
    "fractions",
    "decimal",
    "numbers",
    "datetime",
    "collections",
    "contextlib",
    "ast",
    "keyword",
    "platform",
    "sysconfig",
    "smtplib",
    "http.cookies",
    "http.client",
    "urllib.request",
    "email.header",
    "email.quoprimime",
    "email.base64mime",
    "email._header_value_parser",
    "xml.dom.minidom",
    "pydoc",
    "cgi",
    "nntplib",
    "imaplib",
    "ftplib",
    "poplib",
    "mailbox",
    "netrc",
    "plistlib",
    "pickle",
    "pickletools",
    "stringprep",
    "unicodedata",
    "gzip",
    "bz2",
    "lzma",
    "hashlib",
    "hmac",
    "secrets",
    "uuid",
    "ssl",
    "socket",
    "selectors",
    "subprocess",
    "sched",
    "queue",
    "threading",
    "asyncio.base_events",
    "asyncio.format_helpers",
    "logging",
    "getopt",
    "doctest",
    "unittest.util",
    "trace",
    "timeit",
    "cProfile",
    "pstats",
    "zipimport",
    "importlib.util",
    "pkgutil",
    "modulefinder",
    "runpy",
    "filecmp",
    "fileinput",
    "tabnanny",
    "py_compile",
    "compileall",
    "symtable",
    "token",
    "opcode",
)
MIN_LINES, MAX_LINES = 4, 40  # a pooled function's length
NEIGHBOURS = (2, 8)  # other pooled functions in an invented module
FIRST_TESTS_EXTRA = (0, 4)  # other failing tests (the statement lists 3, then "and N more")
CLASS_TEST_SHARE = 0.15  # tests in a class (``path::TestCustomMapping::test_f``), as toolz's
_IMPORTS = ("os", "re", "sys", "itertools", "functools", "collections")
# names an invented module keeps: what real code of any project calls by the same name
_KEPT = frozenset(keyword.kwlist) | frozenset(dir(builtins)) | {"self", "cls", *_IMPORTS}
MESSAGES = (
    "AssertionError: assert {a} == {b}",
    "assert {a} == {b}",
    "AssertionError: assert [{a}, {b}] == [{b}, {a}]",
    "AssertionError: assert not True",
    "AssertionError: assert False",
    "TypeError: '<' not supported between instances of 'int' and 'NoneType'",
    "IndexError: list index out of range",
    "KeyError: {a}",
    "ValueError: invalid literal for int() with base 10: 'x{a}'",
    "AttributeError: 'NoneType' object has no attribute 'get'",
    "StopIteration",
)


@dataclass(frozen=True)
class Pooled:
    """A standard-library function: its name and text (no docstring), and the bugs of
    the three kinds at its sites, each as ``(kind, line in the function, bugged text)``."""

    name: str
    text: str
    bugs: tuple[tuple[str, int, str], ...]


@dataclass(frozen=True)
class InventedTask:
    """One warm-up task: the checkout's files (the bugged module among them), where the
    bug is, and what the agent is told."""

    files: dict[str, str]  # path -> text, the module bugged
    module: str  # the bugged module's path
    base: str  # the module's text without the bug
    function: str
    test: str  # the failing test the function is named in (what a try runs)
    statement: str
    fix: cpu.Fix  # the canonical fix
    shown: tuple[cpu.Shown, ...]  # what the read prints, parsed


def _functions(source: str) -> list[tuple[str, str]]:
    """A module's top-level, undecorated functions as ``(name, text)``."""
    lines = source.splitlines()
    found = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and not node.decorator_list and node.end_lineno:
            found.append((node.name, "\n".join(lines[node.lineno - 1 : node.end_lineno])))
    return found


@functools.cache
def pool(modules: tuple[str, ...] = MODULES) -> tuple[Pooled, ...]:
    """Every pooled function of ``modules`` with at least one bug of the three kinds, in
    a fixed order."""
    found: list[Pooled] = []
    seen: set[str] = set()
    for name in modules:
        try:
            module = importlib.import_module(name)
            source = strip(inspect.getsource(module))
        except (ImportError, OSError, TypeError, SyntaxError):  # absent or not Python here
            continue
        for function, text in _functions(source):
            count = text.count("\n") + 1
            if not MIN_LINES <= count <= MAX_LINES or not text.isascii() or "\t" in text:
                continue
            if text in seen:
                continue
            seen.add(text)
            bugs = tuple(
                (m.kind, m.line, m.source)
                for m in mutations(text + "\n", "f.py", cpu.KINDS)
                if m.function.partition(".")[0] == function
            )
            if bugs:
                found.append(Pooled(function, text, bugs))
    return tuple(found)


@functools.cache
def vocabulary(modules: tuple[str, ...] = MODULES) -> tuple[str, ...]:
    """The words real Python names are made of: the parts of the identifiers in
    ``modules``' sources (``read_header`` gives ``read`` and ``header``), seen twice or
    more."""
    counts: dict[str, int] = {}
    for name in modules:
        try:
            source = inspect.getsource(importlib.import_module(name))
        except (ImportError, OSError, TypeError):
            continue
        for identifier in re.findall(r"\b[a-z][a-z0-9_]*\b", source):
            for word in identifier.split("_"):
                if 2 <= len(word) <= 10 and word.isalpha():
                    counts[word] = counts.get(word, 0) + 1
    return tuple(sorted(w for w, n in counts.items() if n >= 2 and not keyword.iskeyword(w)))


def invented_word(rng: random.Random, words: tuple[str, ...]) -> str:
    """A package's or module's name: one word, or two run together (``itertoolz``)."""
    return "".join(rng.choice(words) for _ in range(rng.choice((1, 1, 2))))


def invented_identifier(rng: random.Random, words: tuple[str, ...]) -> str:
    """A function's name: one to three words joined by underscores (``merge_sorted``).
    From thousands of words, no name is likely twice: it can only be copied."""
    return "_".join(rng.choice(words) for _ in range(rng.choice((1, 2, 2, 3))))


def _fresh(old: str, rng: random.Random, words: tuple[str, ...]) -> str:
    """An invented name in ``old``'s style: its leading underscores, CamelCase or
    UPPER_CASE where it is, one word for a short name (``seq``, ``key``)."""
    core = old.lstrip("_")
    new = rng.choice(words) if len(core) <= 6 else invented_identifier(rng, words)
    if core.isupper():
        new = new.upper()
    elif core[:1].isupper():
        new = "".join(w.capitalize() for w in new.split("_"))
    return old[: len(old) - len(core)] + new


def _names(text: str) -> list[tokenize.TokenInfo] | None:
    """The name tokens of Python ``text``; None when it does not tokenize."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (tokenize.TokenError, SyntaxError):
        return None
    return [t for t in tokens if t.type == tokenize.NAME]


def renaming(
    text: str, rng: random.Random, words: tuple[str, ...], fixed: dict[str, str]
) -> dict[str, str] | None:
    """A fresh name for every identifier of ``text`` (attributes too) but the kept ones
    (keywords, builtins, ``self``, dunders, the imported modules, names of one or two
    characters) and ``fixed``'s own:
    code of a fixed pool whose names stayed would be remembered, not copied (the model
    wrote the pool's call names, ``_siftup``, into real tasks' edits). None when ``text``
    does not tokenize."""
    names = _names(text)
    if names is None:
        return None
    mapping = dict(fixed)
    used = set(_KEPT) | set(mapping.values())
    for token in names:
        old = token.string
        dunder = old.startswith("__") and old.endswith("__")
        if old in mapping or old in _KEPT or dunder or len(old) <= 2:  # x, n, fn: any code's
            continue
        new = _fresh(old, rng, words)
        while new in used:
            new = _fresh(old, rng, words)
        mapping[old] = new
        used.add(new)
    return mapping


def renamed(text: str, mapping: dict[str, str]) -> str:
    """``text`` with its name tokens renamed by ``mapping`` (strings and comments as
    they were)."""
    lines = text.splitlines(keepends=True)
    for token in reversed(_names(text) or []):
        if token.string in mapping:
            row, col = token.start
            line = lines[row - 1]
            lines[row - 1] = line[:col] + mapping[token.string] + line[token.end[1] :]
    return "".join(lines)


def _layout(rng: random.Random, package: str, module: str) -> tuple[str, str]:
    """The module's and its tests' paths, in one of the layouts real projects use."""
    layouts = (
        (f"{package}/{module}.py", f"{package}/tests/test_{module}.py"),
        (f"{package}/{module}.py", f"tests/test_{module}.py"),
        (f"src/{package}/{module}.py", f"tests/test_{module}.py"),
        (f"{module}.py", f"test_{module}.py"),
    )
    return rng.choice(layouts)


def _parametrized(rng: random.Random, test: str, words: tuple[str, ...]) -> str:
    if rng.random() < 0.7:
        return test
    value = rng.choice((str(rng.randint(0, 99)), rng.choice(words), "True", "None"))
    return f"{test}[{value}-{rng.randint(0, 9)}]"


def invented_task(
    rng: random.Random,
    functions: tuple[Pooled, ...] | None = None,
    words: tuple[str, ...] | None = None,
) -> InventedTask:
    """A fresh task (the module's docstring) of ``functions`` (the pool) named with
    ``words`` (the vocabulary); draws again until the bug qualifies."""
    functions, words = functions or pool(), words or vocabulary()
    while True:
        found = _attempt(rng, functions, words)
        if found is not None:
            return found


def _attempt(
    rng: random.Random, functions: tuple[Pooled, ...], words: tuple[str, ...]
) -> InventedTask | None:
    target = rng.choice(functions)
    _, line, bugged = rng.choice(target.bugs)
    package, module = invented_word(rng, words), invented_word(rng, words)
    name = invented_identifier(rng, words)
    if name in (package, module):
        return None
    path, test_path = _layout(rng, package, module)
    others = [f.text for f in rng.sample(functions, rng.randint(*NEIGHBOURS)) if f is not target]
    at = rng.randint(0, len(others))
    header = "\n".join(f"import {m}" for m in sorted(rng.sample(_IMPORTS, 2)))
    before = [header, *others[:at]]
    after = others[at:]
    base = "\n\n\n".join([*before, target.text, *after]) + "\n"
    mapping = renaming(base, rng, words, {target.name: name})
    if mapping is None:
        return None
    bugged_module = "\n\n\n".join([*before, bugged.rstrip("\n"), *after]) + "\n"
    base, bugged_module = renamed(base, mapping), renamed(bugged_module, mapping)
    if len(re.findall(rf"def.{re.escape(name)}\(", bugged_module)) != 1:
        return None
    offset = ("\n\n\n".join(before) + "\n\n\n").count("\n")
    shown = cpu.parse_shown(simulated_read(path, bugged_module, name))
    base_lines, bugged_lines = base.splitlines(), bugged_module.splitlines()
    if len(base_lines) != len(bugged_lines):
        return None
    bug_line = offset + line
    candidates = cpu.tries(name, shown)[: cpu.MAX_TRIES]
    fixes = [f for f in candidates if cpu.apply(f, bugged_module) == base]
    changed = [i for i, (a, b) in enumerate(zip(base_lines, bugged_lines, strict=True)) if a != b]
    if changed != [bug_line - 1] or not fixes:
        return None
    if not cpu.MIN_SHOWN <= len(shown) <= cpu.MAX_SHOWN or not cpu.one_edit_a_site(name, shown):
        return None
    test = f"{test_path}::test_{name}"
    if rng.random() < CLASS_TEST_SHARE:
        test = f"{test_path}::Test{_fresh('Case', rng, words)}::test_{name}"
    failing = [_parametrized(rng, test, words)]
    for _ in range(rng.randint(*FIRST_TESTS_EXTRA)):
        failing.append(_parametrized(rng, _other_test(rng, test, words), words))
    message = rng.choice(MESSAGES).format(a=rng.randint(0, 20), b=rng.randint(0, 20))
    text = statement_text(package, failing, message if rng.random() < 0.9 else "")
    files = {path: bugged_module, test_path: _test_file(test, path, base)}
    return InventedTask(files, path, base, name, test, text, fixes[0], tuple(shown))


def _other_test(rng: random.Random, test: str, words: tuple[str, ...]) -> str:
    """Another failing test beside ``test``, as real projects name theirs: the same test in
    another class (toolz's ``TestDict::test_dissoc`` beside ``TestCustomMapping::``), a
    test whose name extends the function's (``test_memoize_curry_cache`` beside
    ``test_memoize``: a copy of the name must stop where it ends), or another one."""
    path, *classes, function = test.split("::")
    draw = rng.random()
    if classes and draw < 0.7:
        return f"{path}::Test{_fresh('Case', rng, words)}::{function}"
    if draw < 0.5:
        return f"{path}::{function}_{invented_identifier(rng, words)}"
    return f"{path}::test_{invented_identifier(rng, words)}"


def _test_file(test: str, path: str, base: str) -> str:
    """The test ``test`` (its id: ``file::test_f`` or ``file::TestC::test_f``), passing
    exactly when the module is the unbugged one: what the simulated shell decides a try
    by, for the real shell to run."""
    digest = hashlib.sha256(base.encode()).hexdigest()
    *classes, function = test.split("::")[1:]
    body = [
        f"def {function}({'self' if classes else ''}):",
        f"    text = pathlib.Path({path!r}).read_bytes()",
        f"    assert hashlib.sha256(text).hexdigest() == {digest!r}",
    ]
    if classes:
        body = [f"class {classes[0]}:", *(f"    {line}" for line in body)]
    return "import hashlib\nimport pathlib\n\n\n" + "\n".join(body) + "\n"


def simulated_read(path: str, module: str, function: str) -> str:
    """``cpu.read_command(function)``'s output over a checkout whose only match of
    ``def.function(`` is in ``module`` at ``path``: ``grep -rl``'s file, then ``grep -o``'s
    sites in the lines ``grep -A`` prints after the ``def``, each once (``awk``)."""
    lines = module.splitlines()
    pattern = re.compile(rf"def.{re.escape(function)}\(")
    for i, text in enumerate(lines):
        if pattern.search(text):
            window = lines[i + 1 : i + cpu.WINDOW + 1]
            sites = [m[0] for line in window for m in cpu.SITE_PATTERN.finditer(line)]
            return "".join(f"{line}\n" for line in [f"./{path}", *dict.fromkeys(sites)])
    return ""
