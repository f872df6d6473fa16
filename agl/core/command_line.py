"""``key=value`` command lines for agl's services, read into a dataclass of options: the
gateway's, the controller's, the embedded server's, a task's own services' (the search
task's retriever). At the bottom, as none of them builds a run.

A bad option ends the program with one line that says what is wrong, never a traceback.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, TypeVar, get_type_hints

from agl.core.user_error import UserError

C = TypeVar("C")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def parse_overrides(config_type: type[C], argv: list[str]) -> C:
    """The config with each ``key=value`` of ``argv`` applied, values typed by the field."""
    fields = {f.name: f for f in dataclasses.fields(config_type)}  # type: ignore[arg-type]
    hints = get_type_hints(config_type)
    values: dict[str, Any] = {}
    for arg in argv:
        key, sep, raw = arg.partition("=")
        if not sep:
            raise UserError(f"expected key=value, got {arg!r}")
        if key not in fields:
            raise UserError(f"unknown option {key!r}; options: {', '.join(fields)}")
        values[key] = _convert(key, raw, hints[key])
    try:
        return config_type(**values)
    except ValueError as error:  # the config's own checks (__post_init__)
        raise UserError(str(error)) from None


def _convert(key: str, raw: str, kind: Any) -> Any:
    try:
        if kind is bool:
            if raw.lower() in _TRUE:
                return True
            if raw.lower() in _FALSE:
                return False
            raise ValueError
        if kind in (int, float):
            return kind(raw)
    except ValueError:
        raise UserError(f"option {key}={raw!r} is not a valid {kind.__name__}") from None
    return raw


def usage(config_type: type[Any], about: str) -> str:
    """``about`` (the command's docstring) and each option with its default."""
    fields = dataclasses.fields(config_type)
    width = max((len(f.name) for f in fields), default=0)
    options = [f"  {f.name:<{width}}  {_default(f)}" for f in fields]
    head = f"{about.strip()}\n\nOptions (key=value), with their defaults:\n"
    return head + "\n".join(options) + "\n"


def _default(field: dataclasses.Field[Any]) -> str:
    if field.default is not dataclasses.MISSING:
        return repr(field.default)
    if field.default_factory is not dataclasses.MISSING:
        return repr(field.default_factory())
    return "(required)"


def parse_or_exit(config_type: type[C], argv: list[str], program: str, about: str = "") -> C:
    """The config ``argv`` asks for; ``-h``/``--help`` prints ``about`` and the options
    and exits 0; a bad option exits 2 with one line."""
    if {"-h", "--help"} & set(argv):
        sys.stdout.write(usage(config_type, about or program))
        raise SystemExit(0)
    try:
        return parse_overrides(config_type, argv)
    except UserError as error:
        sys.stderr.write(f"{program}: {error}\n")
        raise SystemExit(2) from None
