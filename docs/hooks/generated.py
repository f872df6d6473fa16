"""MkDocs hook: the site's generated pages, made at build time from the checkout itself.

A page holds a marker, ``<!-- agl:NAME ARGS -->`` on a line of its own, and the build
replaces it by what NAME generates, so the facts stay in one place and cannot drift:

- ``agl:openapi``: the gateway's HTTP API, from the OpenAPI document its FastAPI app
  serves at ``/openapi.json`` (the app is built, never started: no store, no port);
- ``agl:config``: every config group of ``conf/``, each option's keys with their
  defaults and the comments beside them;
- ``agl:cli``: each command's ``--help``, run as a user runs it;
- ``agl:strategies KIND``: one section per strategy of KIND in ``conf/KIND/``, its module
  documented by mkdocstrings from its docstring, and its yaml;
- ``agl:benchmarks``: every ``bench/`` module with a command, its docstring and its last
  results (``bench/results/``);
- ``agl:layout``: every module of ``agl/``, by folder, with the first sentence of its
  docstring (a new module shows up on its own; one without a docstring shows as such);
- ``agl:plots FOLDER``: every PNG of a study's report folder (the pictures hook puts them
  in the site at their repository path).

An unknown marker, or a generator that fails, fails the build. Nothing here reaches the
network.
"""

from __future__ import annotations

import ast
import html
import json
import os
import posixpath
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import Files
from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"^<!-- agl:(?P<name>[a-z]+)(?P<args>[^>]*?) -->$", re.M)
# The groups python -m agl.train composes, in the order conf/train.yaml lists them.
RUN_GROUPS_FILE = ROOT / "conf" / "train.yaml"

# Generated once per build: a page may be rendered more than once (mkdocs serve).
_cache: dict[str, str] = {}


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    # The checkout's own agl, also where another one is installed (an editable install of
    # another worktree): the generated pages describe the code beside them.
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    _cache.clear()
    return config


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    def replace(match: re.Match[str]) -> str:
        name, args = match["name"], match["args"].strip()
        generator = GENERATORS.get(name)
        if generator is None:
            raise PluginError(f"{page.file.src_uri}: unknown marker agl:{name}")
        key = f"{name} {args} {page.file.src_uri}"
        if key not in _cache:
            try:
                _cache[key] = generator(args, page.file.src_uri)
            except PluginError:
                raise
            except Exception as error:  # one line naming the page, not a hook traceback
                raise PluginError(f"{page.file.src_uri}: agl:{name} failed: {error!r}") from error
        return _cache[key]

    return MARKER.sub(replace, markdown)


# -- helpers -----------------------------------------------------------------------------


def cell(text: str) -> str:
    """Text for a table cell: no line breaks, no pipe, no raw HTML."""
    text = " ".join(text.split())
    return html.escape(text, quote=False).replace("|", "\\|").replace("*", "\\*")


def code(text: str) -> str:
    """A code span for a table cell (a backtick inside becomes a double-backtick span)."""
    text = " ".join(text.split()).replace("|", "\\|")
    fence = "``" if "`" in text else "`"
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def fenced(text: str, lang: str = "text") -> str:
    return f"```{lang}\n{text.rstrip()}\n```"


def details(summary: str, body: str) -> str:
    """A collapsed block (pymdownx.details)."""
    indented = "\n".join(f"    {line}" if line else "" for line in body.splitlines())
    return f'??? note "{summary}"\n\n{indented}\n'


# -- agl:openapi -------------------------------------------------------------------------


def openapi_document() -> dict[str, Any]:
    """The document the gateway serves at ``/openapi.json``, from its app as built."""
    from fastapi import FastAPI

    from agl.core.gateway.app import create_app
    from agl.core.gateway.config import GatewayConfig

    with tempfile.TemporaryDirectory() as run_dir:
        app: Any = create_app(GatewayConfig(run_dir=run_dir), "docs-build-" + "0" * 32)
        # create_app wraps FastAPI in its ASGI guards; each keeps the next as .app
        while not isinstance(app, FastAPI):
            app = app.app
        document: dict[str, Any] = app.openapi()
    return document


def schema_type(schema: dict[str, Any]) -> str:
    """A schema as a short type: ``list[RolloutSpec]``, ``string | null``."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{name.lower()})"
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return " \\| ".join(schema_type(s) for s in schema[key])
    kind = schema.get("type")
    if kind == "array":
        return f"list[{schema_type(schema.get('items', {}))}]"
    if kind == "object" and "additionalProperties" in schema:
        extra = schema["additionalProperties"]
        inner = schema_type(extra) if isinstance(extra, dict) else "any"
        return f"dict[string, {inner}]"
    if "enum" in schema:
        return " \\| ".join(code(json.dumps(v)) for v in schema["enum"])
    if "const" in schema:
        return code(json.dumps(schema["const"]))
    return str(kind) if kind else "any"


def constraints(schema: dict[str, Any]) -> str:
    parts = []
    for key, label in (
        ("minimum", ">="),
        ("maximum", "<="),
        ("exclusiveMinimum", ">"),
        ("exclusiveMaximum", "<"),
        ("minLength", "length >="),
        ("maxLength", "length <="),
        ("pattern", "matches"),
    ):
        if key in schema:
            parts.append(f"{label} {code(str(schema[key]))}")
    return ", ".join(parts)


def openapi_markdown(args: str, page: str) -> str:
    document = openapi_document()
    out = [
        f"The gateway's OpenAPI {document.get('openapi', '')} document, generated from "
        f"its app when this site was built (title {code(document['info']['title'])}, "
        f"version {code(document['info']['version'])}). A running gateway serves the same "
        "document at `GET /openapi.json`.",
        "",
        "| method | path | operation |",
        "|---|---|---|",
    ]
    operations = [
        (path, method, op)
        for path, methods in document["paths"].items()
        for method, op in methods.items()
    ]
    for path, method, op in operations:
        anchor = op["operationId"].replace("_", "-")
        out.append(f"| {method.upper()} | {code(path)} | [{op['summary']}](#{anchor}) |")
    out.append("")
    for path, method, op in operations:
        anchor = op["operationId"].replace("_", "-")
        out += ["", f"### {method.upper()} `{path}` {{ #{anchor} }}", ""]
        if op.get("description"):
            out += [op["description"], ""]
        parameters = op.get("parameters", [])
        if parameters:
            out += ["| parameter | in | type | required | constraints |", "|---|---|---|---|---|"]
            for p in parameters:
                schema = p.get("schema", {})
                out.append(
                    f"| {code(p['name'])} | {p['in']} | {schema_type(schema)} | "
                    f"{'yes' if p.get('required') else 'no'} | {constraints(schema)} |"
                )
            out.append("")
        body = op.get("requestBody")
        if body:
            for media, content in body.get("content", {}).items():
                out.append(f"Body ({code(media)}): {schema_type(content.get('schema', {}))}")
            out.append("")
        answers = []
        for status, response in op.get("responses", {}).items():
            shapes = [
                schema_type(c["schema"])
                for c in response.get("content", {}).values()
                if c.get("schema")
            ]
            shape = f": {', '.join(shapes)}" if shapes else ""
            answers.append(f"{status} ({response.get('description', '')}){shape}")
        if answers:
            out += ["Answers: " + "; ".join(answers) + ".", ""]
    out += ["", "## Schemas", ""]
    for name, schema in document.get("components", {}).get("schemas", {}).items():
        out += [f"### {name} {{ #{name.lower()} }}", ""]
        if schema.get("description"):
            out += [" ".join(schema["description"].split()), ""]
        properties = schema.get("properties")
        if properties:
            required = set(schema.get("required", []))
            out += ["| field | type | required | default | constraints |", "|---|---|---|---|---|"]
            for field, prop in properties.items():
                default = code(json.dumps(prop["default"])) if "default" in prop else ""
                out.append(
                    f"| {code(field)} | {schema_type(prop)} | "
                    f"{'yes' if field in required else 'no'} | {default} | {constraints(prop)} |"
                )
            out.append("")
        elif "enum" in schema:
            out += ["One of " + ", ".join(code(json.dumps(v)) for v in schema["enum"]) + ".", ""]
    out += [details("The whole document (JSON)", fenced(json.dumps(document, indent=2), "json"))]
    return "\n".join(out)


# -- agl:config --------------------------------------------------------------------------

KEY_LINE = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z0-9_.$/{}-]+):(?P<rest>.*)$")
INLINE_COMMENT = re.compile(r"""\s#\s?(?P<comment>.*)$""")


def header_comment(lines: list[str]) -> str:
    """The comment block a yaml file opens with."""
    block = []
    for line in lines:
        if not line.startswith("#"):
            break
        block.append(line.lstrip("#").strip())
    return " ".join(block)


def key_comments(lines: list[str]) -> tuple[dict[tuple[str, ...], str], set[tuple[str, ...]]]:
    """For each key path of a block-style yaml file, the comments above it and beside it;
    and the paths whose value is a block (their children have lines of their own)."""
    comments: dict[tuple[str, ...], str] = {}
    blocks: set[tuple[str, ...]] = set()
    stack: list[tuple[int, str]] = []
    pending: list[str] = []
    in_header = True
    for line in lines:
        stripped = line.strip()
        if in_header and line.startswith("#"):
            continue
        in_header = False
        if not stripped:
            continue
        if stripped.startswith("#"):
            pending.append(stripped.lstrip("#").strip())
            continue
        match = KEY_LINE.match(line)
        if match is None or stripped.startswith("- "):
            pending = []
            continue
        indent = len(match["indent"])
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = (*(key for _, key in stack), match["key"])
        rest = match["rest"]
        inline = INLINE_COMMENT.search(rest) if "#" in rest else None
        value = rest[: inline.start()] if inline else rest
        said = [*pending, inline["comment"]] if inline else pending
        if said:
            comments[path] = " ".join(said)
        pending = []
        if not value.strip():
            blocks.add(path)
            stack.append((indent, match["key"]))
    return comments, blocks


def show(value: Any) -> str:
    """A default as the yaml says it (flow style for lists and mappings)."""
    if isinstance(value, str):
        return value
    dumped = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
    return dumped.removesuffix("...").strip()


def key_rows(
    data: dict[str, Any],
    comments: dict[tuple[str, ...], str],
    blocks: set[tuple[str, ...]],
    prefix: tuple[str, ...] = (),
    skip: frozenset[str] = frozenset(),
) -> Iterator[str]:
    for key, value in data.items():
        path = (*prefix, str(key))
        if not prefix and key in skip:
            continue
        if isinstance(value, dict) and value and path in blocks:
            if path in comments:
                yield f"| {code('.'.join(path))} | | {cell(comments[path])} |"
            yield from key_rows(value, comments, blocks, path)
            continue
        yield f"| {code('.'.join(path))} | {code(show(value))} | {cell(comments.get(path, ''))} |"


def yaml_table(path: Path, skip: frozenset[str] = frozenset()) -> str:
    text = path.read_text()
    lines = text.splitlines()
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        return ""
    comments, blocks = key_comments(lines)
    rows = list(key_rows(data, comments, blocks, skip=skip))
    if not rows:
        return ""
    return "\n".join(["| key | default | what it is |", "|---|---|---|", *rows])


def option_section(path: Path, level: str, title: str) -> list[str]:
    lines = path.read_text().splitlines()
    rel = path.relative_to(ROOT).as_posix()
    out = [
        f"{level} {title}",
        "",
        f"`{rel}`" + (f": {cell(header_comment(lines))}" if header_comment(lines) else ""),
        "",
    ]
    table = yaml_table(path, skip=frozenset({"defaults"}))
    if table:
        out += [table, ""]
    return out


def defaults_of(path: Path) -> list[str]:
    """A config's defaults list, as written (``override task: agentic``, ``train``)."""
    data = yaml.safe_load(path.read_text()) or {}
    items = data.get("defaults", []) if isinstance(data, dict) else []
    shown = []
    for item in items:
        if isinstance(item, dict):
            shown += [f"{k}: {v}" for k, v in item.items()]
        else:
            shown.append(str(item))
    return shown


def config_markdown(args: str, page: str) -> str:
    conf = ROOT / "conf"
    run = yaml.safe_load(RUN_GROUPS_FILE.read_text())
    chosen: dict[str, str] = {}
    for item in run.get("defaults", []):
        if isinstance(item, dict):
            chosen.update({str(k): str(v) for k, v in item.items()})
    groups = [
        *chosen,
        *sorted(p.name for p in conf.iterdir() if p.is_dir() and p.name not in chosen),
    ]
    out = [
        "## The run: `conf/train.yaml`",
        "",
        "What `python -m agl.train` composes by default. Its groups and the option each "
        "takes by default:",
        "",
        "| group | default | options |",
        "|---|---|---|",
    ]
    for group in chosen:
        options = sorted(p.stem for p in (conf / group).glob("*.yaml"))
        listed = ", ".join(f"[`{o}`](#{group}-{o.replace('_', '-')})" for o in options)
        out.append(f"| [`{group}`](#group-{group}) | `{chosen[group]}` | {listed} |")
    out += [
        "",
        "Its own keys (override any as `key=value`):",
        "",
        yaml_table(RUN_GROUPS_FILE, skip=frozenset({"defaults"})),
        "",
    ]
    out += ["## Config groups", ""]
    for group in groups:
        folder = conf / group
        files = sorted(folder.glob("*.yaml"))
        if group in chosen:
            how = f"`{group}=NAME` on `python -m agl.train`; the default is `{chosen[group]}`."
        elif group == "study":
            how = "`python -m agl.study NAME` runs `conf/study/NAME.yaml`; not a group of a run."
        else:
            how = (
                "Files the configs above name by path (a Job template, a task's data); "
                "not chosen by `group=NAME`."
            )
        out += [f"### `{group}` {{ #group-{group} }}", "", how, ""]
        for option in files:
            # only a run's groups are chosen as group=option; the others are files
            shown = f"{group}={option.stem}" if group in chosen else f"conf/{group}/{option.name}"
            anchor = f"{group}-{option.stem.replace('_', '-')}"
            out += option_section(option, "####", f"`{shown}` {{ #{anchor} }}")
    out += [
        "## Run configs: `--config-name NAME`",
        "",
        "Each is a whole run: `python -m agl.train --config-name NAME` (or `agl train "
        "--config-name NAME`). Its defaults list picks the groups' options; its keys "
        "override `conf/train.yaml`'s.",
        "",
    ]
    for path in sorted(conf.glob("*.yaml")):
        if path == RUN_GROUPS_FILE:
            continue
        section = option_section(
            path, "###", f"`{path.stem}` {{ #run-{path.stem.replace('_', '-')} }}"
        )
        defaults = defaults_of(path)
        if defaults:
            section.insert(4, "Defaults: " + ", ".join(f"`{d}`" for d in defaults) + ".\n")
        out += section
    return "\n".join(out)


# -- agl:cli -----------------------------------------------------------------------------

COMMANDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("agl --help", ("agl.cli", "--help")),
    ("agl train --help (its config groups)", ("agl.train", "--help")),
    ("agl gateway --help", ("agl.gateway", "--help")),
    ("agl serve --help", ("agl.serve", "--help")),
    ("agl controller --help", ("agl.controller", "--help")),
    ("agl rollouts --help", ("agl.rollouts", "--help")),
    ("agl rollouts ls --help", ("agl.rollouts", "ls", "--help")),
    ("agl rollouts show --help", ("agl.rollouts", "show", "--help")),
    ("agl rollouts export --help", ("agl.rollouts", "export", "--help")),
    ("agl rollouts scan --help", ("agl.rollouts", "scan", "--help")),
    ("agl report --help", ("agl.report", "--help")),
    ("agl study --help", ("agl.study", "--help")),
)


def run_help(module_and_args: tuple[str, ...]) -> str:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    env["COLUMNS"] = "100"  # argparse wraps to the terminal; a build has none
    done = subprocess.run(
        [sys.executable, "-m", *module_and_args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if done.returncode != 0:
        raise PluginError(
            f"python -m {' '.join(module_and_args)} exited {done.returncode}: "
            f"{done.stderr.strip()[-500:]}"
        )
    text = done.stdout
    if module_and_args[0] == "agl.train":
        # the groups, not the whole composed config (the config reference has that)
        text = text.split("== Config ==")[0]
    # `agl X` is `python -m agl.X`: say it the way the heading does
    return text.replace("usage: python -m agl.", "usage: agl ")


def cli_markdown(args: str, page: str) -> str:
    with ThreadPoolExecutor(max_workers=4) as pool:
        outputs = list(pool.map(run_help, (argv for _, argv in COMMANDS)))
    out = []
    for (title, _), text in zip(COMMANDS, outputs, strict=True):
        plain = title.removesuffix(" (its config groups)").lower()
        anchor = re.sub(r"[^a-z]+", "-", plain).strip("-")
        out += [f"### `{title}` {{ #{anchor} }}", "", fenced(text), ""]
    return "\n".join(out)


# -- agl:strategies ----------------------------------------------------------------------


def strategies_markdown(kind: str, page: str) -> str:
    if kind not in ("merge", "advantage", "loss"):
        raise PluginError(f"agl:strategies takes merge, advantage or loss, not {kind!r}")
    out = []
    for yaml_path in sorted((ROOT / "conf" / kind).glob("*.yaml")):
        name = yaml_path.stem
        module = ROOT / "agl" / "strategies" / kind / f"{name}.py"
        if not module.exists():
            raise PluginError(f"conf/{kind}/{name}.yaml has no agl/strategies/{kind}/{name}.py")
        out += [
            f"## `{kind}={name}`",
            "",
            f'`agl/strategies/{kind}/{name}.py`, registered as `get("{kind}", "{name}")`.',
            "",
            f"::: agl.strategies.{kind}.{name}",
            "    options:",
            "      show_root_heading: false",
            "      show_root_toc_entry: false",
            "      heading_level: 3",
            "",
            f"Its options, `conf/{kind}/{name}.yaml` (`{kind}.KEY=VALUE` on the command line):",
            "",
            fenced(yaml_path.read_text(), "yaml"),
            "",
        ]
    return "\n".join(out)


# -- agl:benchmarks ----------------------------------------------------------------------


def benchmarks_markdown(args: str, page: str) -> str:
    out = []
    for path in sorted((ROOT / "bench").glob("*.py")):
        source = path.read_text()
        if 'if __name__ == "__main__"' not in source:
            continue  # a helper of the others
        doc = ast.get_docstring(ast.parse(source)) or ""
        name = path.stem
        out += [f"### `python -m bench.{name}` {{ #bench-{name.replace('_', '-')} }}", ""]
        out += [doc.replace("``", "`"), ""]
        results = ROOT / "bench" / "results" / f"{name}.txt"
        if results.exists():
            out += [
                details(
                    f"bench/results/{name}.txt (the last run kept)", fenced(results.read_text())
                ),
                "",
            ]
        else:
            out += ["No result is kept in `bench/results/` for this one.", ""]
    return "\n".join(out)


# -- agl:layout --------------------------------------------------------------------------

SPHINX_ROLE = re.compile(r":(?:mod|func|class|meth|attr|data|obj|exc):")
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z(`\"])")


def first_sentence(docstring: str) -> str:
    paragraph = " ".join(docstring.split("\n\n")[0].split())
    paragraph = SPHINX_ROLE.sub("", paragraph).replace("``", "`")
    sentence = SENTENCE_END.split(paragraph, maxsplit=1)[0]
    # a docstring that opens with an example ends its sentence with reST's "::"
    return sentence.removesuffix("::") + ("." if sentence.endswith("::") else "")


def layout_markdown(args: str, page: str) -> str:
    package = ROOT / "agl"
    folders: dict[str, list[tuple[str, str]]] = {}
    for path in sorted(package.rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if path.name == "__init__.py" and not doc:
            continue  # a package with nothing to say of itself; its modules speak
        folder = path.parent.relative_to(ROOT).as_posix() + "/"
        name = path.name if path.name != "__init__.py" else "__init__.py (the package)"
        folders.setdefault(folder, []).append((name, first_sentence(doc) or "(no docstring)"))
    out = []
    for folder, modules in folders.items():
        out += [f"### `{folder}`", "", "| module | what it is |", "|---|---|"]
        out += [f"| `{name}` | {cell(about)} |" for name, about in modules]
        out.append("")
    return "\n".join(out)


# -- agl:plots ---------------------------------------------------------------------------


def plots_markdown(folder: str, page: str) -> str:
    paths = sorted((ROOT / folder).glob("*.png"))
    if not paths:
        raise PluginError(f"agl:plots: no PNG in {folder}")
    here = posixpath.dirname(page)
    out = []
    for path in paths:
        uri = path.relative_to(ROOT).as_posix()
        title = path.stem.replace("_", " ")
        out += [f"![{title}]({posixpath.relpath(uri, here)})", ""]
    return "\n".join(out)


GENERATORS: dict[str, Callable[[str, str], str]] = {
    "openapi": openapi_markdown,
    "config": config_markdown,
    "cli": cli_markdown,
    "strategies": strategies_markdown,
    "benchmarks": benchmarks_markdown,
    "plots": plots_markdown,
    "layout": layout_markdown,
}
