"""From recorded events to the model calls that merging works on."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from agl.core.types import ModelCall


def dedup(calls: Sequence[ModelCall]) -> list[ModelCall]:
    """Drop retried calls: of calls with identical ``prompt_ids``, keep the last.

    A retried request is a new generation, so it cannot be deduplicated by the gateway;
    the last one is the answer the harness went on with (the paper's "Network Issues").
    Kept calls stay in the order they were made.
    """
    last = {tuple(c.prompt_ids): i for i, c in enumerate(calls)}
    return [c for i, c in enumerate(calls) if last[tuple(c.prompt_ids)] == i]


def calls_from_events(events: Iterable[Any]) -> list[ModelCall]:
    """The ``model_request`` events of one attempt, in order, as calls.

    Events without token ids (an endpoint that is not vLLM-compatible) cannot be trained
    on and are skipped.
    """
    calls = []
    for event in sorted(events, key=lambda e: e.sequence):
        data = event.data
        if (
            event.type != "model_request"
            or not data.get("prompt_ids")
            or not data.get("response_ids")
        ):
            continue
        calls.append(
            ModelCall(
                prompt_ids=list(data["prompt_ids"]),
                response_ids=list(data["response_ids"]),
                logprobs=[float(x) for x in data["logprobs"]],
                policy_version=int(data.get("policy_version", 0)),
            )
        )
    return calls
