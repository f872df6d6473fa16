"""experiments/swe's procedural bugs and mirror: each kind changes one site as it says,
its diff applies (and reverses) with ``patch``, what holds no behaviour is left alone,
and a checkout carries no trace of the unbugged code."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

from agl.core.user_error import UserError
from experiments.swe import mirror
from experiments.swe.mutations import KINDS, mutations

SOURCE = textwrap.dedent(
    '''
    """A module; 5 > 2 in its docstring."""
    LIMIT = 3


    def clamp(x, low=0, high=10):
        """Clamp x; 5 > 2."""
        if x < low:
            return low
        if x > high:
            return high
        else:
            x = max(x, low)
        return x


    class Seen:
        def hit(self, items):
            for i in range(1, len(items)):
                if items[i] in self.seen:
                    return True
            return False
    '''
)


def _by_kind(kind: str) -> list:
    return [m for m in mutations(SOURCE, "pkg/mod.py") if m.kind == kind]


def _changed_lines(after: str) -> list[tuple[str, str]]:
    before_lines, after_lines = SOURCE.splitlines(), after.splitlines()
    if len(before_lines) != len(after_lines):
        return [("<lines>", f"{len(before_lines)} -> {len(after_lines)}")]
    return [
        (b.strip(), a.strip()) for b, a in zip(before_lines, after_lines, strict=True) if b != a
    ]


def test_every_kind_finds_its_sites_in_functions_only() -> None:
    found = {kind: _by_kind(kind) for kind in KINDS}
    assert all(found.values()), {k: len(v) for k, v in found.items()}
    for items in found.values():
        for m in items:
            assert m.function in ("clamp", "Seen.hit"), m.label
            assert '"""A module; 5 > 2' in m.source and "low=0, high=10" in m.source, m.label
            assert "LIMIT = 3" in m.source


@pytest.mark.parametrize(
    ("kind", "before", "after"),
    [
        ("flip_comparison", "if x < low:", "if x >= low:"),
        ("flip_comparison", "if items[i] in self.seen:", "if items[i] not in self.seen:"),
        ("invert_if", "return high", "x = max(x, low)"),
        ("off_by_one", "for i in range(1, len(items)):", "for i in range(2, len(items)):"),
        ("swap_arguments", "x = max(x, low)", "x = max(low, x)"),
        ("change_return", "return True", "return False"),
        ("change_return", "return x", "return None"),
    ],
)
def test_a_kind_changes_exactly_its_site(kind: str, before: str, after: str) -> None:
    changes = [_changed_lines(m.source) for m in _by_kind(kind)]
    assert any((before, after) in c and len(c) <= 2 for c in changes), changes


def test_removing_a_branch_drops_the_if_and_its_body() -> None:
    removed = _by_kind("remove_branch")
    sources = [m.source for m in removed]
    assert any(
        "if x < low" not in s and "return low" not in s and "if x > high" in s for s in sources
    )
    for s in sources:
        ast.parse(s)


def test_each_diff_applies_with_patch_and_reverses(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    target = tmp_path / "pkg" / "mod.py"
    for m in mutations(SOURCE, "pkg/mod.py"):
        target.write_text(SOURCE)
        mirror.apply_diff(tmp_path, m.diff)
        assert target.read_text() == m.source, m.label
        mirror.apply_diff(tmp_path, m.diff, reverse=True)
        assert target.read_text() == SOURCE, m.label


def test_the_listing_is_deterministic_and_labels_are_unique() -> None:
    first = [m.label for m in mutations(SOURCE, "pkg/mod.py")]
    assert first == [m.label for m in mutations(SOURCE, "pkg/mod.py")]
    assert len(set(m.source for m in mutations(SOURCE, "pkg/mod.py"))) == len(first)


# Layouts a statement's code depends on: tabs, CRLF, no last newline, decorators and
# comments, nested functions and classes, elif chains, one-line suites, semicolons,
# continuation lines, a body left empty by a removal (written ``pass``).
LAYOUTS = [
    SOURCE,
    "def f(x):\n\tif x < 1:\n\t\treturn 2\n\treturn x == 3\n",
    "def f(x):\r\n    if x < 1:\r\n        return 2\r\n    return x == 3\r\n",
    "def f(x):\n    if x < 1:\n        return 2\n    return x == 3",
    "class A:\n  class B:\n    @staticmethod\n    # c\n    def g(a, b):\n"
    "      def h():\n        return a < b\n      if a: return max(a, b)\n"
    "      y = 1; return h() == y\n\n\nx = 1\n",
    "def only(x):\n    if x:\n        y = 1\n",
    "if True:\n    def f(a):\n        if a == 1:\n            return [\n                1,\n"
    "   2]\n        elif a > 2:\n            return f(a, \\\n 3)\n        elif a:\n"
    "            pass\n        else:\n            return 0\n",
]


@pytest.mark.parametrize("source", LAYOUTS)
def test_each_module_is_the_one_the_whole_tree_writes_with_its_site_replaced(source: str) -> None:
    """mutations() writes out only the statement a site is in; the module is the one
    libcst writes from the whole tree with the site replaced, whatever the layout."""
    import libcst as cst

    from experiments.swe.mutations import _Sites

    module = cst.parse_module(source)
    finder = _Sites(KINDS)
    module.visit(finder)
    expected = []
    for site in finder.sites:
        after = module.deep_replace(site.node, site.replacement).code
        if after != source:
            try:
                compile(after, "m.py", "exec")
            except SyntaxError:
                continue
            expected.append((site.kind, site.function, after))
    assert expected
    assert [(m.kind, m.function, m.source) for m in mutations(source, "m.py")] == expected


def test_no_candidates_in_a_module_that_does_not_parse_and_unknown_kinds_are_refused() -> None:
    assert list(mutations("def broken(:\n", "x.py")) == []
    with pytest.raises(ValueError, match="unknown mutation kinds"):
        list(mutations(SOURCE, "x.py", kinds=("nope",)))


def _mirror(root: Path) -> Path:
    base = root / "owner__proj.1" / mirror.BASE
    (base / "pkg" / "__pycache__").mkdir(parents=True)
    (base / "pkg" / "mod.py").write_text(SOURCE)
    (base / "pkg" / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"stale")
    m = next(mutations(SOURCE, "pkg/mod.py"))
    mirror.add_branch(root, "owner__proj.1", "owner__proj.1.bug1", m.diff)
    return base


def test_a_checkout_is_the_branch_without_bytecode_or_history(tmp_path: Path) -> None:
    _mirror(tmp_path / "mirror")
    assert mirror.branches(tmp_path / "mirror") == {"owner__proj.1": ["owner__proj.1.bug1"]}
    dest = tmp_path / "work"
    mirror.checkout(tmp_path / "mirror", "owner__proj.1", "owner__proj.1.bug1", dest)
    assert (dest / "pkg" / "mod.py").read_text() == next(mutations(SOURCE, "pkg/mod.py")).source
    assert not list(dest.rglob("__pycache__")) and not list(dest.rglob(".git"))
    with pytest.raises(UserError, match="no branch"):
        mirror.checkout(tmp_path / "mirror", "owner__proj.1", "missing", tmp_path / "w2")
    with pytest.raises(UserError, match="not a plain name"):
        mirror.repo_folder(tmp_path, "../escape")
