"""The one error a command reports in one line, without a traceback."""

from __future__ import annotations


class UserError(Exception):
    """A problem the user can fix (a bad option, a missing file, a port in use)."""
