"""``"package.module:function"`` strings, as configs name a task's harness, data, warm-up
and grader, resolved to the function. Apart from the code that builds a run
(``agl.core.run.tasks``), because the grader's own process (``python -m agl.grading``)
resolves its grader the same way and builds no run."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def load_callable(spec: str, root: Path | None = None) -> Callable[..., Any]:
    """``"package.module:function"`` → the function (``root`` goes on ``sys.path`` first)."""
    module_name, sep, name = spec.partition(":")
    if not sep or not module_name or not name:
        raise ValueError(f"{spec!r} is not of the form module:function")
    if root is not None and str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"cannot import {module_name!r} (for {spec!r}): {error}") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise ValueError(f"{module_name!r} has no function {name!r}")
    return function
