"""Real agent harnesses through the gateway's recording proxy (issue 4).

mini-swe-agent (LiteLLM, LocalEnvironment in a temporary folder) and the OpenAI Agents
SDK (a function tool, OpenAIChatCompletionsModel) each run one short episode against
gateway → model endpoint. Whatever the model says, the gateway must have recorded one
``model_request`` per model call the harness made, with ``response_ids`` that decode to
the text the harness received and one logprob per response token.

The endpoint is the ``served`` fixture: ``UPSTREAM`` picks agl's fake vLLM server or the
embedded inference server on the tiny model (``python -m agl.serve model=tiny``).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agl.core.client import GatewayClient, proxy_base_url
from agl.core.contracts.records import Rollout
from agl.testing.processes import GatewayProcess, gateway_process, serve_process
from tests.helpers.harness_tasks import (
    TASK,
    HarnessRun,
    Received,
    mini_swe_agent_calls,
    mini_swe_agent_env,
    run_openai_agent,
)
from tests.helpers.scripted_answers import scripted_tool_call

UPSTREAM = "tiny"  # "fake": agl.testing.fake_vllm; "tiny": python -m agl.serve model=tiny
SEED = 1234
MAX_TOKENS = 24
STEP_LIMIT = 3
ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Served:
    """A model endpoint and the way back from its token ids to text."""

    base_url: str  # OpenAI base URL, ending in /v1
    model: str
    decode: Callable[[list[int], str | None], str]  # (response_ids, finish_reason) -> text
    state: Any = None  # the fake server's FakeVllm (scripted answers); None for a real one


@contextmanager
def fake_upstream() -> Iterator[Served]:
    """agl's fake vLLM server: tokens are bytes + 16, EOS ends a stopped answer."""
    from agl.testing.fake_vllm import BYTE_OFFSET, serve_in_thread

    def decode(ids: list[int], finish_reason: str | None) -> str:
        return bytes(t - BYTE_OFFSET for t in ids if t >= BYTE_OFFSET).decode()

    with serve_in_thread() as (url, fake):
        yield Served(url, fake.model, decode, fake)


@contextmanager
def tiny_upstream() -> Iterator[Served]:
    """The embedded inference server on the tiny model, as a process."""
    from agl.backends.inference.models import load_model

    tokenizer = load_model("tiny").tokenizer

    def decode(ids: list[int], finish_reason: str | None) -> str:
        # vLLM's convention: the eos that ended the answer is sampled (and recorded)
        # but not text; other special tokens (<tool_call>, ...) are text.
        if ids and ids[-1] == tokenizer.eos_token_id:
            ids = ids[:-1]
        return tokenizer.decode(ids, skip_special_tokens=False)

    with serve_process("tiny") as server:
        yield Served(server.url, server.model, decode)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with {"fake": fake_upstream, "tiny": tiny_upstream}[UPSTREAM]() as endpoint:
        yield endpoint


@pytest.fixture(scope="module")
def harness_gateway(
    tmp_path_factory: pytest.TempPathFactory, served: Served
) -> Iterator[GatewayProcess]:
    with (
        gateway_process(tmp_path_factory.mktemp("gateway")) as gw,
        GatewayClient(gw.url, gw.token) as client,
    ):
        client.register_models([{"model": served.model, "endpoint": served.base_url}])
        yield gw


@pytest.fixture
def admin(harness_gateway: GatewayProcess) -> Iterator[GatewayClient]:
    with GatewayClient(harness_gateway.url, harness_gateway.token) as client:
        yield client


@pytest.fixture
def rollout(admin: GatewayClient) -> Rollout:
    """A fresh running rollout; its record carries the attempt key."""
    rollout_id = f"harness-{uuid.uuid4().hex[:12]}"
    admin.create_rollouts([{"rollout_id": rollout_id, "group_id": "g", "input": {}}])
    return admin.patch_rollout(rollout_id, "running")


def assert_recorded(
    admin: GatewayClient, rollout: Rollout, calls: list[Received], served: Served
) -> None:
    """One model_request per harness call, in order; ids decode to what it received."""
    assert rollout.attempt_key
    failed = admin.get_events(rollout.rollout_id, type="model_request_failed")
    assert failed == [], [e.data for e in failed]
    records = [e.data for e in admin.get_events(rollout.rollout_id, type="model_request")]
    assert len(records) == len(calls) > 0
    for i, (record, got) in enumerate(zip(records, calls, strict=True)):
        where = f"call {i}: {record['response_ids']} / {got}"
        assert all(isinstance(t, int) for t in record["prompt_ids"]) and record["prompt_ids"]
        ids, logprobs = record["response_ids"], record["logprobs"]
        assert len(ids) > 0 and len(logprobs) == len(ids), where
        assert all(math.isfinite(x) and x <= 0 for x in logprobs), where
        if got.finish_reason is not None:
            assert record["finish_reason"] == got.finish_reason, where
        text = served.decode(ids, record["finish_reason"])
        if got.tool_calls:
            assert_tool_calls_in(text, got, where)
        else:
            assert text == (got.content or ""), where
            assert (record["response"] or "") == (got.content or ""), where


def assert_tool_calls_in(text: str, got: Received, where: str) -> None:
    """A tool call is parsed out of the sampled text (and its JSON re-serialized): each
    call's arguments must be a JSON object written in that text, as such or as the
    ``arguments``/``parameters`` of a ``{"name", ...}`` object."""
    written = list(_json_objects(text))
    for call in got.tool_calls:
        arguments = json.loads(call["arguments"])
        named = [
            o.get("arguments", o.get("parameters"))
            for o in written
            if o.get("name") == call["name"]
        ]
        assert arguments in written or arguments in named, where
    prose = (got.content or "").strip()
    assert not prose or prose in text, where


def _json_objects(text: str) -> Iterator[dict[str, Any]]:
    decoder = json.JSONDecoder()
    for start, ch in enumerate(text):
        if ch == "{":
            try:
                obj, _ = decoder.raw_decode(text, start)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict):
                yield obj


def run_mini_swe_agent(
    gateway: GatewayProcess, rollout: Rollout, model: str, tmp_path: Path
) -> tuple[str, list[Received], Path]:
    """mini-swe-agent in its own process; answers its exit status, calls and work folder."""
    workdir = tmp_path / "repo"
    workdir.mkdir()
    spec = {
        "base_url": proxy_base_url(gateway.url, rollout.rollout_id, rollout.attempt),
        "api_key": rollout.attempt_key,
        "model": model,
        "task": TASK,
        "cwd": str(workdir),
        "step_limit": STEP_LIMIT,
        "seed": SEED,
        "max_tokens": MAX_TOKENS,
        "trajectory": str(tmp_path / "trajectory.json"),
        "result": str(tmp_path / "result.json"),
    }
    done = subprocess.run(
        [sys.executable, "-m", "tests.helpers.harness_tasks", "mini_swe_agent", json.dumps(spec)],
        cwd=ROOT,
        env={**os.environ, **mini_swe_agent_env(tmp_path / "mswea")},
        stdin=subprocess.DEVNULL,  # nothing may wait for a user
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    exit_status = json.loads(Path(spec["result"]).read_text())["exit_status"]
    trajectory = json.loads(Path(spec["trajectory"]).read_text())
    calls = mini_swe_agent_calls(trajectory)
    assert len(calls) == trajectory["info"]["model_stats"]["api_calls"] <= STEP_LIMIT
    return exit_status, calls, workdir


@pytest.mark.slow
def test_mini_swe_agent(
    harness_gateway: GatewayProcess,
    admin: GatewayClient,
    rollout: Rollout,
    served: Served,
    tmp_path: Path,
) -> None:
    exit_status, calls, _ = run_mini_swe_agent(harness_gateway, rollout, served.model, tmp_path)
    # A gibberish model ends by the step limit or by repeated format errors (no tool
    # call); a lucky one by submitting. Never by an exception.
    assert exit_status in {"LimitsExceeded", "RepeatedFormatError", "Submitted"}
    assert_recorded(admin, rollout, calls, served)


@pytest.mark.slow
def test_mini_swe_agent_runs_tool_calls(tmp_path: Path) -> None:
    """On a scripted fake endpoint that does call the bash tool, mini-swe-agent runs the
    command, sends back its assistant turn and the tool's result through the proxy, and
    submits: the tool round trip of a real harness, whatever the served model."""
    with (
        fake_upstream() as endpoint,
        gateway_process(tmp_path / "gateway") as gateway,
        GatewayClient(gateway.url, gateway.token) as admin,
    ):
        fake = endpoint.state
        admin.register_models([{"model": endpoint.model, "endpoint": endpoint.base_url}])
        admin.create_rollouts([{"rollout_id": "scripted", "group_id": "g", "input": {}}])
        rollout = admin.patch_rollout("scripted", "running")
        fake.raw_next = [
            scripted_tool_call("Writing it.", "printf hi > hello.txt", "call_1"),
            scripted_tool_call("", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT", "call_2"),
        ]
        exit_status, calls, workdir = run_mini_swe_agent(gateway, rollout, endpoint.model, tmp_path)
        assert exit_status == "Submitted"
        assert (workdir / "hello.txt").read_text() == "hi"
        assert [c.tool_calls[0]["name"] for c in calls] == ["bash", "bash"]
        assert_recorded(admin, rollout, calls, endpoint)
        first, second = (e.data for e in admin.get_events("scripted", type="model_request"))
        assistant, tool = second["messages"][-2:]
        assert assistant["role"] == "assistant" and assistant["content"] == "Writing it."
        assert assistant["tool_calls"][0]["id"] == "call_1"
        assert (tool["role"], tool["tool_call_id"]) == ("tool", "call_1")
        assert second["messages"][:-2] == first["messages"]
        assert first["tools"][0]["function"]["name"] == "bash"


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_openai_agents_sdk(
    harness_gateway: GatewayProcess,
    admin: GatewayClient,
    rollout: Rollout,
    served: Served,
    stream: bool,
) -> None:
    run: HarnessRun = asyncio.run(
        run_openai_agent(
            proxy_base_url(harness_gateway.url, rollout.rollout_id, rollout.attempt),
            rollout.attempt_key or "",
            served.model,
            # The fake server answers a user turn that starts with "use-tool" with a call
            # of the first tool, so the SDK's tool round trip runs on it too.
            "use-tool agl",
            seed=SEED,
            max_tokens=MAX_TOKENS,
            stream=stream,
        )
    )
    assert run.exit_status in {"final_output", "max_turns"}
    assert len(run.calls) == run.http_calls == run.sdk_calls
    assert_recorded(admin, rollout, run.calls, served)
