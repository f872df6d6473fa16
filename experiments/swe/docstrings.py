"""A release's modules less their docstrings, for the CPU-scale tasks (issue 49).

A project whose functions carry long docstrings (toolz's run to 10-50 lines of doctest
examples each) puts a function's code far from its ``def``: what a small model reads
with a few lines after the ``def`` would be prose. Removing the docstrings of the
modules, classes and functions bugs go into is a mechanical change that keeps what the
code does: a body that was only a docstring becomes ``pass``, comments and code stay
byte for byte. ``__doc__`` becomes ``None``, so a test that reads one fails on the base
and is never a task's test (``make.stable_passing``). The README says the base is the
release less its docstrings.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import libcst as cst


def _is_docstring(statement: cst.BaseStatement | cst.BaseSmallStatement) -> bool:
    if isinstance(statement, cst.SimpleStatementLine) and len(statement.body) == 1:
        statement = statement.body[0]
    # a str literal, as Python takes a docstring (a bytes or f-string one is not)
    return (
        isinstance(statement, cst.Expr)
        and isinstance(statement.value, cst.SimpleString | cst.ConcatenatedString)
        and isinstance(statement.value.evaluated_value, str)
    )


def _without_docstring(body: cst.BaseSuite) -> cst.BaseSuite:
    if isinstance(body, cst.IndentedBlock) and body.body and _is_docstring(body.body[0]):
        rest = list(body.body[1:]) or [cst.SimpleStatementLine([cst.Pass()])]
        return body.with_changes(body=rest)
    if isinstance(body, cst.SimpleStatementSuite) and body.body and _is_docstring(body.body[0]):
        return body.with_changes(body=list(body.body[1:]) or [cst.Pass()])
    return body


class _Strip(cst.CSTTransformer):
    def leave_FunctionDef(
        self, original_node: cst.FunctionDef, updated_node: cst.FunctionDef
    ) -> cst.FunctionDef:
        return updated_node.with_changes(body=_without_docstring(updated_node.body))

    def leave_ClassDef(
        self, original_node: cst.ClassDef, updated_node: cst.ClassDef
    ) -> cst.ClassDef:
        return updated_node.with_changes(body=_without_docstring(updated_node.body))

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        if updated_node.body and _is_docstring(updated_node.body[0]):
            return updated_node.with_changes(body=updated_node.body[1:])
        return updated_node


def strip(source: str) -> str:
    """``source`` less the docstrings of its module, classes and functions. A string
    statement that a removal leaves first in its body (boltons writes a second one after a
    comment) would be the new docstring: it goes too, with the comments before it, until
    no body starts with one."""
    while True:
        stripped = cst.parse_module(source).visit(_Strip()).code
        if stripped == source:
            return source
        source = stripped


def strip_files(root: Path, files: Iterable[str]) -> Sequence[str]:
    """Each of ``files`` (relative to ``root``) rewritten without its docstrings; the
    files changed."""
    changed = []
    for name in files:
        path = root / name
        before = path.read_text(encoding="utf-8")
        after = strip(before)
        if after != before:
            path.write_text(after, encoding="utf-8")
            changed.append(name)
    return changed
