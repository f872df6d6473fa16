"""HTML from the templates in ``agl/ui/templates``, every value escaped (autoescape on,
no ``|safe`` anywhere): rollouts carry what agents and models wrote."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from jinja2 import Environment, PackageLoader, StrictUndefined

from agl.ui import views

_VISIBLE = str.maketrans({" ": "␣", "\n": "⏎", "\t": "⇥", "\r": "␍"})


def visible(token: str) -> str:
    """A token's text with its whitespace drawn, so ``" a"`` and ``"a"`` look apart."""
    return token.translate(_VISIBLE)


_env = Environment(
    loader=PackageLoader("agl.ui", "templates"),
    autoescape=True,
    undefined=StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)
_env.filters.update(
    clock=views.clock,
    seconds=views.seconds,
    number=views.number,
    pretty=views.pretty,
    compact=views.compact,
    visible=visible,
    urlpart=lambda text: quote(str(text), safe=""),
)


def render(template: str, **context: Any) -> str:
    return _env.get_template(template).render(**context)
