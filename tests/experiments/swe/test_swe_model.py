"""mini-swe-agent's text-based model at the attempt's proxy, without litellm
(``experiments/swe/model.py``): through the real gateway to a scripted upstream, with
mini-swe-agent's own parsing and format errors."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from minisweagent.exceptions import FormatError
from minisweagent.models import get_model
from minisweagent.models.openrouter_model import OpenRouterAPIError

from agl.core.client import GatewayClient
from agl.core.contracts.records import Rollout
from agl.testing.fake_vllm import FakeVllm
from agl.testing.processes import GatewayProcess
from experiments.swe.harness import config_file
from experiments.swe.model import CONTEXT_LIMIT_EXCEEDED
from tests.conftest import base_url
from tests.helpers.tiny_gateway import Tiny, start, tiny, tiny_admin  # noqa: F401

ROOT = Path(__file__).resolve().parents[3]
BLOCK = "THOUGHT: look first.\n\n```mswea_bash_command\ngrep -rn 'def take(' .\n```"


def _model(url: str, key: str, **options: Any) -> Any:
    """The model as the harness builds it: mini.yaml's model part, the attempt's values."""
    config = yaml.safe_load(config_file({}).read_text())["model"]
    config["model_kwargs"] |= {"api_base": url, "api_key": key, **options}
    return get_model(config=config)


def test_a_reply_reaches_the_agent_as_mini_parses_it(
    gateway: GatewayProcess, fake: FakeVllm, running: Callable[..., Rollout]
) -> None:
    rollout = running()
    fake.script = lambda messages: BLOCK
    model = _model(base_url(gateway, rollout), rollout.attempt_key or "", temperature=0.5)
    message = model.query([{"role": "user", "content": "fix the bug"}])
    assert message["content"] == BLOCK
    assert message["extra"]["actions"] == [{"command": "grep -rn 'def take(' ."}]
    sent = fake.requests[-1]
    assert sent["temperature"] == 0.5 and sent["messages"][-1]["content"] == "fix the bug"
    # litellm's own options and OpenRouter's extras never reach the wire
    assert not {"drop_params", "num_retries", "usage", "timeout"} & set(sent)


def test_a_malformed_reply_is_minis_format_error(
    gateway: GatewayProcess, fake: FakeVllm, running: Callable[..., Rollout]
) -> None:
    rollout = running()
    fake.script = lambda messages: "I would grep for it."
    model = _model(base_url(gateway, rollout), rollout.attempt_key or "")
    with pytest.raises(FormatError) as raised:
        model.query([{"role": "user", "content": "fix the bug"}])
    # mini.yaml's format error text, which the agent sends back as the next user turn
    assert "Reply with a short THOUGHT" in raised.value.messages[0]["content"]


def test_a_refused_call_is_an_error_not_a_reply(
    gateway: GatewayProcess, running: Callable[..., Rollout], monkeypatch: pytest.MonkeyPatch
) -> None:
    # as the harness runs it (MSWEA_ENV): one try, not mini's ten with back-off (~4 min)
    monkeypatch.setenv("MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT", "1")
    rollout = running()
    model = _model(base_url(gateway, rollout), "not-the-attempts-key")
    with pytest.raises(OpenRouterAPIError, match="HTTP 401"):
        model.query([{"role": "user", "content": "fix the bug"}])


def test_a_conversation_past_the_context_ends_the_attempt_as_minis_limits_do(
    tiny: Tiny,  # noqa: F811
    tiny_admin: GatewayClient,  # noqa: F811
) -> None:
    from minisweagent.agents import get_agent
    from minisweagent.environments.local import LocalEnvironment

    rollout = start(tiny_admin)
    config = yaml.safe_load(config_file({"config": "mini_cpu.yaml"}).read_text())
    config["model"]["model_name"] = tiny.model
    config["model"]["model_kwargs"] |= {
        "api_base": base_url(tiny.gateway, rollout),
        "api_key": rollout.attempt_key or "",
    }
    agent = get_agent(
        get_model(config=config["model"]),
        LocalEnvironment(),
        config["agent"],
        default_type="default",
    )
    # the embedded engine's context is 1,024 tokens here: the first call does not fit
    result = agent.run("the bug is in take " * 400)
    assert result["exit_status"] == CONTEXT_LIMIT_EXCEEDED
    assert agent.messages[-1]["role"] == "exit"


def test_without_the_proxys_address_it_says_so() -> None:
    with pytest.raises(ValueError, match="api_base"):
        get_model(
            config={
                "model_class": "experiments.swe.model.ProxyTextbasedModel",
                "model_name": "openai/policy",
            }
        )


def test_the_harness_imports_no_litellm() -> None:
    code = (
        "import sys, experiments.swe.harness as h, experiments.swe.model, "
        "minisweagent.agents.default, minisweagent.environments;"
        "print('litellm' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,  # experiments/ is imported from the checkout, not installed
        env={"MSWEA_SILENT_STARTUP": "1", "PATH": "/usr/bin:/bin"},
    )
    assert done.stdout.strip().splitlines()[-1] == "False"


def test_the_tasks_sampling_reaches_every_call_of_the_attempt(tmp_path: Path) -> None:
    from agl.agent import AgentContext
    from experiments.swe.harness import attempt_config

    agent = AgentContext("http://127.0.0.1:1", "r1", 0, "train", "policy", "key", {})
    row = {"mirror": str(tmp_path), "temperature": 0.7, "top_p": 0.9, "max_tokens": 320}
    kwargs = attempt_config(agent, row, tmp_path / "w", None)["model"]["model_kwargs"]
    assert (kwargs["temperature"], kwargs["top_p"], kwargs["max_tokens"]) == (0.7, 0.9, 320)
    assert (
        "top_p"
        not in attempt_config(agent, {"mirror": "m"}, tmp_path, None)["model"]["model_kwargs"]
    )
