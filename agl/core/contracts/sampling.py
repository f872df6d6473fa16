"""What a request asks the engine to sample under, as the proxy records it.

The proxy resolves a request's sampling fields to a ``Sampling`` (absent fields take the
engines' neutral defaults: temperature 1, top-p 1, top-k off), forwards them explicitly, so
an endpoint cannot apply defaults of its own, and records them with the call; the trainer
scores the call's tokens under that same transform (``agl.backends.sampling``).

Fields that change the sampled distribution in ways the trainer does not reproduce
(penalties that depend on the generated text, min-p, logit biases) are refused with a 400
when set to anything but their neutral value: a call sampled under them could only be
trained on with a wrong ratio.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from agl.core.contracts.samples import NO_TRANSFORM, Sampling

# field -> its neutral value (vLLM's names; OpenAI's penalties are the first two)
_UNREPRODUCIBLE: dict[str, float] = {
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_p": 0.0,
}


class SamplingError(ValueError):
    """The request's sampling cannot be trained on (the message says which field)."""


def requested_sampling(request: Mapping[str, Any]) -> Sampling:
    """The transform ``request`` samples under; raises ``SamplingError``."""
    for name, neutral in _UNREPRODUCIBLE.items():
        value = request.get(name)
        if value is not None and value != neutral:
            raise SamplingError(
                f"'{name}' = {value!r} changes the sampled distribution in a way the "
                f"trainer cannot score; agl trains under temperature, top_p and top_k "
                f"only (leave '{name}' out or set it to {neutral:g})"
            )
    if request.get("logit_bias"):
        raise SamplingError(
            "'logit_bias' changes the sampled distribution in a way the trainer cannot "
            "score; agl trains under temperature, top_p and top_k only"
        )
    temperature = _number(request, "temperature", 1.0)
    top_p = _number(request, "top_p", 1.0)
    top_k = _number(request, "top_k", 0)
    if top_k != int(top_k):
        raise SamplingError("'top_k' must be an integer")
    try:
        return Sampling(temperature, top_p, max(int(top_k), 0))  # vLLM: -1 is off too
    except ValueError as error:
        raise SamplingError(str(error)) from None


def forwarded_sampling(sampling: Sampling) -> dict[str, Any]:
    """The fields that make an endpoint sample under exactly ``sampling``."""
    fields: dict[str, Any] = {"temperature": sampling.temperature, "top_p": sampling.top_p}
    if sampling.top_k:
        fields["top_k"] = sampling.top_k
    return fields


def sampling_record(sampling: Sampling) -> dict[str, Any]:
    """How a call's sampling is stored with it (``data["sampling"]``)."""
    return {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k}


def sampling_of(data: Mapping[str, Any]) -> Sampling | None:
    """A recorded call's sampling; untransformed for calls recorded before it was
    recorded; None when the record is malformed."""
    record = data.get("sampling")
    if record is None:
        return NO_TRANSFORM
    if not isinstance(record, Mapping):
        return None
    try:
        return Sampling(
            float(record.get("temperature", 1.0)),
            float(record.get("top_p", 1.0)),
            int(record.get("top_k", 0)),
        )
    except (TypeError, ValueError):
        return None


def _number(request: Mapping[str, Any], name: str, default: float) -> float:
    value = request.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise SamplingError(f"'{name}' must be a number")
    return float(value)
