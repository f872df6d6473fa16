"""A release less its docstrings (``experiments/swe/docstrings.py``) does what the
release does: its syntax tree is the release's with the docstrings taken out, and every
other line is kept as written."""

from __future__ import annotations

import ast
import json.decoder
import textwrap
from pathlib import Path

import pytest

from experiments.swe.docstrings import strip, strip_files

ROOT = Path(__file__).resolve().parents[3]
MODULES = [
    Path(textwrap.__file__),
    Path(json.decoder.__file__),
    *sorted((ROOT / "experiments" / "swe").glob("*.py")),
    ROOT / "agl" / "study" / "report.py",
]

_DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def _without_docstrings(tree: ast.Module) -> ast.Module:
    """Python's own view: a body's first statement that is a str constant is its docstring."""
    for node in ast.walk(tree):
        if not isinstance(node, _DOCUMENTED) or not node.body:
            continue
        first = node.body[0]
        value = first.value if isinstance(first, ast.Expr) else None
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            rest = node.body[1:]
            node.body = rest if rest or isinstance(node, ast.Module) else [ast.Pass()]
    return tree


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_the_code_is_the_releases_less_its_docstrings(path: Path) -> None:
    source = path.read_text(encoding="utf-8")
    stripped = strip(source)
    assert ast.dump(ast.parse(stripped)) == ast.dump(_without_docstrings(ast.parse(source)))
    # every line left is one of the original's, in its order (a `pass` aside)
    kept = iter(source.splitlines())
    for line in stripped.splitlines():
        if line.strip() != "pass":
            assert any(line == original for original in kept), line


def test_a_body_that_was_only_a_docstring_passes() -> None:
    source = (
        '"""module"""\n'
        "import os  # kept\n"
        "def f():\n"
        '    """only this"""\n'
        "def g(): 'inline'\n"
        "class C:\n"
        '    """doc"""\n'
        "    x = 1\n"
        "def h():\n"
        "    b'bytes are not a docstring'\n"
        "    f'nor is {os}'\n"
        "    return 1 < 2\n"
    )
    assert strip(source) == (
        "import os  # kept\n"
        "def f():\n"
        "    pass\n"
        "def g(): pass\n"
        "class C:\n"
        "    x = 1\n"
        "def h():\n"
        "    b'bytes are not a docstring'\n"
        "    f'nor is {os}'\n"
        "    return 1 < 2\n"
    )
    namespace: dict[str, object] = {}
    exec(compile(strip(source), "m", "exec"), namespace)


def test_only_files_with_docstrings_are_rewritten(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text('def f():\n    """doc"""\n    return 1\n')
    (tmp_path / "b.py").write_text("def g():\n    return 2\n")
    assert strip_files(tmp_path, ["a.py", "b.py"]) == ["a.py"]
    assert (tmp_path / "a.py").read_text() == "def f():\n    return 1\n"
