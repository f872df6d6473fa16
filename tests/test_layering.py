"""The house rules of ``agl/``, read from the source (every import statement, the lazy ones
inside functions and those under ``TYPE_CHECKING`` included):

1. no import cycle: no module imports one that imports it back, directly or not;
2. the contracts (``agl/core/contracts/``) import nothing else from agl;
3. nothing in agl imports an entry-point module (a ``python -m`` command);
4. the sandbox (``agl/sandbox/``) imports nothing of agl but itself and the bottom's
   process helpers (``agl.core.processes``), and its namespaces' first process
   (``agl/sandbox/entry.py``, run as ``python -I -S``) nothing but the standard library.

Each rule is a pure function over an import graph; the last tests feed them graphs that
break each rule, so that a rule which stopped catching anything would fail here.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CONTRACTS = "agl.core.contracts"
SANDBOX = "agl.sandbox"
SANDBOX_MAY_IMPORT = frozenset({"agl", "agl.core", "agl.core.processes"})
SANDBOX_ENTRY = ROOT / "agl" / "sandbox" / "entry.py"
ENTRY_POINTS = frozenset(
    {
        "agl.train",
        "agl.gateway",
        "agl.serve",
        "agl.controller",
        "agl.rollouts.__main__",
        "agl.report",
        "agl.study.__main__",
        "agl.agent.__main__",
    }
)

Graph = Mapping[str, frozenset[str]]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(tree: ast.Module, modules: frozenset[str]) -> Iterator[str]:
    """The agl modules a module's import statements name: ``from P import m`` names the
    module ``P.m`` where there is one, else ``P`` (as ``import P.m`` does not name ``P``:
    a parent package runs first whatever imports its children)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                if child in modules:
                    yield child
                elif node.module in modules:
                    yield node.module


def import_graph() -> dict[str, frozenset[str]]:
    paths = sorted((ROOT / "agl").rglob("*.py"))
    modules = frozenset(module_name(p) for p in paths)
    graph = {}
    for path in paths:
        name = module_name(path)
        targets = imported(ast.parse(path.read_text(), str(path)), modules)
        graph[name] = frozenset(t for t in targets if t != name)
    return graph


def cycles(graph: Graph) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def leaks(graph: Graph, room: str, allowed: frozenset[str]) -> list[tuple[str, str]]:
    """(module of ``room``, agl module outside it and not ``allowed``) for every such
    import."""
    inside = (room, f"{room}.")
    return sorted(
        (source, target)
        for source, targets in graph.items()
        if source.startswith(inside)
        for target in targets
        if not target.startswith(inside) and target not in allowed
    )


def contract_leaks(graph: Graph) -> list[tuple[str, str]]:
    """(contract, agl module outside the contracts) for every such import."""
    return leaks(graph, CONTRACTS, frozenset({"agl", "agl.core"}))


def entry_point_imports(graph: Graph) -> list[tuple[str, str]]:
    return sorted(
        (source, target)
        for source, targets in graph.items()
        for target in targets
        if target in ENTRY_POINTS
    )


def sandbox_leaks(graph: Graph) -> list[tuple[str, str]]:
    """(sandbox module, agl module outside it and the bottom) for every such import."""
    return leaks(graph, SANDBOX, SANDBOX_MAY_IMPORT)


def non_standard_imports(tree: ast.Module) -> list[str]:
    """The top-level modules a module imports that are not the standard library's."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add("." if node.level else (node.module or "").split(".")[0])
    return sorted(names - set(sys.stdlib_module_names))


@pytest.fixture(scope="module")
def graph() -> dict[str, frozenset[str]]:
    return import_graph()


def test_the_graph_sees_lazy_and_type_checking_imports(graph: Graph) -> None:
    assert "agl.core.trainer.loop" in graph["agl.train"]  # imported inside a function
    assert "agl.core.contracts.execution" in graph["agl.core.run.build"]  # TYPE_CHECKING


def test_no_module_imports_one_that_imports_it_back(graph: Graph) -> None:
    assert cycles(graph) == []


def test_the_contracts_import_nothing_else_from_agl(graph: Graph) -> None:
    assert contract_leaks(graph) == []


def test_nothing_imports_an_entry_point(graph: Graph) -> None:
    assert entry_point_imports(graph) == []
    assert set(graph) >= ENTRY_POINTS, "an entry point moved: update ENTRY_POINTS"


def test_the_sandbox_stands_on_the_bottom_and_its_entry_on_the_standard_library(
    graph: Graph,
) -> None:
    assert sandbox_leaks(graph) == []
    assert non_standard_imports(ast.parse(SANDBOX_ENTRY.read_text())) == []


# -- the rules catch what they are for ----------------------------------------------------


def test_a_cycle_through_a_lazy_import_is_caught() -> None:
    broken = {"a": frozenset({"b"}), "b": frozenset({"c"}), "c": frozenset({"a"}), "d": frozenset()}
    assert cycles(broken) == [["a", "b", "c"]]
    assert cycles({"a": frozenset({"b"}), "b": frozenset()}) == []


def test_a_contract_importing_an_implementation_is_caught() -> None:
    broken = {
        f"{CONTRACTS}.records": frozenset({f"{CONTRACTS}.samples", "agl.core.client"}),
        f"{CONTRACTS}.samples": frozenset(),
    }
    assert contract_leaks(broken) == [(f"{CONTRACTS}.records", "agl.core.client")]


def test_a_library_importing_an_entry_point_is_caught() -> None:
    broken = {"agl.ui.pages": frozenset({"agl.train"}), "agl.train": frozenset()}
    assert entry_point_imports(broken) == [("agl.ui.pages", "agl.train")]


def test_a_sandbox_importing_the_run_or_a_package_is_caught() -> None:
    broken = {
        "agl.sandbox.launch": frozenset({"agl.sandbox.spec", "agl.core.processes"}),
        "agl.sandbox.jail": frozenset({"agl.core.run.services"}),
        "agl.sandbox.spec": frozenset(),
    }
    assert sandbox_leaks(broken) == [("agl.sandbox.jail", "agl.core.run.services")]
    entry = ast.parse("import os, json\nfrom agl.sandbox import spec\nimport yaml\nfrom . import x")
    assert non_standard_imports(entry) == [".", "agl", "yaml"]
