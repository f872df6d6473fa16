"""Other model APIs over chat completions: each dialect turns its request into one chat
completions request and the chat answer (whole, or a stream of chunks) back into its own
answer, so a harness that speaks it can use the recording proxy.

- :data:`RESPONSES`: OpenAI's Responses API (``POST /v1/responses``; Codex CLI).
- :data:`ANTHROPIC`: Anthropic's Messages API (``POST /v1/messages``; Claude Code).

No I/O but a log line, no state between calls (a stream translator holds one answer's).
"""

from __future__ import annotations

from agl.core.gateway.dialects._base import Dialect, DialectError, StreamTranslator
from agl.core.gateway.dialects.anthropic import ANTHROPIC
from agl.core.gateway.dialects.responses import RESPONSES

__all__ = ["ANTHROPIC", "RESPONSES", "Dialect", "DialectError", "StreamTranslator"]
