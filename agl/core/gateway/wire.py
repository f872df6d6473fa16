"""Bodies in and answers out: JSON request bodies parsed with the pydantic records (one
readable 4xx in the gateway's error shape for any bad input, never FastAPI's default
path) and answers written with orjson (large event payloads are not walked twice)."""

from __future__ import annotations

from typing import Any, TypeVar

import orjson
from pydantic import TypeAdapter, ValidationError
from pydantic_core import from_json
from starlette.responses import Response

from agl.core.contracts.records import AdmissionIn, EventIn, ModelEndpoint, RolloutSpec, StatusPatch
from agl.core.http_errors import ApiError

SPECS = TypeAdapter(list[RolloutSpec])
PATCH = TypeAdapter(StatusPatch)
EVENTS_BODY: TypeAdapter[EventIn | list[EventIn]] = TypeAdapter(EventIn | list[EventIn])
MODELS = TypeAdapter(list[ModelEndpoint])
ADMISSION = TypeAdapter(AdmissionIn)


T = TypeVar("T")


def parse(adapter: TypeAdapter[T], body: bytes) -> T:
    if not body:
        raise ApiError(400, "request body is empty; it must be JSON")
    try:
        return adapter.validate_json(body)
    except ValidationError as error:
        raise ApiError(422, describe(error.errors())) from None


def parse_events(body: bytes, cap: int) -> EventIn | list[EventIn]:
    """An events body, counted before it is validated: validating and storing 100,000
    events held the event loop, and so every other call, for seconds."""
    try:
        parsed = from_json(body, allow_inf_nan=False)
    except ValueError:
        return parse(EVENTS_BODY, body)  # which says what is wrong with it, as for any body
    if isinstance(parsed, list) and len(parsed) > cap:
        raise ApiError(
            413,
            f"{len(parsed)} events in one POST, over the limit of {cap} "
            "(max_events_per_post): send them in smaller batches",
        )
    try:
        return EVENTS_BODY.validate_python(parsed)
    except ValidationError as error:
        raise ApiError(422, describe(error.errors())) from None


def describe(errors: list[Any]) -> str:
    parts = []
    for e in errors[:5]:
        where = ".".join(str(p) for p in e.get("loc", ())) or "body"
        parts.append(f"{where}: {e.get('msg')}")
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    return "invalid request: " + "; ".join(parts) + more


def json_response(payload: Any, status: int = 200) -> Response:
    return Response(
        orjson.dumps(payload, default=_plain), status_code=status, media_type="application/json"
    )


def _plain(value: Any) -> Any:
    if hasattr(value, "__dict__"):
        return vars(value)
    raise TypeError(f"cannot serialise {type(value).__name__}")
