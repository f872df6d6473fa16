"""One error shape for every 4xx/5xx the gateway sends, OpenAI-style so that the
``openai`` client a harness uses shows the message: ``{"error": {"message", "type",
"code"}, ...extra}``."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "request_too_large",
    422: "invalid_request_error",
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.extra = extra

    def response(self) -> Response:
        return error_response(self.status, self.message, **self.extra)


def error_response(status: int, message: str, **extra: Any) -> Response:
    body = {
        "error": {"message": message, "type": _TYPES.get(status, "api_error"), "code": status},
        **extra,
    }
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")
