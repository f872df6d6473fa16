"""What the Kubernetes API server's errors mean to the executor: which are worth retrying,
and the server's own message, on one line, for logs and failed attempts."""

from __future__ import annotations

import contextlib

import orjson
from kubernetes.client.exceptions import ApiException

RETRYABLE = frozenset({429, 500, 502, 503, 504})


def api_message(error: ApiException) -> str:
    """The API server's own message (its Status body), on one line."""
    with contextlib.suppress(orjson.JSONDecodeError, TypeError, AttributeError):
        body = orjson.loads(error.body or b"")
        if isinstance(body, dict) and body.get("message"):
            return " ".join(str(body["message"]).split())[:500]
    return f"{error.status} {error.reason}"
