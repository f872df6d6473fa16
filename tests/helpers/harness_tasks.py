"""Real agent harnesses pointed at the gateway's proxy, for tests/harnesses/test_harnesses.py.

Each runner drives a harness the way its users do and reports, per model call, what the
harness itself received: the assistant text and tool calls. The test compares that with
what the gateway recorded.

mini-swe-agent runs in a child process (``python -m tests.helpers.harness_tasks mini_swe_agent
SPEC_JSON``): it reads environment variables and writes a config folder at import time,
and LiteLLM patches logging and takes seconds to import, none of which should leak into
the test process. The OpenAI Agents SDK runs in the test process.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TASK = "Create a file hello.txt containing the word hi."

# mini.yaml's task prompt is ~1700 tokens of the tiny model (2048 of context): three calls
# with two format-error turns would not fit. This one keeps its rules, briefly.
MINI_INSTANCE_TEMPLATE = """Please solve this task: {{task}}

Every response must contain a short reasoning text and exactly one call of the bash tool.
Each command runs in a new subshell of the task's folder.
When you are done, submit by running this command alone:
`echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`
"""


@dataclass
class Received:
    """What the harness got back from one model call."""

    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class HarnessRun:
    exit_status: str  # the harness's own word for how the run ended
    calls: list[Received]  # one per model call, in order
    http_calls: int = -1  # chat requests the harness sent on the wire (-1: not counted)
    sdk_calls: int = -1  # model calls the harness's own bookkeeping reports


# --- mini-swe-agent ----------------------------------------------------------------------


def mini_swe_agent_env(config_dir: Path) -> dict[str, str]:
    """The environment mini-swe-agent needs to run unattended and offline."""
    return {
        "MSWEA_GLOBAL_CONFIG_DIR": str(config_dir),  # not ~/.config/mini-swe-agent
        "MSWEA_SILENT_STARTUP": "1",
        "MSWEA_COST_TRACKING": "ignore_errors",  # a local model has no price
        "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "1",  # a failed call fails the run, no retry
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no download of the price list at import
    }


def run_mini_swe_agent(spec: dict[str, Any]) -> dict[str, Any]:
    """mini-swe-agent's DefaultAgent (not the interactive one: it never asks the user
    anything) with its LiteLLM tool-calling model and a LocalEnvironment in ``cwd``, on the
    `mini` command's own config (mini.yaml) but a shorter task prompt; step limit and
    model settings from ``spec``."""
    import litellm
    import yaml
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.config import builtin_config_dir
    from minisweagent.environments.local import LocalEnvironment
    from minisweagent.models.litellm_model import LitellmModel

    litellm.suppress_debug_info = True  # else it prints a provider list per unpriced call
    config = yaml.safe_load((builtin_config_dir / "mini.yaml").read_text())
    # `mode` (confirm/yolo) belongs to the interactive agent, which waits for a user.
    agent_config = {k: v for k, v in config["agent"].items() if k != "mode"}
    agent_config |= {
        "instance_template": MINI_INSTANCE_TEMPLATE,
        "step_limit": spec["step_limit"],
        "cost_limit": 0,
        "wall_time_limit_seconds": 120,
        "output_path": Path(spec["trajectory"]),
    }
    model = LitellmModel(
        # LiteLLM: the "openai/" prefix selects its OpenAI-compatible client; the rest is
        # the model name sent on the wire.
        model_name=f"openai/{spec['model']}",
        model_kwargs={
            **config["model"]["model_kwargs"],
            "api_base": spec["base_url"],
            "api_key": spec["api_key"],
            "seed": spec["seed"],
            "temperature": 1.0,
            "max_tokens": spec["max_tokens"],
            "num_retries": 0,
            "timeout": 60,
        },
        cost_tracking="ignore_errors",
        observation_template=config["model"]["observation_template"],
        format_error_template=config["model"]["format_error_template"],
    )
    timeout = spec.get("command_timeout_s", 10)
    env = LocalEnvironment(cwd=spec["cwd"], timeout=timeout, **config["environment"])
    agent = DefaultAgent(model, env, **agent_config)
    result = agent.run(spec["task"])
    return {"exit_status": result.get("exit_status"), "trajectory": spec["trajectory"]}


def mini_swe_agent_calls(trajectory: dict[str, Any]) -> list[Received]:
    """The model calls of a mini-swe-agent trajectory. Each call leaves its LiteLLM
    response in a message's ``extra.response``: the assistant message, or, when the
    output could not be parsed (no tool call), the format-error message that replaced it."""
    calls = []
    for message in trajectory["messages"]:
        response = (message.get("extra") or {}).get("response")
        if not isinstance(response, dict):
            continue
        (choice,) = response["choices"]
        calls.append(
            Received(
                choice["message"].get("content"),
                [
                    {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                    for c in choice["message"].get("tool_calls") or ()
                ],
                choice.get("finish_reason"),
            )
        )
    return calls


# --- OpenAI Agents SDK -------------------------------------------------------------------


async def run_openai_agent(
    base_url: str,
    api_key: str,
    model: str,
    prompt: str,
    seed: int,
    max_tokens: int,
    stream: bool = False,
) -> HarnessRun:
    """An Agent with one function tool on OpenAIChatCompletionsModel; at most 3 turns,
    run with ``Runner.run`` or, ``stream``ing, ``Runner.run_streamed``. MaxTurnsExceeded
    is a normal end for a model that keeps calling tools.

    ``calls``: unary, the chat completions as they came off the wire to the SDK's client;
    streamed, each call's answer as the SDK assembled it from the chunks. ``sdk_calls``
    counts the model calls the SDK itself reports (its ``on_llm_end`` hook)."""
    import httpx2
    from agents import (
        Agent,
        MaxTurnsExceeded,
        ModelSettings,
        OpenAIChatCompletionsModel,
        RunHooks,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)

    @function_tool
    def lookup(query: str) -> str:
        """Look up a word in the project glossary."""
        return f"{query}: a testbed for harnessed agentic RL"

    sdk_calls: list[Any] = []

    class Record(RunHooks):
        async def on_llm_end(self, context: Any, agent: Any, response: Any) -> None:
            sdk_calls.append(response)

    received: list[Received] = []
    http_calls = 0

    async def on_request(request: httpx2.Request) -> None:
        nonlocal http_calls
        if request.url.path.endswith("/chat/completions"):
            http_calls += 1

    async def on_response(response: httpx2.Response) -> None:
        if stream or not response.request.url.path.endswith("/chat/completions"):
            return
        if response.is_success:
            await response.aread()
            (choice,) = response.json()["choices"]
            received.append(
                Received(
                    choice["message"].get("content"),
                    [
                        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                        for c in choice["message"].get("tool_calls") or ()
                    ],
                    choice.get("finish_reason"),
                )
            )

    hooks = {"request": [on_request], "response": [on_response]}
    async with (
        httpx2.AsyncClient(event_hooks=hooks, timeout=60) as http,
        AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=http) as client,
    ):
        agent = Agent(
            name="glossary",
            instructions="Answer briefly. Use the lookup tool for words you do not know.",
            tools=[lookup],
            model=OpenAIChatCompletionsModel(model=model, openai_client=client),
            model_settings=ModelSettings(
                temperature=1.0,
                max_tokens=max_tokens,
                tool_choice="auto",
                parallel_tool_calls=False,
                extra_args={"seed": seed},
            ),
        )
        try:
            if stream:
                result = Runner.run_streamed(agent, prompt, max_turns=3, hooks=Record())
                async for _ in result.stream_events():
                    pass
            else:
                await Runner.run(agent, prompt, max_turns=3, hooks=Record())
            status = "final_output"
        except MaxTurnsExceeded:
            status = "max_turns"
    if stream:
        received = [_sdk_received(response) for response in sdk_calls]
    return HarnessRun(status, received, http_calls, len(sdk_calls))


def _sdk_received(response: Any) -> Received:
    """The text and tool calls of the SDK's ModelResponse (Responses-shaped items)."""
    texts: list[str] = []
    tool_calls = []
    for item in response.output:
        if item.type == "message":
            texts += [part.text for part in item.content if part.type == "output_text"]
        elif item.type == "function_call":
            tool_calls.append({"name": item.name, "arguments": item.arguments})
    return Received("".join(texts) if texts else None, tool_calls)


if __name__ == "__main__":
    name, spec_json = sys.argv[1:]
    assert name == "mini_swe_agent", name
    out = run_mini_swe_agent(json.loads(spec_json))
    Path(json.loads(spec_json)["result"]).write_text(json.dumps(out))
    sys.exit(0)
