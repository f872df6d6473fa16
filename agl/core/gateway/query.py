"""Whole numbers in query strings (cursors, attempts, steps, pages): ASCII digits with an
optional minus, within what SQLite binds. ``int()`` also reads ``١٢``, ``1_000`` and
spaces, ``str.isdigit()`` passes ``²`` and ``①``, and a value past 64 bits reached the
store as a 500; each of these is a 4xx saying what is wanted instead."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BeforeValidator, Field

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

_WHOLE = re.compile(r"-?[0-9]+")  # not \d, which matches every script's digits


def whole_number(text: str, low: int = 0, high: int = INT64_MAX) -> int:
    """``text`` as an integer from ``low`` to ``high``, else ValueError saying so."""
    wanted = f"a whole number from {low} to {high} in ASCII digits"
    if not _WHOLE.fullmatch(text) or len(text.lstrip("-0")) > len(str(INT64_MAX)):
        raise ValueError(f"must be {wanted}")
    value = int(text)
    if not low <= value <= high:
        raise ValueError(f"must be {wanted}")
    return value


def _ascii_digits_of(value: Any) -> Any:
    if isinstance(value, str) and not _WHOLE.fullmatch(value):
        raise ValueError("must be a whole number in ASCII digits")
    return value


# Integer query parameters of a pydantic model or a FastAPI route: ASCII digits, within
# the bounds (64 bits unless narrower), an integer in the OpenAPI document. The bounds
# come before the validator, or the schema would not show them as JSON Schema's.
ASCII_DIGITS = BeforeValidator(_ascii_digits_of)
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX), ASCII_DIGITS]
Positive64 = Annotated[int, Field(ge=1, le=INT64_MAX), ASCII_DIGITS]
Natural64 = Annotated[int, Field(ge=0, le=INT64_MAX), ASCII_DIGITS]
