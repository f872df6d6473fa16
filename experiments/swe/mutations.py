"""Procedural bugs, SWE-smith's way: one small change inside one function of a module.

SWE-smith's procedural modifiers (``swesmith/bug_gen/procedural``) rewrite a function's
syntax tree at one site; the kinds here are the ones it names ``func_pm_*``, in the
words of issue 22:

- ``flip_comparison``: a comparison's operator turned around (``<`` to ``>=``, ``==`` to
  ``!=``, ``in`` to ``not in``, ``is`` to ``is not``);
- ``remove_branch``: an ``if`` without an ``else`` removed, condition and body;
- ``invert_if``: an ``if``/``else``'s two bodies swapped;
- ``off_by_one``: an integer literal one higher or lower (``n`` to ``n + 1``);
- ``swap_arguments``: a call's first two positional arguments swapped;
- ``change_return``: a returned ``True``/``False`` negated, any other value replaced by
  ``None``.

``mutations(source, path)`` lists every candidate at every site of every function, each
with the whole modified module and its diff, deterministically (in the order of the
source). Whether a candidate is a *bug* (some test fails, others still pass) is for the
project's tests to say (``experiments.swe.validate``); many are equivalent or break
everything. Sites inside docstrings, decorators and default values are left alone: a bug
lives in what a function does.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import libcst as cst
from libcst._nodes.internal import CodegenState

KINDS = (
    "flip_comparison",
    "remove_branch",
    "invert_if",
    "off_by_one",
    "swap_arguments",
    "change_return",
)

_FLIPPED: dict[type[cst.BaseCompOp], Callable[[], cst.BaseCompOp]] = {
    cst.LessThan: cst.GreaterThanEqual,
    cst.GreaterThanEqual: cst.LessThan,
    cst.GreaterThan: cst.LessThanEqual,
    cst.LessThanEqual: cst.GreaterThan,
    cst.Equal: cst.NotEqual,
    cst.NotEqual: cst.Equal,
    cst.In: cst.NotIn,
    cst.NotIn: cst.In,
    cst.Is: cst.IsNot,
    cst.IsNot: cst.Is,
}


@dataclass(frozen=True)
class Mutation:
    """One candidate bug: ``kind`` at ``line`` of ``function`` in ``path``."""

    kind: str
    path: str  # the module's path in the repository, as the diff names it
    function: str  # qualified name: Class.method, or outer.inner
    line: int
    source: str  # the whole module after the change
    diff: str  # a unified diff, a/ and b/ prefixed (``patch -p1`` applies it)

    @property
    def label(self) -> str:
        """A short stable name: kind, function and line."""
        return f"{self.kind}:{self.function}:{self.line}"


def _flip(node: cst.CSTNode) -> cst.CSTNode | None:
    if not isinstance(node, cst.Comparison) or len(node.comparisons) != 1:
        return None
    target = node.comparisons[0]
    flipped = _FLIPPED.get(type(target.operator))
    if flipped is None:
        return None
    operator = flipped()
    # keep the spacing the source had (``not in`` carries an inner space of its own)
    old = target.operator
    if hasattr(old, "whitespace_before") and hasattr(operator, "whitespace_before"):
        operator = operator.with_changes(
            whitespace_before=old.whitespace_before, whitespace_after=old.whitespace_after
        )
    return node.with_changes(comparisons=[target.with_changes(operator=operator)])


def _remove_branch(node: cst.CSTNode) -> cst.CSTNode | None:
    if isinstance(node, cst.If) and node.orelse is None:
        return cst.RemovalSentinel.REMOVE  # type: ignore[return-value]
    return None


def _invert_if(node: cst.CSTNode) -> cst.CSTNode | None:
    if not isinstance(node, cst.If) or not isinstance(node.orelse, cst.Else):
        return None
    return node.with_changes(body=node.orelse.body, orelse=node.orelse.with_changes(body=node.body))


def _off_by_one(node: cst.CSTNode) -> cst.CSTNode | None:
    if not isinstance(node, cst.Integer):
        return None
    value = node.evaluated_value
    if not isinstance(value, int):
        return None
    # 0 and 1 go up (a -1 index or range reads oddly); others go down, as the usual slip
    return cst.Integer(str(value + 1 if value <= 1 else value - 1))


def _swap_arguments(node: cst.CSTNode) -> cst.CSTNode | None:
    if not isinstance(node, cst.Call):
        return None
    positional = [i for i, a in enumerate(node.args) if a.keyword is None and not a.star]
    if len(positional) < 2:
        return None
    i, j = positional[0], positional[1]
    a, b = node.args[i], node.args[j]
    if a.value.deep_equals(b.value):
        return None
    args = list(node.args)
    args[i] = a.with_changes(value=b.value)
    args[j] = b.with_changes(value=a.value)
    return node.with_changes(args=args)


def _change_return(node: cst.CSTNode) -> cst.CSTNode | None:
    if not isinstance(node, cst.Return) or node.value is None:
        return None
    value = node.value
    if isinstance(value, cst.Name) and value.value in ("True", "False"):
        return node.with_changes(value=cst.Name("False" if value.value == "True" else "True"))
    if isinstance(value, cst.Name) and value.value == "None":
        return None
    return node.with_changes(value=cst.Name("None"))


_MUTATORS: dict[str, Callable[[cst.CSTNode], cst.CSTNode | None]] = {
    "flip_comparison": _flip,
    "remove_branch": _remove_branch,
    "invert_if": _invert_if,
    "off_by_one": _off_by_one,
    "swap_arguments": _swap_arguments,
    "change_return": _change_return,
}


@dataclass(frozen=True)
class _Site:
    kind: str
    function: str
    node: cst.CSTNode
    replacement: cst.CSTNode  # or RemovalSentinel.REMOVE
    unit: cst.CSTNode  # the innermost statement of a body that holds the site


class _Sites(cst.CSTVisitor):
    """Every site in every function body, in source order."""

    METADATA_DEPENDENCIES = ()

    def __init__(self, kinds: tuple[str, ...]) -> None:
        self.kinds = kinds
        self.scope: list[str] = []
        self.functions: list[str] = []  # the innermost function's qualified name
        self.statements: list[cst.CSTNode] = []  # the statements of bodies the visit is in
        self._in_body: set[int] = set()
        self.sites: list[_Site] = []
        self._skip = 0

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self.scope.append(node.name.value)

    def leave_ClassDef(self, original_node: cst.ClassDef) -> None:
        self.scope.pop()

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        self.scope.append(node.name.value)
        self.functions.append(".".join(self.scope))
        # only the body: decorators, defaults and annotations are not what a function does
        node.body.visit(self)
        return False

    def leave_FunctionDef(self, original_node: cst.FunctionDef) -> None:
        self.scope.pop()
        self.functions.pop()

    def visit_SimpleStatementLine(self, node: cst.SimpleStatementLine) -> bool:
        # a docstring (a bare string) holds no behaviour
        first = node.body[0] if node.body else None
        is_doc = isinstance(first, cst.Expr) and isinstance(first.value, cst.SimpleString)
        return not is_doc

    def on_visit(self, node: cst.CSTNode) -> bool:
        if id(node) in self._in_body:
            self.statements.append(node)
        if isinstance(node, cst.Module | cst.IndentedBlock):
            self._in_body.update(id(s) for s in node.body)
        if self.functions and not isinstance(node, cst.FunctionDef | cst.ClassDef):
            for kind in self.kinds:
                replacement = _MUTATORS[kind](node)
                if replacement is not None:
                    unit = next(s for s in reversed(self.statements) if s is not node)
                    site = _Site(kind, self.functions[-1], node, replacement, unit)
                    self.sites.append(site)
        return super().on_visit(node)

    def on_leave(self, original_node: cst.CSTNode) -> None:
        if self.statements and self.statements[-1] is original_node:
            self.statements.pop()
        super().on_leave(original_node)


class _Spans(CodegenState):
    """The module's code generated once, recording where the code of each of ``units``
    (statements of a body) lies in it, and the indentation it is written at."""

    def __init__(self, module: cst.Module, units: set[int]) -> None:
        super().__init__(
            default_indent=module.default_indent, default_newline=module.default_newline
        )
        self.spans: dict[int, tuple[int, int, tuple[str, ...]]] = {}  # id(node): start, end
        self._open: dict[int, tuple[int, tuple[str, ...]]] = {}
        self._units = units
        self._counted = 0
        self._chars = 0

    def _offset(self) -> int:
        self._chars += sum(len(t) for t in self.tokens[self._counted :])
        self._counted = len(self.tokens)
        return self._chars

    def before_codegen(self, node: cst.CSTNode) -> None:
        if id(node) in self._units:
            self._open[id(node)] = (self._offset(), tuple(self.indent_tokens))

    def after_codegen(self, node: cst.CSTNode) -> None:
        if id(node) in self._units:
            start, indent = self._open.pop(id(node))
            self.spans[id(node)] = (start, self._offset(), indent)


def _spans(
    module: cst.Module, source: str, sites: list[_Site]
) -> dict[int, tuple[int, int, tuple[str, ...]]]:
    """The span of ``source`` of each site's statement (by its node's id) and its
    indentation; none when the code generated is not the source (it always is) or the
    module's last newline is left out (the last statement's code would end past it)."""
    state = _Spans(module, {id(site.unit) for site in sites})
    module._codegen(state)
    if not module.has_trailing_newline or "".join(state.tokens) != source:
        return {}
    return state.spans


def _changed_module(
    module: cst.Module,
    source: str,
    site: _Site,
    spans: dict[int, tuple[int, int, tuple[str, ...]]],
) -> str:
    """The module's code with the site replaced. Only the statement the site is in is
    rebuilt and written out, at its indentation, between the source's text before and
    after it: the code ``module.deep_replace(...).code`` gives (a statement's code is
    its own and its indentation's), at the cost of one statement rather than of the
    whole module (a module of ~1,000 lines has hundreds of sites)."""
    span = spans.get(id(site.unit))
    if span is None:
        changed = module.deep_replace(site.node, site.replacement)
        return changed.code if isinstance(changed, cst.Module) else ""
    start, end, indent = span
    unit = site.unit.deep_replace(site.node, site.replacement)
    state = CodegenState(
        default_indent=module.default_indent,
        default_newline=module.default_newline,
        indent_tokens=list(indent),
    )
    unit._codegen(state)
    return source[:start] + "".join(state.tokens) + source[end:]


def _diff(path: str, before: str, after: str) -> str:
    lines = difflib.unified_diff(
        before.splitlines(keepends=True),
        after.splitlines(keepends=True),
        fromfile=f"a/{path}",
        tofile=f"b/{path}",
    )
    body = "".join(line if line.endswith("\n") else line + "\n" for line in lines)
    return f"diff --git a/{path} b/{path}\n{body}"


def mutations(source: str, path: str, kinds: tuple[str, ...] = KINDS) -> Iterator[Mutation]:
    """Every candidate bug of ``kinds`` in the functions of the module ``source`` (its
    repository path ``path``), in source order. A module that does not parse has none."""
    unknown = set(kinds) - set(_MUTATORS)
    if unknown:
        raise ValueError(f"unknown mutation kinds {sorted(unknown)}; known: {list(KINDS)}")
    try:
        module = cst.parse_module(source)
    except cst.ParserSyntaxError:
        return
    wrapper = cst.MetadataWrapper(module, unsafe_skip_copy=True)
    positions = wrapper.resolve(cst.metadata.PositionProvider)
    finder = _Sites(kinds)
    module.visit(finder)
    spans = _spans(module, source, finder.sites)
    for site in finder.sites:
        after = _changed_module(module, source, site, spans)
        if not after or after == source:
            continue
        try:
            compile(after, path, "exec")
        except SyntaxError:  # an emptied body, say: not a bug, a broken file
            continue
        line = positions[site.node].start.line
        yield Mutation(site.kind, path, site.function, line, after, _diff(path, source, after))
