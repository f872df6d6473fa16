"""The gateway's URL paths: the per-attempt proxy (one per API a harness may speak) and
the events route, as the routes declare them and the fast lane matches them."""

from __future__ import annotations

import re

from agl.core.gateway.dialects import ANTHROPIC, RESPONSES, Dialect

PROXY = "/proxy/rollout/{rollout_id}/attempt/{attempt}/mode/{mode}"
PROXY_CHAT = PROXY + "/openai/v1/chat/completions"
PROXY_COMPLETIONS = PROXY + "/openai/v1/completions"
PROXY_RESPONSES = PROXY + "/openai/v1/responses"
PROXY_MESSAGES = PROXY + "/anthropic/v1/messages"
PROXY_COUNT_TOKENS = PROXY_MESSAGES + "/count_tokens"
EVENTS = "/api/rollouts/{rollout_id}/attempt/{attempt}/events"
# The API a harness speaks, by the proxy path's tail: None is chat completions itself.
DIALECTS: dict[str, Dialect | None] = {
    "openai/v1/chat/completions": None,
    "openai/v1/responses": RESPONSES,
    "anthropic/v1/messages": ANTHROPIC,
}
COMPLETIONS_TAIL = "openai/v1/completions"  # text completions: no dialect, its own handler
PROXY_CALL = re.compile(
    r"^/proxy/rollout/([^/]+)/attempt/(\d+)/mode/([^/]+)/("
    + "|".join(re.escape(tail) for tail in [*DIALECTS, COMPLETIONS_TAIL])
    + ")$"
)
EVENTS_PATH = re.compile(r"^/api/rollouts/([^/]+)/attempt/(\d+)/events$")
