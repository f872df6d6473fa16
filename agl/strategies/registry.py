"""Strategies by kind and name: ``@register("merge", "prefix")`` and ``get("merge", "prefix")``.

Each strategy module in ``agl/strategies/<kind>/`` registers itself on import; ``get``
imports every module of the kind's package first, so adding a strategy is adding one
file (and its yaml in ``conf/<kind>/``) and touches nothing else.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

KINDS = ("merge", "advantage", "loss")
_registry: dict[str, dict[str, Any]] = {kind: {} for kind in KINDS}
_loaded: set[str] = set()


def register(kind: str, name: str) -> Callable[[F], F]:
    if kind not in _registry:
        raise ValueError(f"unknown strategy kind {kind!r}; kinds: {', '.join(KINDS)}")

    def add(obj: F) -> F:
        known = _registry[kind].get(name)
        if known is not None and known is not obj:
            raise ValueError(f"{kind} strategy {name!r} is registered twice")
        _registry[kind][name] = obj
        return obj

    return add


def _load(kind: str) -> None:
    if kind in _loaded:
        return
    package = importlib.import_module(f"agl.strategies.{kind}")
    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{module.name}")
    _loaded.add(kind)


def names(kind: str) -> list[str]:
    if kind not in _registry:
        raise ValueError(f"unknown strategy kind {kind!r}; kinds: {', '.join(KINDS)}")
    _load(kind)
    return sorted(_registry[kind])


def get(kind: str, name: str) -> Any:
    """The strategy registered as ``name`` for ``kind``."""
    known = names(kind)
    if name not in _registry[kind]:
        raise ValueError(f"unknown {kind} strategy {name!r}; registered: {', '.join(known)}")
    return _registry[kind][name]
