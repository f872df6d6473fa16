"""The README and the docs site, kept true to the repository: what ``mkdocs build --strict``
(tests/run) cannot check, because it reads only the site's own links.

- the README stays a front page (at most 300 lines), and every relative link of the README
  and of ``docs/`` leads to a file of the checkout or of the built site;
- every repository path a page names in code (`agl/...`, `conf/...`, `tests/...`) exists;
- every ``agl train`` command of a page names config groups, options and run configs that
  exist, as ``agl.train`` itself checks them before Hydra starts;
- every ``from agl... import`` of a page's Python blocks imports;
- each experiment's README is on the site, and the design lists every layering rule that
  ``tests/test_layering.py`` enforces.

No mkdocs needed: the pages are read as text.
"""

from __future__ import annotations

import ast
import importlib
import itertools
import posixpath
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from agl.train import check_choices

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
MAX_README_LINES = 300
# The pages a reader reads: the README and the site's own pages (not the build hooks).
PAGES = sorted([README, *(p for p in DOCS.rglob("*.md") if "hooks" not in p.parts)])
# What the site's pages include as it is (--8<--): checked for the paths and imports they
# name, as the pages are.
INCLUDED = sorted(
    [*ROOT.glob("experiments/*/README.md"), ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md"]
)
# The example task the guide has the reader write (docs/guide/your-harness.md): named in
# commands and paths before it exists.
EXAMPLE_TASK = "mytask"

LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)
CODE_SPAN = re.compile(r"`([^`\n]+)`")
REPO_PATH = re.compile(r"^(?:agl|tests|conf|experiments|bench|deploy|docs)/[\w./-]*$")
# A path part in capitals stands for one the reader picks (conf/study/NAME.yaml).
PLACEHOLDER = re.compile(r"(?:^|/)[A-Z][A-Z_]*(?:\.\w+)?(?:/|$)")


def page_id(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def without_fences(text: str) -> str:
    return FENCE.sub("", text)


def generated_site_files() -> set[str]:
    """What docs/hooks/pictures.py adds to the site (its URIs, docs-relative), read from
    its constants without importing it (it needs mkdocs)."""
    source = (DOCS / "hooks" / "pictures.py").read_text()
    constants = {
        node.targets[0].id: node.value.value
        for node in ast.parse(source).body
        if isinstance(node, ast.Assign)
        and isinstance(node.targets[0], ast.Name)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    }
    plots = {p.relative_to(ROOT).as_posix() for p in ROOT.glob(str(constants["STUDY_PLOTS"]))}
    return {str(constants["MERGES_SVG"]), *plots}


def relative_links(path: Path) -> Iterator[str]:
    for match in LINK.finditer(without_fences(path.read_text())):
        target = match.group(1) or match.group(2)
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue  # another site, or an anchor of the same page
        yield target.split("#", 1)[0]


def link_resolves(path: Path, target: str, generated: set[str]) -> bool:
    if (path.parent / target).exists():
        return True
    if path.is_relative_to(DOCS):
        uri = posixpath.normpath(posixpath.join(path.parent.relative_to(DOCS).as_posix(), target))
        return uri in generated
    return False


def test_the_readme_is_a_front_page() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines"


@pytest.mark.parametrize("path", PAGES, ids=page_id)
def test_every_relative_link_leads_to_a_file(path: Path) -> None:
    generated = generated_site_files()
    broken = [t for t in relative_links(path) if not link_resolves(path, t, generated)]
    assert broken == []


def test_a_broken_link_is_caught(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("[ok](page.md) [gone](gone.md) [web](https://example.org) [here](#x)\n")
    assert [t for t in relative_links(page) if not link_resolves(page, t, set())] == ["gone.md"]


def named_paths(path: Path) -> Iterator[str]:
    """Repository paths in a page's code spans and code blocks."""
    text = path.read_text()
    spans = [m.group(1) for m in CODE_SPAN.finditer(without_fences(text))]
    blocks = [word for _, body in FENCE.findall(text) for word in body.split()]
    for candidate in (*spans, *blocks):
        candidate = candidate.strip("'\"(),;:")
        if not REPO_PATH.match(candidate) or "..." in candidate:
            continue
        if not PLACEHOLDER.search(candidate) or (ROOT / candidate).exists():
            yield candidate


@pytest.mark.parametrize("path", [*PAGES, *INCLUDED], ids=page_id)
def test_every_repository_path_a_page_names_exists(path: Path) -> None:
    missing = sorted(
        {p for p in named_paths(path) if EXAMPLE_TASK not in p and not (ROOT / p).exists()}
    )
    assert missing == []


def commands(path: Path, program: str) -> Iterator[list[str]]:
    """The argument lists of ``program``'s command lines in a page's shell blocks
    (``agl train`` or ``python -m agl.train``), continuation lines joined."""
    for lang, body in FENCE.findall(path.read_text()):
        if lang not in ("bash", "sh", ""):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0]
            for form in (f"agl {program}", f"python -m agl.{program}"):
                if line.strip().startswith(form + " ") or line.strip() == form:
                    yield words(line.strip()[len(form) :])


def words(line: str) -> list[str]:
    """A command line's words as the shell splits them; a line with a placeholder the
    shell could not read (`<this machine's IP>`) by whitespace."""
    try:
        return shlex.split(line)
    except ValueError:
        return line.split()


def run_config_problem(argv: list[str]) -> str | None:
    """A ``--config-name`` that names no yaml (in ``conf/``, or the ``--config-dir``)."""
    options = dict(itertools.pairwise(argv))
    name = options.get("--config-name")
    folder = ROOT / options.get("--config-dir", "conf")
    if name and not (folder / f"{name}.yaml").exists():
        return f"no run config {name!r} in {folder.relative_to(ROOT)}"
    return None


@pytest.mark.parametrize("path", PAGES, ids=page_id)
def test_every_agl_train_command_names_what_exists(path: Path) -> None:
    problems = []
    for argv in commands(path, "train"):
        if any(EXAMPLE_TASK in arg for arg in argv):
            continue
        problem = check_choices(argv) or run_config_problem(argv)
        if problem:
            problems.append(f"agl train {' '.join(argv)}: {problem}")
    assert problems == []


def test_a_command_naming_a_missing_option_is_caught(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("```bash\nagl train merge=prefx \\\n  loss=token_mean\n```\n")
    [argv] = list(commands(page, "train"))
    assert argv == ["merge=prefx", "loss=token_mean"]
    assert check_choices(argv) is not None
    assert run_config_problem(["--config-name", "no_such_run"]) is not None
    assert run_config_problem(["--config-dir", "experiments/calc", "--config-name", "gpu"]) is None


def agl_imports(path: Path) -> Iterator[tuple[str, str]]:
    """(module, name) of each ``from agl... import name`` line in a page's Python blocks
    (each line parsed alone: a block may be a signature sketch, not a program)."""
    for lang, body in FENCE.findall(path.read_text()):
        if lang != "python":
            continue
        for node in ast.walk(ast.parse(body)) if _parses(body) else _lines(body):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("agl"):
                yield from ((node.module or "", alias.name) for alias in node.names)


def _parses(body: str) -> bool:
    try:
        ast.parse(body)
    except SyntaxError:
        return False
    return True


def _lines(body: str) -> Iterator[ast.AST]:
    for line in body.splitlines():
        if line.startswith("from agl"):
            yield from ast.parse(line.split("#", 1)[0]).body


@pytest.mark.parametrize("path", [*PAGES, *INCLUDED], ids=page_id)
def test_every_agl_import_a_page_shows_imports(path: Path) -> None:
    missing = []
    for module, name in agl_imports(path):
        if EXAMPLE_TASK in module:
            continue
        try:
            found = hasattr(importlib.import_module(module), name)
        except ImportError:
            found = False
        if not found:
            missing.append(f"from {module} import {name}")
    assert missing == []


def test_every_experiment_readme_is_on_the_site() -> None:
    included = {
        m.group(1)
        for page in (DOCS / "experiments").glob("*.md")
        for m in re.finditer(r'^--8<-- "([^"]+)"', page.read_text(), re.M)
    }
    readmes = {p.relative_to(ROOT).as_posix() for p in ROOT.glob("experiments/*/README.md")}
    assert readmes - included == set()


def numbered_rules(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"^(\d+)\. ", text, re.M)]


def test_a_missing_path_is_caught(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "`agl/train.py`, `agl/gone.py`, `conf/study/NAME.yaml`\n```\nagl/nope.py\n```\n"
    )
    found = set(named_paths(page))
    assert found == {"agl/train.py", "agl/gone.py", "agl/nope.py"}
    assert sorted(p for p in found if not (ROOT / p).exists()) == ["agl/gone.py", "agl/nope.py"]


def test_the_design_lists_every_layering_rule() -> None:
    enforced = numbered_rules(
        ast.get_docstring(ast.parse((ROOT / "tests" / "test_layering.py").read_text())) or ""
    )
    design = (DOCS / "design.md").read_text()
    section = design.split("**Layering rules**", 1)[1].split("\n\n", 2)[1]
    assert enforced == list(range(1, len(enforced) + 1))
    assert numbered_rules(section) == enforced
    contributing = (ROOT / "CONTRIBUTING.md").read_text().split("## Layering rules", 1)[1]
    assert numbered_rules(contributing.split("\n## ", 1)[0]) == enforced
