"""Whether a recorded call can be trained on: what the proxy stores with a call it cannot
be (``data["invalid"]``, the reason) and what the trainer checks again before it reads one
(``agl.core.trainer.calls``). A contract, so that the gateway and the trainer hold the
same rule without either importing the other.

A call is unusable when its endpoint returned no token ids, ids that are not token ids,
logprobs that do not line up with the response or are not finite, or sampling fields the
trainer cannot score under. Whether its ids decode to the text the harness received needs
the tokenizer: the trainer checks that (``text_mismatch``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from agl.core.contracts.sampling import sampling_of

# Token ids above this are not ids of any vocabulary (and overflow int32 tensors).
MAX_TOKEN_ID = 2**31 - 1
# A logprob is <= 0; rounding in an engine's float16/32 path may leave it barely above.
_LOGPROB_SLACK = 1e-3


def invalid_reason(data: object, prompt_checked: bool = False) -> str | None:
    """Why a ``model_request`` event's data cannot be trained on, or None if it can.
    ``prompt_checked``: the caller found the call's prompt ids valid already (the
    recording proxy, whose ``prompt_ids`` may hold only those after an earlier call's)."""
    if not isinstance(data, Mapping):
        return "not_an_object"
    for name in ("response_ids",) if prompt_checked else ("prompt_ids", "response_ids"):
        ids = data.get(name)
        if not ids:
            return f"no_{name}"
        if not token_ids(ids):
            return f"bad_{name}"
    logprobs = data.get("logprobs")
    if not isinstance(logprobs, list) or len(logprobs) != len(data["response_ids"]):
        return "logprobs_length"
    if not all(_is_logprob(x) for x in logprobs):
        return "bad_logprobs"
    version = data.get("policy_version", 0)
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        return "bad_policy_version"
    if sampling_of(data) is None:
        return "bad_sampling"
    choice = data.get("choice", 0)
    if not isinstance(choice, int) or isinstance(choice, bool) or choice < 0:
        return "bad_choice"
    return None


def token_ids(ids: object) -> bool:
    """Whether ``ids`` is a list of token ids, checked at C speed (a prompt has tens of
    thousands): ``type`` is exact, so a bool (an int subclass) is refused."""
    if not isinstance(ids, list):
        return False
    if not ids:
        return True
    return set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) <= MAX_TOKEN_ID


def _is_logprob(value: object) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value <= _LOGPROB_SLACK
    )
