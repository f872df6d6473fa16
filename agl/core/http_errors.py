"""One error shape for every 4xx/5xx agl's servers send, the gateway's and the embedded
inference server's (``agl.backends.inference.server``): at the bottom, so that both answer
in it and neither imports the other. OpenAI's ``ErrorResponse``,
``{"error": {"message", "type", "param", "code"}}`` with ``code`` a string or null, which
the ``openai`` client reads ``error.message`` from. A few errors carry more beside
``error`` (a 409's ``current`` rollout, a 429's ``retry_after_s``); the Anthropic routes
add ``"type": "error"`` (see the dialects), which keeps the same body valid for both SDKs.
An inference endpoint's error is wrapped in it too (:func:`upstream_error`), whatever
shape the endpoint answered in."""

from __future__ import annotations

from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict
from starlette.responses import Response

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="forbid")

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """The shape itself: what a test (or a client) can validate any error body with."""

    model_config = ConfigDict(extra="allow")

    error: ErrorDetail


def error_type(status: int) -> str:
    return _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_body(
    status: int,
    message: str,
    *,
    type: str | None = None,
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": type or error_type(status),
            "param": param,
            "code": code,
        }
    }


class ApiError(Exception):
    """A refusal answered in the one shape: ``status`` and ``message``; the
    error's ``type`` (by default from the status), ``param`` (the field at fault) and
    ``code`` (a machine-readable string); response ``headers``; and ``extra`` top-level
    fields beside ``error``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or error_type(status)
        self.param = param
        self.code = code
        self.headers = headers or {}
        self.extra = extra

    def body(self) -> dict[str, Any]:
        return {
            **error_body(
                self.status, self.message, type=self.type, param=self.param, code=self.code
            ),
            **self.extra,
        }

    def response(self) -> Response:
        return json_error(self.status, self.body(), self.headers)


def error_response(status: int, message: str, **options: Any) -> Response:
    """``ApiError(status, message, **options)``'s response, for a handler that answers
    rather than raises."""
    return ApiError(status, message, **options).response()


def json_error(status: int, body: dict[str, Any], headers: dict[str, str] | None) -> Response:
    return Response(
        orjson.dumps(body), status_code=status, media_type="application/json", headers=headers
    )


UPSTREAM_CODE = "upstream_error"  # the code of a wrapped error whose endpoint gave none


def upstream_error(status: int, payload: bytes, source: str = "the inference endpoint") -> ApiError:
    """An endpoint's error answer as the gateway's: its status (502 when it is no error
    status), message and type kept, and a string ``param``/``code`` when it gave them (its
    code is often vLLM's integer status: then ``upstream_error``), the message saying
    ``source`` answered it. Endpoints answer OpenAI's ``{"error": {...}}``, vLLM's older
    ``{"object": "error", "message", ...}`` with the fields at the top, or anything (a
    proxy's HTML page), whose start becomes the message."""
    fields = _error_fields(payload)
    message = fields.get("message")
    if not isinstance(message, str) or not message:
        message = payload[:500].decode(errors="replace") or "no message"
    code = fields.get("code")
    param = fields.get("param")
    kind = fields.get("type")
    return ApiError(
        status if 400 <= status <= 599 else 502,
        f"{source} answered {status}: {message}",
        type=kind if isinstance(kind, str) and kind else None,
        param=param if isinstance(param, str) else None,
        code=code if isinstance(code, str) and code else UPSTREAM_CODE,
    )


def _error_fields(payload: bytes) -> dict[str, Any]:
    try:
        parsed = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return {}
    if not isinstance(parsed, dict):
        return {}
    error = parsed.get("error")
    if isinstance(error, dict):
        return error
    if isinstance(error, str):  # some servers answer {"error": "what went wrong"}
        return {"message": error}
    return parsed
