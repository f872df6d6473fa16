"""The house rules of ``agl/`` and ``experiments/``, read from the source (every import
statement, the lazy ones inside functions and those under ``TYPE_CHECKING`` included):

1. no import cycle: no module imports one that imports it back, directly or not;
2. the contracts (``agl/core/contracts/``) import nothing else from agl;
3. nothing in agl imports an entry-point module (a ``python -m`` command);
4. the sandbox (``agl/sandbox/``) imports nothing of agl but itself and the bottom's
   process helpers (``agl.core.processes``), and its namespaces' first process
   (``agl/sandbox/entry.py``, run as ``python -I -S``) nothing but the standard library;
5. the gateway (``agl/core/gateway/``) imports neither the trainer, nor the controller, nor
   the code that builds a run (``agl/core/run/``): it is a service of its own;
6. a backend (``agl/backends/``) imports none of the rooms that drive it (the gateway, the
   controller, the trainer, the code that builds a run): what it executes is its own or
   the contracts', and what it shares with them lies below both;
7. production code imports nothing of ``agl/testing/``;
8. the code that builds a run (``agl/core/run/``, the composition root: it builds every
   backend, so it sits above them) is imported only by the entry points and by itself;
9. an experiment (``experiments/``) imports only agl's public surface (``PUBLIC``): the
   agent SDK (``agl.agent``), the contracts, the modules directly in ``agl/core/`` (the
   gateway client and the other utilities at the bottom: no room), the grading,
   strategies, sandbox, rollouts and study packages, and of the backends the model loader
   and the server's tool-call parser. Never the rooms (the gateway, the controller, the
   trainer, the code that builds a run), an executor's insides, ``agl/testing/`` or an
   entry point;
10. an experiment imports no private name (``_name``) of another experiment: what they
    share is public in its owner, or in the agent SDK;
11. the controller (``agl/core/controller/``) never imports the agent SDK: it hands an
    attempt an environment (``AgentEnv``, a contract), not the harness's library;
12. no test file (``tests/**/test_*.py``) imports another: what tests share lives in
    ``tests/helpers/`` (or a ``conftest.py``), so a file runs, moves and fails alone.

Each rule is a pure function over an import graph; the last tests feed them graphs that
break each rule, so that a rule which stopped catching anything would fail here.
"""

from __future__ import annotations

import ast
import functools
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CONTRACTS = "agl.core.contracts"
GATEWAY = "agl.core.gateway"
CONTROLLER = "agl.core.controller"
TRAINER = "agl.core.trainer"
RUN = "agl.core.run"
BACKENDS = "agl.backends"
TESTING = "agl.testing"
SANDBOX = "agl.sandbox"
SANDBOX_MAY_IMPORT = frozenset({"agl", "agl.core", "agl.core.processes"})
SANDBOX_ENTRY = ROOT / "agl" / "sandbox" / "entry.py"
ENTRY_POINTS = frozenset(
    {
        "agl.cli",
        "agl.train",
        "agl.gateway",
        "agl.serve",
        "agl.controller",
        "agl.rollouts.__main__",
        "agl.report",
        "agl.study.__main__",
        "agl.agent.__main__",
        "agl.grading.__main__",
    }
)
SOURCES = ("agl", "experiments")
AGENT = "agl.agent"
EXPERIMENTS = "experiments"
# What an experiment may import of agl (rule 9) besides the bottom, agl/core/'s modules.
PUBLIC = (
    AGENT,  # AgentContext and the harness skeleton (agl.agent.harness)
    CONTRACTS,
    "agl.grading",  # a task's grader
    "agl.strategies",  # the merge, advantage and loss strategies, by name
    SANDBOX,  # namespaces for an agent's tools
    "agl.rollouts",  # a gateway's rollouts read back: selections, scan rules, the judge
    "agl.study",  # runs compared
    "agl.backends.inference.models",  # a model by its name: what a warm-up trains
    "agl.backends.inference.server.tools",  # a reply's tool calls, read as the server does
)

Graph = Mapping[str, frozenset[str]]
# module -> (module, name) for each ``from module import name`` of a name, not a module
NameImports = Mapping[str, frozenset[tuple[str, str]]]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(tree: ast.Module, modules: frozenset[str]) -> Iterator[str]:
    """The ``modules`` a module's import statements name: ``from P import m`` names the
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


def imported_names(tree: ast.Module, modules: frozenset[str]) -> Iterator[tuple[str, str]]:
    """(module, name) for each ``from module import name`` of one of ``modules`` where the
    name is no module of its own."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in modules and node.level == 0:
            for alias in node.names:
                if f"{node.module}.{alias.name}" not in modules:
                    yield node.module, alias.name


@functools.cache
def parsed() -> dict[str, ast.Module]:
    """Every module of ``SOURCES``, by name."""
    paths = sorted(p for top in SOURCES for p in (ROOT / top).rglob("*.py"))
    return {module_name(p): ast.parse(p.read_text(), str(p)) for p in paths}


def import_graph() -> dict[str, frozenset[str]]:
    modules = frozenset(parsed())
    return {
        name: frozenset(t for t in imported(tree, modules) if t != name)
        for name, tree in parsed().items()
    }


def name_imports() -> dict[str, frozenset[tuple[str, str]]]:
    modules = frozenset(parsed())
    return {name: frozenset(imported_names(tree, modules)) for name, tree in parsed().items()}


def suite_import_graph() -> dict[str, frozenset[str]]:
    """The graph of the suite's own modules (not the harnesses' installed packages)."""
    paths = sorted(
        p
        for p in (ROOT / "tests").rglob("*.py")
        if not {".venv", "node_modules"} & set(p.relative_to(ROOT).parts)
    )
    trees = {module_name(p): ast.parse(p.read_text(), str(p)) for p in paths}
    modules = frozenset(trees)
    return {name: frozenset(imported(tree, modules)) - {name} for name, tree in trees.items()}


def imports_of_test_files(graph: Graph) -> list[tuple[str, str]]:
    """(module, test file) for every import of a test file by another module."""
    return sorted(
        (source, target)
        for source, targets in graph.items()
        for target in targets
        if target.rpartition(".")[2].startswith("test_")
    )


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


def within(module: str, room: str) -> bool:
    """``module`` is ``room`` or one of its modules (``agl.core.run_folder`` is not in
    ``agl.core.run``)."""
    return module == room or module.startswith(f"{room}.")


def leaks(graph: Graph, room: str, allowed: frozenset[str]) -> list[tuple[str, str]]:
    """(module of ``room``, agl module outside it and not ``allowed``) for every such
    import."""
    return sorted(
        (source, target)
        for source, targets in graph.items()
        if within(source, room)
        for target in targets
        if not within(target, room) and target not in allowed
    )


def reaches(graph: Graph, room: str, banned: tuple[str, ...]) -> list[tuple[str, str]]:
    """(module of ``room``, module of a ``banned`` room) for every such import."""
    return sorted(
        (source, target)
        for source, targets in graph.items()
        if within(source, room)
        for target in targets
        if any(within(target, other) for other in banned)
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


def gateway_reaches(graph: Graph) -> list[tuple[str, str]]:
    """(gateway module, trainer / controller / run-building module) for every such import."""
    return reaches(graph, GATEWAY, (TRAINER, CONTROLLER, RUN))


def backend_reaches(graph: Graph) -> list[tuple[str, str]]:
    """(backend module, module of a room that drives the backends) for every such import."""
    return reaches(graph, BACKENDS, (GATEWAY, CONTROLLER, TRAINER, RUN))


def imports_of_the_testbed(graph: Graph) -> list[tuple[str, str]]:
    """(production module, ``agl.testing`` module) for every such import."""
    return sorted(
        (source, target)
        for source, targets in graph.items()
        if not within(source, TESTING)
        for target in targets
        if within(target, TESTING)
    )


def run_imports(graph: Graph) -> list[tuple[str, str]]:
    """(module neither an entry point nor of ``agl.core.run``, module of ``agl.core.run``)
    for every such import."""
    return sorted(
        (source, target)
        for source, targets in graph.items()
        if source not in ENTRY_POINTS and not within(source, RUN)
        for target in targets
        if within(target, RUN)
    )


def off_the_public_surface(graph: Graph) -> list[tuple[str, str]]:
    """(experiment module, agl module off the public surface) for every such import. The
    bottom is what lies directly in ``agl/core/`` and is no package (a room)."""
    names = set(graph) | {target for targets in graph.values() for target in targets}
    packages = {name.rpartition(".")[0] for name in names}

    def public(module: str) -> bool:
        if module in ENTRY_POINTS:
            return False
        bottom = module.rpartition(".")[0] == "agl.core" and module not in packages
        return bottom or module in ("agl", "agl.core") or any(within(module, p) for p in PUBLIC)

    return sorted(
        (source, target)
        for source, targets in graph.items()
        if within(source, EXPERIMENTS)
        for target in targets
        if within(target, "agl") and not public(target)
    )


def experiment_of(module: str) -> str:
    """``experiments.<name>``, the experiment a module of ``experiments/`` belongs to."""
    return ".".join(module.split(".")[:2])


def borrowed_private_names(imports: NameImports) -> list[tuple[str, str, str]]:
    """(experiment module, module of another experiment, the private name it imports from
    there) for every such import."""
    return sorted(
        (source, module, name)
        for source, pairs in imports.items()
        if within(source, EXPERIMENTS)
        for module, name in pairs
        if name.startswith("_")
        and within(module, EXPERIMENTS)
        and experiment_of(module) != experiment_of(source)
    )


def controller_reaches(graph: Graph) -> list[tuple[str, str]]:
    """(controller module, agent SDK module) for every such import."""
    return reaches(graph, CONTROLLER, (AGENT,))


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


def test_the_gateway_imports_no_trainer_controller_or_run_building(graph: Graph) -> None:
    assert gateway_reaches(graph) == []


def test_a_backend_imports_none_of_the_rooms_that_drive_it(graph: Graph) -> None:
    assert backend_reaches(graph) == []


def test_production_imports_nothing_of_agl_testing(graph: Graph) -> None:
    assert imports_of_the_testbed(graph) == []


def test_only_the_entry_points_import_the_run_building_code(graph: Graph) -> None:
    assert run_imports(graph) == []


def test_the_graph_reads_the_experiments_too(graph: Graph) -> None:
    assert "agl.agent.harness" in graph["experiments.guess.harness"]


def test_experiments_import_only_the_public_surface(graph: Graph) -> None:
    assert off_the_public_surface(graph) == []


def test_no_experiment_imports_another_experiments_private_names() -> None:
    assert borrowed_private_names(name_imports()) == []


def test_the_controller_never_imports_the_agent_sdk(graph: Graph) -> None:
    assert controller_reaches(graph) == []


def test_no_test_file_imports_another() -> None:
    graph = suite_import_graph()
    assert "tests.helpers.shared" in graph["tests.conftest"]
    assert imports_of_test_files(graph) == []


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


def test_a_gateway_importing_the_trainer_or_the_run_is_caught() -> None:
    broken = {
        "agl.core.gateway.proxy": frozenset(
            {"agl.core.trainer.calls", "agl.core.contracts.call_validity"}
        ),
        "agl.core.gateway.config": frozenset({"agl.core.run.services", "agl.core.ports"}),
        "agl.core.gateway.app": frozenset({"agl.core.controller.reconcile", "agl.ui"}),
        "agl.core.gateway_tools": frozenset({"agl.core.trainer"}),  # not the gateway
    }
    assert gateway_reaches(broken) == [
        ("agl.core.gateway.app", "agl.core.controller.reconcile"),
        ("agl.core.gateway.config", "agl.core.run.services"),
        ("agl.core.gateway.proxy", "agl.core.trainer.calls"),
    ]


def test_a_backend_reaching_back_into_a_room_is_caught() -> None:
    broken = {
        "agl.backends.inference.server.app": frozenset(
            {"agl.core.gateway.errors", "agl.core.http_errors"}
        ),
        "agl.backends.training.torch": frozenset(
            {"agl.core.trainer.schedule", "agl.backends.training.schedule"}
        ),
        "agl.backends.inference.vllm": frozenset({"agl.core.run.services", "agl.core.ports"}),
        "agl.backends.execution.worker": frozenset({"agl.core.client", "agl.core.controller"}),
    }
    assert backend_reaches(broken) == [
        ("agl.backends.execution.worker", "agl.core.controller"),
        ("agl.backends.inference.server.app", "agl.core.gateway.errors"),
        ("agl.backends.inference.vllm", "agl.core.run.services"),
        ("agl.backends.training.torch", "agl.core.trainer.schedule"),
    ]


def test_production_importing_the_testbed_is_caught() -> None:
    broken = {
        "agl.backends.inference.models": frozenset({"agl.testing.retok"}),
        "agl.testing.retok": frozenset({"agl.backends.inference.qwen_chat", "agl.testing"}),
        "agl.testing_tools": frozenset({"agl.testing.faults"}),  # not agl.testing
    }
    assert imports_of_the_testbed(broken) == [
        ("agl.backends.inference.models", "agl.testing.retok"),
        ("agl.testing_tools", "agl.testing.faults"),
    ]


def test_a_library_importing_the_run_building_code_is_caught() -> None:
    broken = {
        "agl.train": frozenset({"agl.core.run.build"}),
        "agl.core.run.build": frozenset({"agl.core.run.tasks", "agl.core.config_groups"}),
        "agl.ui.pages": frozenset({"agl.core.run.build", "agl.core.config_groups"}),
        "agl.ui.run": frozenset({"agl.core.run_folder"}),  # not agl.core.run
        "agl.rollouts.calls": frozenset({"agl.core.run"}),
    }
    assert run_imports(broken) == [
        ("agl.rollouts.calls", "agl.core.run"),
        ("agl.ui.pages", "agl.core.run.build"),
    ]


def test_an_experiment_past_the_public_surface_is_caught() -> None:
    broken = {
        "experiments.x.harness": frozenset(
            {"agl.agent.harness", "agl.backends.execution.worker", "agl.core.user_error"}
        ),
        "experiments.x.structure": frozenset(
            {"agl.core.trainer.calls", "agl.core.run", "agl.strategies.registry"}
        ),
        "experiments.x.cli": frozenset({"agl.study.__main__", "agl.testing", "experiments.y"}),
        "agl.core.run.build": frozenset({"agl.core.client"}),  # agl.core.run: a package
        "agl.agent.harness": frozenset({"agl.backends.execution.worker"}),  # no experiment
    }
    assert off_the_public_surface(broken) == [
        ("experiments.x.cli", "agl.study.__main__"),
        ("experiments.x.cli", "agl.testing"),
        ("experiments.x.harness", "agl.backends.execution.worker"),
        ("experiments.x.structure", "agl.core.run"),
        ("experiments.x.structure", "agl.core.trainer.calls"),
    ]


def test_an_experiment_borrowing_another_ones_private_name_is_caught() -> None:
    broken = {
        "experiments.search.structure": frozenset(
            {("experiments.agentic.structure", "_tokenizer"), ("experiments.agentic", "COLUMNS")}
        ),
        "experiments.guess.warmup": frozenset({("experiments.guess.harness", "_integer")}),
        "agl.ui.views": frozenset({("experiments.guess.harness", "_integer")}),
    }
    assert borrowed_private_names(broken) == [
        ("experiments.search.structure", "experiments.agentic.structure", "_tokenizer")
    ]
    tree = ast.parse(
        "from experiments.a import _x, b\nfrom experiments import a\nimport experiments.a"
    )
    found = sorted(imported_names(tree, frozenset({"experiments", "experiments.a"})))
    assert found == [("experiments.a", "_x"), ("experiments.a", "b")]


def test_a_controller_importing_the_agent_sdk_is_caught() -> None:
    broken = {
        "agl.core.controller.reconcile": frozenset({"agl.agent", "agl.core.contracts.execution"}),
        "agl.backends.execution.worker": frozenset({"agl.agent"}),  # an executor may
    }
    assert controller_reaches(broken) == [("agl.core.controller.reconcile", "agl.agent")]


def test_a_test_file_importing_another_is_caught() -> None:
    broken = {
        "tests.strategies.test_merge_retok": frozenset(
            {"tests.strategies.test_merge", "tests.helpers.sample_positions"}
        ),
        "tests.strategies.test_merge": frozenset({"tests.helpers.sample_positions"}),
        "tests.helpers.sample_positions": frozenset(),
    }
    assert imports_of_test_files(broken) == [
        ("tests.strategies.test_merge_retok", "tests.strategies.test_merge")
    ]
