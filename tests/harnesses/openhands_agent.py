"""OpenHands (the ``openhands-sdk`` agent) on one task, for tests/harnesses/test_real_harnesses.py.

The SDK needs Python >= 3.12 and agl supports 3.11, so this runs in the venv that
``install.sh`` makes: ``tests/harnesses/.venv/bin/python openhands_agent.py SPEC_JSON``.

SPEC: ``base_url``, ``api_key``, ``model``, ``task``, ``workspace``, ``max_iterations``,
``max_tokens``, ``seed``, ``result``. The result file gets the conversation's final status,
the error codes it emitted, the assistant texts the agent got back and the number of LLM
calls its own metrics counted.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from openhands.sdk import LLM, Agent, Conversation, Event, MessageEvent
from openhands.sdk.event import ActionEvent
from openhands.sdk.event.conversation_error import ConversationErrorEvent
from pydantic import SecretStr


def main(spec: dict[str, Any]) -> None:
    llm = LLM(
        # LiteLLM's "openai/" prefix: any OpenAI-compatible endpoint at base_url.
        model=f"openai/{spec['model']}",
        base_url=spec["base_url"],
        api_key=SecretStr(spec["api_key"]),
        max_output_tokens=spec["max_tokens"],
        seed=spec["seed"],
        num_retries=0,  # a failed call must show, not be retried with back-off
        usage_id="agent",
    )
    events: list[Event] = []
    conversation = Conversation(
        agent=Agent(llm=llm, tools=[]),  # the SDK's own tools only: finish and think
        workspace=spec["workspace"],
        max_iteration_per_run=spec["max_iterations"],
        callbacks=[events.append],
        visualizer=None,
    )
    conversation.send_message(spec["task"])
    conversation.run()
    texts = [
        content.text
        for event in events
        if isinstance(event, MessageEvent) and event.source == "agent"
        for content in event.llm_message.content
        if hasattr(content, "text")
    ] + [
        content.text
        for event in events
        if isinstance(event, ActionEvent)
        for content in event.thought
    ]
    metrics = conversation.conversation_stats.get_combined_metrics()
    result = {
        "status": conversation.state.execution_status.value,
        "errors": [e.code for e in events if isinstance(e, ConversationErrorEvent)],
        "texts": texts,
        "llm_calls": len(metrics.response_latencies),
    }
    Path(spec["result"]).write_text(json.dumps(result))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
