"""mini-swe-agent's own text-based model, sent to the attempt's proxy without litellm.

``mini.yaml`` names this class as its ``model_class``, as it names agl's sandbox as its
``environment_class``: both are mini-swe-agent's extension points, and its agent, its
action regex, its format errors and its observation messages stay its own.

Why not ``litellm_textbased``: importing litellm costs ~3.9 s of CPU a process (measured
2026-12-07 with the harness's ``MSWEA_*``/``LITELLM_*`` settings; plain ``requests``
0.3 s), and a command harness pays it every attempt: on two cores, more than a tiny
model's whole rollout. ``openrouter_textbased`` is the same text-based model over plain
``requests``, but posts to OpenRouter's address with OpenRouter's extras. This is it with
the proxy's address, key and timeout taken from ``model_kwargs`` (``api_base``,
``api_key``, ``timeout``: the keys litellm takes) and a plain chat-completions request.

A conversation that outgrows the model's context (the endpoint's 400, as vLLM and the
embedded engine word it) ends the attempt as mini-swe-agent's own limits do
(``LimitsExceeded``, exit status ``ContextLimitExceeded``): the harness exits cleanly and
the checkout is graded as it stands. As a harness failure it would be left out of
training and validation, and the rollouts that ramble longest (a policy's worst) would
never count against it.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

import requests
from minisweagent.exceptions import LimitsExceeded
from minisweagent.models.openrouter_model import OpenRouterAPIError
from minisweagent.models.openrouter_textbased_model import OpenRouterTextbasedModel

# litellm's own options, meaningless to a plain request
_LITELLM_ONLY = ("drop_params", "num_retries")
_PROVIDER = "openai/"  # litellm's provider prefix, which mini's configs carry
CONTEXT_FULL = "maximum context length"  # in the 400 of vLLM, OpenAI and agl's engine
CONTEXT_LIMIT_EXCEEDED = "ContextLimitExceeded"  # the attempt's exit status then


class ProxyTextbasedModel(OpenRouterTextbasedModel):
    """``openrouter_textbased`` pointed at an OpenAI-compatible ``api_base``."""

    abort_exceptions: ClassVar = [*OpenRouterTextbasedModel.abort_exceptions, LimitsExceeded]

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        options = dict(self.config.model_kwargs)
        base = options.pop("api_base", None)
        if not base:
            raise ValueError("ProxyTextbasedModel needs model_kwargs.api_base (the proxy's URL)")
        self._api_url = str(base).rstrip("/") + "/chat/completions"
        self._api_key = str(options.pop("api_key", ""))
        self._timeout = float(options.pop("timeout", 60))
        for key in _LITELLM_ONLY:
            options.pop(key, None)
        self.config.model_kwargs = options
        self._model = self.config.model_name.removeprefix(_PROVIDER)

    def _query(self, messages: list[dict[str, str]], **kwargs: Any) -> dict[str, Any]:
        payload = {"model": self._model, "messages": messages, **self.config.model_kwargs, **kwargs}
        headers = {"Authorization": f"Bearer {self._api_key}", "Content-Type": "application/json"}
        try:
            response = requests.post(
                self._api_url, headers=headers, data=json.dumps(payload), timeout=self._timeout
            )
        except requests.exceptions.RequestException as error:
            raise OpenRouterAPIError(f"request failed: {error}") from error
        if response.status_code == 400 and CONTEXT_FULL in response.text:
            status = CONTEXT_LIMIT_EXCEEDED
            extra = {"exit_status": status, "submission": ""}
            raise LimitsExceeded({"role": "exit", "content": status, "extra": extra})
        if response.status_code >= 400:
            raise OpenRouterAPIError(f"HTTP {response.status_code}: {response.text[:2000]}")
        answer: dict[str, Any] = response.json()
        return answer
