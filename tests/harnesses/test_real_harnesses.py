"""Real agent harnesses, run as their users run them, through the gateway's recording
proxy (issue 10): Codex CLI (the Responses API), Claude Code (the Anthropic Messages API),
OpenCode and Qwen Code (chat completions, streamed) and OpenHands (chat completions, via
LiteLLM), each on a small task in a temporary folder, against the gateway and the
embedded inference server on the tiny model.

The tiny model writes gibberish, so the harnesses' work fails; the plumbing is what is
tested. Each test asserts that

- the harness exits: its own exit status, or a clean stop at its step limit;
- the gateway recorded one ``model_request`` per model call the harness made. The calls
  are counted on the wire, by a relay between harness and gateway that passes every byte
  through as it comes (and, where the harness reports it, by the harness itself);
- the recorded ``response_ids`` decode to what the harness received: each answer, in the
  harness's own API, as the relay saw it, is explained by one record's decoded text, and
  the assistant text the harness itself reports is in those decoded texts.

The binaries come from ``tests/harnesses/install.sh`` (pinned npm packages, and a Python
3.12 venv for OpenHands); a harness that is not installed is skipped, naming it. Each
harness gets a fresh HOME and only the environment it needs, so no key or setting of the
developer's leaks in; telemetry, update checks and the like are switched off where the
harness allows it (what is left fails quietly: nothing outside is reachable in CI).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import math
import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

from agl.core.client import GatewayClient, proxy_base_url
from agl.core.contracts.records import Rollout
from agl.testing.processes import GatewayProcess, gateway_process, serve_process
from tests.conftest import vllm_text

ROOT = Path(__file__).resolve().parents[2]
HARNESSES = ROOT / "tests" / "harnesses"
BIN = HARNESSES / "node_modules" / ".bin"
OPENHANDS_PYTHON = HARNESSES / ".venv" / "bin" / "python"
INSTALL = "tests/harnesses/install.sh"

TASK = "Create a file hello.txt containing the word hi."
# The harnesses' prompts in tokens of the tiny model (a byte-level BPE of 1536 tokens, ~2
# characters a token): Codex ~28.4k (0.171), Qwen Code ~28k, OpenCode ~14k, OpenHands ~9k,
# Claude Code ~6k (four tools). The tiny model's own 2048 holds none of them; its rotary
# positions go further, at a quadratic prefill (~8 CPU seconds for 28k tokens, one thread).
# Codex sets no answer cap: the near-uniform tiny model stops at its eos after ~1.5k
# tokens on average (geometric; ~6 ms of CPU each at 28k of context), and an answer that
# fills the ~4.3k left here ends `incomplete`, which Codex fails its turn on.
MAX_CONTEXT = 32768
MAX_TOKENS = 256  # the answer cap given to each harness that lets one be set
MAX_TURNS = 2
SEED = 1234
TIMEOUT_S = 200  # per harness run

# The model APIs, by the tail of the proxy path; the record's "api" names the non-chat ones.
API_TAILS = {
    "/openai/v1/chat/completions": "chat",
    "/openai/v1/responses": "responses",
    "/anthropic/v1/messages": "anthropic",
}
COUNT_TOKENS = "/anthropic/v1/messages/count_tokens"  # not a model call: not recorded

# --- the model server and the gateway ------------------------------------------------


@dataclass(frozen=True)
class Served:
    url: str  # OpenAI base URL, ending in /v1
    model: str
    tokenizer: Any

    def decode(self, record: dict[str, Any]) -> str:
        """A record's text under the rule it records, as vLLM makes it."""
        skip = record["text_rule"]["skip_special_tokens"]
        return vllm_text(self.tokenizer, record["response_ids"], skip)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    from agl.backends.inference.models import load_model

    tokenizer = load_model("tiny").tokenizer
    with serve_process("tiny", max_context=MAX_CONTEXT) as server:
        yield Served(server.url, server.model, tokenizer)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, served: Served) -> Iterator[GatewayProcess]:
    with (
        gateway_process(tmp_path_factory.mktemp("gateway")) as gw,
        GatewayClient(gw.url, gw.token) as client,
    ):
        # One model registered: any model name a harness sends is routed to it.
        client.register_models([{"model": served.model, "endpoint": served.url}])
        yield gw


@pytest.fixture
def admin(gateway: GatewayProcess) -> Iterator[GatewayClient]:
    with GatewayClient(gateway.url, gateway.token) as client:
        yield client


@pytest.fixture
def rollout(admin: GatewayClient) -> Rollout:
    rollout_id = f"harness-{uuid.uuid4().hex[:12]}"
    admin.create_rollouts([{"rollout_id": rollout_id, "group_id": "g", "input": {}}])
    record = admin.patch_rollout(rollout_id, "running")
    assert record.attempt_key
    return record


# --- the relay that watches the wire ---------------------------------------------------


@dataclass(frozen=True)
class Exchange:
    """One HTTP request a harness sent, and the response body bytes it was sent back."""

    method: str
    path: str
    status: int
    request: bytes
    response: bytes

    @property
    def api(self) -> str | None:
        """The model API this request calls; None for anything else."""
        if self.method != "POST":
            return None
        return next((api for tail, api in API_TAILS.items() if self.path.endswith(tail)), None)


# Hop-by-hop headers, and those the relay's own HTTP stack sets.
_NOT_RELAYED = {
    "host",
    "connection",
    "keep-alive",
    "content-length",
    "transfer-encoding",
    "accept-encoding",
    "content-encoding",
}


class WireTap:
    """An HTTP relay in front of the gateway, in a thread of the test process. It passes
    requests and response bytes through as they come (streams stay streams) and keeps
    every exchange, so a test sees what the harness sent and received on the wire."""

    _session: ClientSession  # made on the relay's own event loop

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.url = ""
        self._exchanges: list[Exchange] = []
        self._in_flight = 0
        self._lock = threading.Lock()

    async def _relay(self, request: web.Request) -> web.StreamResponse:
        with self._lock:
            self._in_flight += 1
        body = await request.read()
        status, sent = 502, bytearray()  # 502 stays if the gateway cannot be reached
        try:
            headers = {k: v for k, v in request.headers.items() if k.lower() not in _NOT_RELAYED}
            async with self._session.request(
                request.method, self.upstream + request.raw_path, data=body, headers=headers
            ) as upstream:
                status = upstream.status
                response = web.StreamResponse(
                    status=status,
                    headers={
                        k: v for k, v in upstream.headers.items() if k.lower() not in _NOT_RELAYED
                    },
                )
                await response.prepare(request)
                try:
                    async for chunk in upstream.content.iter_any():
                        await response.write(chunk)
                        sent += chunk
                    await response.write_eof()
                except ConnectionError:
                    # The harness hung up; Codex does once it has the response.completed
                    # event. Leaving the block closes the gateway's side too, as it would be.
                    pass
                return response
        finally:
            exchange = Exchange(request.method, request.path, status, body, bytes(sent))
            with self._lock:
                self._exchanges.append(exchange)
                self._in_flight -= 1

    def exchanges(self, rollout_id: str, settle_s: float = 10.0) -> list[Exchange]:
        """The exchanges of one rollout's proxy path, once none is in flight (a harness
        that hangs up may exit before the relay has noticed)."""
        deadline = time.monotonic() + settle_s
        while self._in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        with self._lock:
            return [e for e in self._exchanges if f"/proxy/rollout/{rollout_id}/" in e.path]

    @contextlib.contextmanager
    def running(self) -> Iterator[WireTap]:
        loop = asyncio.new_event_loop()
        holder: dict[str, web.AppRunner] = {}

        async def start() -> None:
            # No total timeout: a long prompt's prefill takes its time on 2 cores.
            self._session = ClientSession(
                connector=TCPConnector(limit=0), timeout=ClientTimeout(total=None)
            )
            app = web.Application(client_max_size=1 << 30)
            app.router.add_route("*", "/{tail:.*}", self._relay)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            holder["runner"] = runner
            self.url = f"http://127.0.0.1:{runner.addresses[0][1]}"

        async def stop() -> None:
            await holder["runner"].cleanup()
            await self._session.close()

        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=10)
        try:
            yield self
        finally:
            asyncio.run_coroutine_threadsafe(stop(), loop).result(timeout=10)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)
            loop.close()


@pytest.fixture(scope="module")
def tap(gateway: GatewayProcess) -> Iterator[WireTap]:
    with WireTap(gateway.url).running() as relay:
        yield relay


@dataclass(frozen=True)
class Attempt:
    """Where a harness calls the model for one attempt (through the relay), with what key."""

    rollout: Rollout
    openai: str  # the OpenAI base URL (…/openai/v1)
    anthropic: str  # the Anthropic base URL (…/anthropic)
    key: str


@pytest.fixture
def attempt(tap: WireTap, rollout: Rollout) -> Attempt:
    openai = proxy_base_url(tap.url, rollout.rollout_id, rollout.attempt, rollout.mode)
    anthropic = openai.removesuffix("/openai/v1") + "/anthropic"
    return Attempt(rollout, openai, anthropic, rollout.attempt_key or "")


# --- what the harness received, in its own API ---------------------------------------


@dataclass(frozen=True)
class Answer:
    text: str
    tool_calls: list[tuple[str, Any]] = field(default_factory=list)  # (name, arguments)
    finish_reason: str | None = None  # chat completions only: the other APIs say it their way


def answer_of(exchange: Exchange) -> Answer:
    streamed = bool(json.loads(exchange.request).get("stream"))
    events = (
        [
            json.loads(line[5:])
            for line in exchange.response.decode().splitlines()
            if line.startswith("data:") and line.strip() != "data: [DONE]"
        ]
        if streamed
        else [json.loads(exchange.response)]
    )
    if exchange.api == "responses":
        return _responses_answer(events, streamed)
    if exchange.api == "anthropic":
        return _anthropic_answer(events, streamed)
    return _chat_answer(events, streamed)


def _chat_answer(events: list[dict[str, Any]], streamed: bool) -> Answer:
    text: list[str] = []
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for event in events:
        # Every entry of `choices` counts, also two of one index in one chunk.
        for choice in event.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            part = choice.get("delta" if streamed else "message") or {}
            text.append(part.get("content") or "")
            for i, call in enumerate(part.get("tool_calls") or ()):
                slot = calls.setdefault(call.get("index", i), {"name": "", "arguments": ""})
                function = call.get("function") or {}
                slot["name"] += function.get("name") or ""
                slot["arguments"] += function.get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    tool_calls = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
    return Answer("".join(text), tool_calls, finish)


def _responses_answer(events: list[dict[str, Any]], streamed: bool) -> Answer:
    if streamed:
        final = [
            e["response"]
            for e in events
            if e.get("type") in ("response.completed", "response.incomplete")
        ]
        assert final, f"a Responses stream without its final response: {events[-3:]}"
        events = final
    text: list[str] = []
    calls: list[tuple[str, Any]] = []
    for item in events[-1]["output"]:
        if item["type"] == "message":
            text += [p["text"] for p in item["content"] if p["type"] == "output_text"]
        elif item["type"] == "function_call":
            calls.append((item["name"], json.loads(item["arguments"])))
        elif item["type"] == "custom_tool_call":
            calls.append((item["name"], item["input"]))  # free-form text
    return Answer("".join(text), calls)


def _anthropic_answer(events: list[dict[str, Any]], streamed: bool) -> Answer:
    if streamed:
        blocks: dict[int, dict[str, Any]] = {}
        partial: dict[int, str] = {}
        for e in events:
            if e.get("type") == "content_block_start":
                blocks[e["index"]] = dict(e["content_block"])
            elif e.get("type") == "content_block_delta":
                delta, block = e["delta"], blocks[e["index"]]
                if delta["type"] == "text_delta":
                    block["text"] = block.get("text", "") + delta["text"]
                elif delta["type"] == "input_json_delta":
                    partial[e["index"]] = partial.get(e["index"], "") + delta["partial_json"]
        for i, text in partial.items():
            blocks[i]["input"] = json.loads(text)
        content = [blocks[i] for i in sorted(blocks)]
    else:
        content = events[0]["content"]
    return Answer(
        "".join(b["text"] for b in content if b["type"] == "text"),
        [(b["name"], b["input"]) for b in content if b["type"] == "tool_use"],
    )


def explains(decoded: str, answer: Answer) -> bool:
    """Whether the sampled text ``decoded`` is the answer: the same text, or, with tool
    calls (parsed out of the text, their JSON re-serialized), each call's arguments
    written in it and the answer's prose part of it."""
    if not answer.tool_calls:
        return decoded == answer.text
    written = list(_json_objects(decoded))
    for name, arguments in answer.tool_calls:
        if isinstance(arguments, str):  # a custom tool's free-form input
            found = arguments in decoded or json.dumps(arguments)[1:-1] in decoded
        else:
            named = [
                o.get("arguments", o.get("parameters")) for o in written if o.get("name") == name
            ]
            found = arguments in written or arguments in named
        if not found:
            return False
    return answer.text.strip() in decoded


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


def assert_recorded(
    admin: GatewayClient, tap: WireTap, attempt: Attempt, served: Served, api: str
) -> tuple[list[Exchange], list[str]]:
    """One model_request per model call on the wire, each the answer the harness got.
    Answers the model calls and the records' decoded texts."""
    rollout_id = attempt.rollout.rollout_id
    exchanges = tap.exchanges(rollout_id)
    # Nothing else but a HEAD of the base URL (Claude Code's reachability probe, which
    # gets a 404) and answered token counts (nothing sampled, nothing recorded): a call
    # to an endpoint the proxy lacks shows here.
    assert all(
        e.method == "HEAD" or (e.path.endswith(COUNT_TOKENS) and e.status == 200)
        for e in exchanges
        if not e.api
    ), [(e.method, e.path, e.status) for e in exchanges if not e.api]
    calls = [e for e in exchanges if e.api]
    assert calls, "the harness made no model call"
    assert {e.api for e in calls} == {api}
    answered = [e for e in calls if e.status == 200]
    failed = admin.get_events(rollout_id, type="model_request_failed")
    assert len(failed) == len(calls) - len(answered), [e.data for e in failed]
    records = [e.data for e in admin.get_events(rollout_id, type="model_request")]
    assert len(records) == len(answered), (len(records), [(e.path, e.status) for e in calls])
    for record in records:
        ids, logprobs = record["response_ids"], record["logprobs"]
        assert record["prompt_ids"] and all(isinstance(t, int) for t in record["prompt_ids"])
        assert len(ids) == len(logprobs) > 0
        assert all(math.isfinite(x) and x <= 0 for x in logprobs)
        assert "invalid" not in record, record["invalid"]
        assert record.get("api", "chat") == api
    assert any(TASK in json.dumps(r["messages"]) for r in records)
    decoded = [served.decode(r) for r in records]
    # Calls may overlap (OpenCode titles the session while it works): match, not zip.
    unmatched = list(zip(records, decoded, strict=True))
    for exchange in answered:
        answer = answer_of(exchange)
        match = next(
            (
                (record, text)
                for record, text in unmatched
                if explains(text, answer)
                and answer.finish_reason in (None, record["finish_reason"])
            ),
            None,
        )
        assert match is not None, f"no record decodes to the answer {answer}"
        unmatched.remove(match)
    return calls, decoded


def assert_reported(reported: list[str], decoded: list[str]) -> None:
    """Each assistant text the harness reports is in what the model sampled."""
    texts = [t.strip() for t in reported if t.strip()]
    assert texts, "the harness reported no assistant text"
    for text in texts:
        assert any(text in d for d in decoded), f"{text[:200]!r} is in no recorded answer"


# --- running a harness -----------------------------------------------------------------


def harness(name: str) -> Path:
    return OPENHANDS_PYTHON if name == "openhands" else BIN / name


@functools.cache
def node_version() -> str | None:
    try:
        done = subprocess.run(["node", "--version"], capture_output=True, text=True, timeout=60)
    except OSError:
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def missing(name: str) -> str | None:
    """Why harness ``name`` cannot run here, with the line that installs what it lacks."""
    if not harness(name).exists():
        return f"{name} is not installed: bash {INSTALL}"
    if name == "openhands":
        return None
    version = node_version()
    if version is None or int(version.lstrip("v").split(".")[0]) < 20:
        return (
            f"{name} needs Node.js >= 20 on PATH (found {version}): apt-get install -y "
            "nodejs npm (Debian >= 13; older ones: https://nodejs.org/en/download)"
        )
    return None


def needs(name: str) -> pytest.MarkDecorator:
    """Skip the test when harness ``name`` cannot run, before its fixtures start servers."""
    reason = missing(name)
    return pytest.mark.skipif(reason is not None, reason=str(reason))


def clean_env(home: Path, **extra: str) -> dict[str, str]:
    """A fresh HOME and only what the harness needs (PATH finds node)."""
    home.mkdir(parents=True, exist_ok=True)
    return {"PATH": os.environ["PATH"], "HOME": str(home), "LANG": "C.UTF-8", **extra}


def run(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run a harness to its end, in a process group of its own: whatever it leaves running
    (a language server, a shell) goes with it."""
    cwd.mkdir(parents=True, exist_ok=True)
    with subprocess.Popen(
        args,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,  # nothing may wait for a user
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as process:
        try:
            out, err = process.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            out, err = process.communicate()
            pytest.fail(f"{args[0]} did not exit within {TIMEOUT_S} s:\n{out[-3000:]}{err[-3000:]}")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(args, process.returncode, out, err)


def json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def why(done: subprocess.CompletedProcess[str]) -> str:
    return f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


# --- the harnesses ---------------------------------------------------------------------


@pytest.mark.slow
@needs("codex")
def test_codex(
    admin: GatewayClient, tap: WireTap, attempt: Attempt, served: Served, tmp_path: Path
) -> None:
    """Codex CLI: a custom model provider at the proxy, wire_api = "responses", and
    otherwise its defaults: its default model (whose requests list the tools in an
    ``additional_tools`` input item, in namespaces), web search and multi-agent on."""
    codex = harness("codex")
    provider = (
        f'{{name="agl", base_url="{attempt.openai}", env_key="OPENAI_API_KEY", '
        'wire_api="responses"}'
    )
    done = run(
        [
            str(codex),
            "exec",
            "--json",
            "--skip-git-repo-check",
            "--strict-config",
            "--config",
            "model_provider=agl",
            "--config",
            f"model_providers.agl={provider}",
            "--config",
            "analytics.enabled=false",
            "--config",
            "check_for_update_on_startup=false",
            TASK,
        ],
        clean_env(tmp_path / "home", CODEX_HOME=str(tmp_path / "home"), OPENAI_API_KEY=attempt.key),
        tmp_path / "work",
    )
    events = json_lines(done.stdout)
    assert done.returncode == 0, why(done)
    assert any(e["type"] == "turn.completed" for e in events), why(done)
    _, decoded = assert_recorded(admin, tap, attempt, served, "responses")
    # Its tools came in namespaces of an additional_tools item: the model was shown them.
    first = admin.get_events(attempt.rollout.rollout_id, type="model_request")[0].data
    shown = {t["function"]["name"] for t in first.get("tools") or ()}
    assert {"exec", "spawn_agent"} <= shown, sorted(shown)
    assert_reported(
        [
            e["item"]["text"]
            for e in events
            if e["type"] == "item.completed" and e["item"]["type"] == "agent_message"
        ],
        decoded,
    )


@pytest.mark.slow
@needs("claude")
def test_claude_code(
    admin: GatewayClient, tap: WireTap, attempt: Attempt, served: Served, tmp_path: Path
) -> None:
    """Claude Code: ANTHROPIC_BASE_URL at the proxy, the attempt key as ANTHROPIC_API_KEY."""
    claude = harness("claude")
    env = clean_env(
        tmp_path / "home",
        ANTHROPIC_BASE_URL=attempt.anthropic,
        ANTHROPIC_API_KEY=attempt.key,
        # Its default max_tokens (64000) is past the model's context: the server says 400.
        CLAUDE_CODE_MAX_OUTPUT_TOKENS=str(MAX_TOKENS),
        # No telemetry, error reports, update checks or feedback surveys.
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
    )
    done = run(
        [
            str(claude),
            "-p",
            TASK,
            "--output-format",
            "stream-json",
            "--verbose",
            "--max-turns",
            str(MAX_TURNS),
            # Its default tools (~35k tokens of schemas) come with system messages inside
            # the conversation listing agents and skills, which the Anthropic dialect
            # refuses ("unknown role 'system'"); these four bring neither.
            "--tools",
            "Bash,Read,Write,Edit",
        ],
        env,
        tmp_path / "work",
    )
    events = json_lines(done.stdout)
    (result,) = [e for e in events if e["type"] == "result"]
    # Its own end, whichever: done; stopped at --max-turns; or given up on answers cut at
    # max_tokens (after retries), as the tiny model rarely stops within 256 tokens. Never
    # an error of the API (the proxy's or the model's).
    assert result["api_error_status"] is None, why(done)
    assert done.returncode == (1 if result["is_error"] else 0), why(done)
    _, decoded = assert_recorded(admin, tap, attempt, served, "anthropic")
    assert_reported(
        [
            block["text"]
            for e in events
            if e["type"] == "assistant" and e["message"]["model"] != "<synthetic>"
            for block in e["message"]["content"]
            if block["type"] == "text"
        ],
        decoded,
    )


@pytest.mark.slow
@needs("opencode")
def test_opencode(
    admin: GatewayClient,
    tap: WireTap,
    attempt: Attempt,
    served: Served,
    tmp_path: Path,
) -> None:
    """OpenCode: an OpenAI-compatible provider at the proxy, in its config file."""
    opencode = harness("opencode")
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            "agl": {
                "npm": "@ai-sdk/openai-compatible",
                "options": {"baseURL": attempt.openai, "apiKey": "{env:OPENAI_API_KEY}"},
                "models": {served.model: {"limit": {"context": MAX_CONTEXT, "output": MAX_TOKENS}}},
            }
        },
        "model": f"agl/{served.model}",
        "agent": {"build": {"steps": MAX_TURNS}},
        "autoupdate": False,
        "share": "disabled",
    }
    config_file = tmp_path / "opencode.json"
    config_file.write_text(json.dumps(config))
    env = clean_env(
        tmp_path / "home",
        OPENCODE_CONFIG=str(config_file),
        OPENAI_API_KEY=attempt.key,
        OPENCODE_DISABLE_AUTOUPDATE="1",
        OPENCODE_DISABLE_MODELS_FETCH="1",  # models.dev
        OPENCODE_DISABLE_LSP_DOWNLOAD="1",
    )
    done = run([str(opencode), "run", "--format", "json", TASK], env, tmp_path / "work")
    assert done.returncode == 0, why(done)
    _, decoded = assert_recorded(admin, tap, attempt, served, "chat")
    assert_reported(
        [
            e["part"]["text"]
            for e in json_lines(done.stdout)
            if e["type"] == "text" and not e["part"].get("synthetic")
        ],
        decoded,
    )


@pytest.mark.slow
@needs("qwen")
def test_qwen_code(
    admin: GatewayClient,
    tap: WireTap,
    attempt: Attempt,
    served: Served,
    tmp_path: Path,
) -> None:
    """Qwen Code: its OpenAI auth type, with agl's OPENAI_BASE_URL and OPENAI_API_KEY."""
    qwen = harness("qwen")
    home = tmp_path / "home"
    (home / ".qwen").mkdir(parents=True)
    (home / ".qwen" / "settings.json").write_text(
        json.dumps(
            {"privacy": {"usageStatisticsEnabled": False}, "general": {"enableAutoUpdate": False}}
        )
    )
    env = clean_env(
        home,
        OPENAI_BASE_URL=attempt.openai,
        OPENAI_API_KEY=attempt.key,
        # Its default (32000) is past the model's context: the server says 400.
        QWEN_CODE_MAX_OUTPUT_TOKENS=str(MAX_TOKENS),
    )
    done = run(
        [
            str(qwen),
            "--auth-type",
            "openai",
            "--model",
            served.model,
            "--output-format",
            "json",
            "--max-session-turns",
            str(MAX_TURNS),
            TASK,
        ],
        env,
        tmp_path / "work",
    )
    assert done.returncode in (0, 53), why(done)  # 53: stopped at --max-session-turns
    messages = json.loads(done.stdout)
    (result,) = [m for m in messages if m["type"] == "result"]
    calls, decoded = assert_recorded(admin, tap, attempt, served, "chat")
    # Its own count of model calls: the main loop's and its memory extractor's.
    models = result["stats"]["models"].values()
    assert sum(m["api"]["totalRequests"] for m in models) == len(calls)
    assert_reported(
        [
            block["text"]
            for m in messages
            if m["type"] == "assistant"
            for block in m["message"]["content"]
            if block["type"] == "text"
        ],
        decoded,
    )


@pytest.mark.slow
@needs("openhands")
def test_openhands(
    admin: GatewayClient, tap: WireTap, attempt: Attempt, served: Served, tmp_path: Path
) -> None:
    """OpenHands (the openhands-sdk agent): its LLM's base_url at the proxy."""
    python = harness("openhands")
    spec = {
        "base_url": attempt.openai,
        "api_key": attempt.key,
        "model": served.model,
        "task": TASK,
        "workspace": str(tmp_path / "work"),
        "max_iterations": MAX_TURNS,
        "max_tokens": MAX_TOKENS,
        "seed": SEED,
        "result": str(tmp_path / "result.json"),
    }
    env = clean_env(
        tmp_path / "home",
        LITELLM_LOCAL_MODEL_COST_MAP="True",  # LiteLLM's price list from GitHub: not fetched
        OPENHANDS_SUPPRESS_BANNER="1",
    )
    done = run(
        [str(python), str(HARNESSES / "openhands_agent.py"), json.dumps(spec)],
        env,
        tmp_path / "work",
    )
    assert done.returncode == 0, why(done)
    result = json.loads((tmp_path / "result.json").read_text())
    # Finished (an answer without a tool call ends its run), or stopped at its limit.
    assert result["status"] == "finished" or result["errors"] == ["MaxIterationsReached"], result
    calls, decoded = assert_recorded(admin, tap, attempt, served, "chat")
    assert result["llm_calls"] == len(calls)
    assert_reported(result["texts"], decoded)
