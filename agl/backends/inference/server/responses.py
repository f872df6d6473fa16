"""What every generating answer shares: the JSON response, the policy-version header (the
weights that sampled it) and the token usage."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response

from agl.backends.inference.engine import Generation
from agl.backends.inference.server.text import ChoiceOutput

POLICY_VERSION_HEADER = "x-agl-policy-version"


def json_response(
    payload: Any, status: int = 200, headers: dict[str, str] | None = None
) -> Response:
    return Response(
        orjson.dumps(payload), status_code=status, media_type="application/json", headers=headers
    )


def version_header(generation: Generation) -> dict[str, str]:
    if generation.policy_version is None:
        return {}
    return {POLICY_VERSION_HEADER: str(generation.policy_version)}


def token_usage(prompt_ids: list[int], outputs: list[ChoiceOutput]) -> dict[str, int]:
    completion = sum(len(o.token_ids) for o in outputs)
    return {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": completion,
        "total_tokens": len(prompt_ids) + completion,
    }
