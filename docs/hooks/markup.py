"""MkDocs hook: formulas as MathML, and docstrings' Sphinx roles as plain code.

- A fenced block whose info string is ``math`` becomes display MathML, and ``\\(...\\)`` in
  prose becomes inline MathML (``latex2mathml``): the browser draws it, no script and no
  CDN is loaded. Code blocks and code spans are left alone.
- The package's docstrings name things Sphinx's way (``:func:`name```); mkdocstrings
  renders the role's text before the code. The role is dropped from the HTML.
"""

from __future__ import annotations

import re

from latex2mathml.converter import convert
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import Files
from mkdocs.structure.pages import Page

FENCE = re.compile(
    r"^(?P<fence>```+|~~~+)(?P<info>[^\n]*)\n(?P<body>.*?)^(?P=fence)[ \t]*$", re.M | re.S
)
CODE_SPAN = re.compile(r"(`+)(?:.+?)\1", re.S)
INLINE_MATH = re.compile(r"\\\((?P<tex>.+?)\\\)", re.S)
ROLE = re.compile(r":(?:mod|func|class|meth|attr|data|obj|exc):(?=<code>)")


def display(tex: str) -> str:
    return f'<div class="math">{convert(tex.strip(), display="block")}</div>'


def inline(text: str) -> str:
    """``\\(...\\)`` outside code spans, as inline MathML."""
    out, last = [], 0
    for span in CODE_SPAN.finditer(text):
        out.append(INLINE_MATH.sub(lambda m: convert(m["tex"].strip()), text[last : span.start()]))
        out.append(span.group(0))
        last = span.end()
    out.append(INLINE_MATH.sub(lambda m: convert(m["tex"].strip()), text[last:]))
    return "".join(out)


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    out, last = [], 0
    for block in FENCE.finditer(markdown):
        out.append(inline(markdown[last : block.start()]))
        if block["info"].strip() == "math":
            out.append(display(block["body"]))
        else:
            out.append(block.group(0))
        last = block.end()
    out.append(inline(markdown[last:]))
    return "".join(out)


def on_page_content(html: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    return ROLE.sub("", html)
