"""Only the gateway reaches the trainer's inference (issue 43, M7): the run's inference key.

The attack: an agent on the trainer's machine (a separate user in its own namespaces,
but on the machine's network) finds the inference server on loopback and calls it
directly, so its samples are unrecorded, skip the admission pause and the rate limit.
``python -m agl.train`` makes a key per run, hands it to its gateway in the child's
environment and to the inference server, which refuses every call without it but the
health check. What is shown here, on the parts ``agl.train`` wires, started as it starts
them: a call without the key, with a wrong one, with the attempt's own key or the admin
token gets 401; the same call through the gateway is answered and recorded; the key is on
no command line, in no file of the run folder and no log, and not in the environment the
trainer hands its agents. A whole ``agl.train`` run does the attack from its agents too.
The key's parts alone (the guard, the key's sources) are checked first.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sqlite3
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from agl.backends.inference import guard
from agl.backends.inference.vllm import GUARD_MODULE, install_guard
from agl.core.client import GatewayClient, proxy_base_url
from agl.core.contracts.records import ModelEndpoint
from agl.core.gateway.config import GatewayConfig
from agl.core.gateway.upstream import KEY_ENV_VAR, load_key
from agl.core.http_errors import ErrorResponse
from agl.core.ports import free_port
from agl.core.run.build import inference_key
from agl.core.run.services import ChildGateway
from agl.core.user_error import UserError
from tests.helpers.train_runs import SMALL, run_train

KEY = "k" * 43
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


# ------------------------------------------------------------------------- the guard


def scope(path: str, headers: dict[str, str], kind: str = "http") -> dict[str, Any]:
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    return {"type": kind, "path": path, "headers": raw}


@pytest.mark.parametrize(
    ("headers", "refused"),
    [
        ({"Authorization": f"Bearer {KEY}"}, None),
        ({"authorization": f"bearer  {KEY} "}, None),  # the scheme in any case, spaces around
        ({}, guard.MISSING_KEY),
        ({"Authorization": "Bearer"}, guard.MISSING_KEY),
        ({"Authorization": KEY}, guard.MISSING_KEY),
        ({"Authorization": f"Basic {KEY}"}, guard.MISSING_KEY),
        ({"x-api-key": KEY}, guard.MISSING_KEY),
        ({"Authorization": f"Bearer {KEY[:-1]}"}, guard.WRONG_KEY),
        ({"Authorization": f"Bearer {KEY}k"}, guard.WRONG_KEY),
    ],
)
def test_the_guard_lets_through_the_key_alone(headers: dict[str, str], refused: str | None) -> None:
    key = guard.digest(KEY)
    assert guard.refusal(scope("/v1/chat/completions", headers), key) == refused
    assert guard.refusal(scope("/realtime", headers, "websocket"), key) == refused
    assert guard.refusal(scope("/health", headers), key) is None
    assert guard.refusal({"type": "lifespan"}, key) is None


def test_the_guards_refusal_is_an_openai_error() -> None:
    error = ErrorResponse.model_validate_json(guard.error_body(guard.WRONG_KEY)).error
    assert (error.type, error.message) == ("authentication_error", guard.WRONG_KEY)


async def refused_websocket(app: guard.RequireKey) -> list[Mapping[str, Any]]:
    sent: list[Mapping[str, Any]] = []

    async def send(message: Any) -> None:
        sent.append(message)

    async def receive() -> Any:
        return {"type": "websocket.connect"}

    await app(scope("/v1/realtime", {}, "websocket"), receive, send)
    return sent


def test_a_websocket_without_the_key_is_closed_before_it_opens() -> None:
    async def never(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("the app behind the guard was reached")

    (closed,) = asyncio.run(refused_websocket(guard.RequireKey(never, KEY)))
    assert closed["type"] == "websocket.close" and closed["code"] == 1008


def test_a_guard_needs_a_key(monkeypatch: pytest.MonkeyPatch) -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None: ...

    with pytest.raises(ValueError, match="empty"):
        guard.RequireKey(app, " ")
    monkeypatch.delenv(guard.VLLM_KEY_VAR, raising=False)
    with pytest.raises(RuntimeError, match=f"{guard.VLLM_KEY_VAR} is not set"):
        guard.RequireVllmKey(app)


def test_vllms_copy_of_the_guard_needs_nothing_of_agl(tmp_path: Path) -> None:
    """vLLM's interpreter imports the copy ``install_guard`` writes, as ``--middleware``
    names it, without agl (vLLM's environment has none)."""
    middleware = install_guard(tmp_path / "guard")
    module, name = middleware.rsplit(".", 1)
    assert module == GUARD_MODULE
    probe = (
        f"import sys, {module}; getattr({module}, {name!r}); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'agl'))"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "guard")}
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# --------------------------------------------------------------------- the key's sources


def test_the_key_comes_from_a_file_else_the_environment(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(f"  {KEY}\n")
    assert load_key(str(key_file), {KEY_ENV_VAR: "other"}) == KEY
    assert load_key("", {KEY_ENV_VAR: f"{KEY}\n"}) == KEY
    assert load_key("", {KEY_ENV_VAR: " "}) is None
    assert load_key("", {}) is None


@pytest.mark.parametrize(
    ("content", "env", "says"),
    [
        (b"\n", "", "holds no key"),
        (b"two words\n", "", "whitespace inside"),
        (b"\xff\xfe", "", "is not text"),
        (None, "two words", f"${KEY_ENV_VAR} holds a key with whitespace inside"),
    ],
    ids=["empty file", "two words", "binary", "two words in the environment"],
)
def test_a_bad_key_is_named_never_shown(
    tmp_path: Path, content: bytes | None, env: str, says: str
) -> None:
    key_file = ""
    if content is not None:
        (tmp_path / "key").write_bytes(content)
        key_file = str(tmp_path / "key")
    with pytest.raises(ValueError, match=re.escape(says)) as raised:
        load_key(key_file, {KEY_ENV_VAR: env})
    assert "two words" not in str(raised.value)
    if key_file:
        assert key_file in str(raised.value)


def test_a_gateway_with_a_bad_key_file_fails_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"inference_key_file=.*: No such file or directory"):
        GatewayConfig(inference_key_file=str(tmp_path / "absent"))
    done = subprocess.run(
        [sys.executable, "-m", "agl.gateway", f"inference_key_file={tmp_path / 'absent'}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert done.stderr.startswith("agl.gateway: inference_key_file=")


def test_a_gateway_config_never_shows_its_key(tmp_path: Path) -> None:
    (tmp_path / "key").write_text(KEY)
    config = GatewayConfig(inference_key_file=str(tmp_path / "key"))
    assert config.inference_key == KEY and KEY not in repr(config)


def test_each_run_makes_its_own_key_unless_given_one(tmp_path: Path) -> None:
    made = {inference_key({"name": "embedded"}) for _ in range(3)}
    assert len(made) == 3 and all(len(k) >= 43 for k in made)  # 32 random bytes each
    (tmp_path / "key").write_text(KEY + "\n")
    assert inference_key({"name": "vllm", "key_file": str(tmp_path / "key")}) == KEY
    with pytest.raises(UserError, match=r"inference\.key_file=.*No such file"):
        inference_key({"name": "vllm", "key_file": str(tmp_path / "absent")})


# ------------------------------------------------------ the trainer's parts, as it wires them


def compose(*overrides: str) -> Any:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from agl.train import CONF

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return hydra_compose(config_name="train", overrides=[*SMALL, *overrides])


def files_holding(folder: Path, secret: str) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


def status_of(url: str, headers: dict[str, str]) -> int:
    return httpx.post(f"{url}/chat/completions", json=CHAT, headers=headers, timeout=30).status_code


@pytest.fixture
def trainer_parts(tmp_path: Path) -> Iterator[tuple[str, ChildGateway, Any, Any]]:
    """The run's key, its gateway and its embedded server, made and started as
    ``agl.train`` makes and starts them; stopped after."""
    from omegaconf import OmegaConf

    from agl.core.config_groups import load_configured_model
    from agl.core.run.build import inference_service

    cfg = compose("inference=embedded")
    options = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(options, dict)
    key = inference_key(options["inference"])
    loaded = load_configured_model(options["model"])
    gateway = ChildGateway(tmp_path / "gateway", inference_key=key).start()
    server = inference_service(options["inference"], loaded, cfg, tmp_path, key)
    try:
        server.start()
        yield key, gateway, server, loaded
    finally:
        server.close()
        gateway.stop()


def test_an_agent_reaches_the_trainers_model_only_through_the_gateway(
    tmp_path: Path, trainer_parts: tuple[str, ChildGateway, Any, Any]
) -> None:
    key, gateway, server, loaded = trainer_parts
    with GatewayClient(gateway.url, gateway.token) as admin:
        admin.register_models(
            [
                ModelEndpoint(model=loaded.name, endpoint=u, policy_version=0)
                for u in server.endpoints
            ]
        )
        admin.create_rollouts([{"rollout_id": "r1", "group_id": "g"}])
        rollout = admin.patch_rollout("r1", "running")
        (url,) = server.endpoints
        # Straight to the server on loopback: no key, a guess, the attempt's own key (what
        # an agent holds), even the admin token: none of them is the inference key.
        for held in ("", "sk-guess", key[:-1], rollout.attempt_key, gateway.token):
            headers = {"Authorization": f"Bearer {held}"} if held else {}
            assert status_of(url, headers) == 401, held
        assert httpx.get(f"{url.removesuffix('/v1')}/health", timeout=10).status_code == 200
        assert admin.get_events("r1", type="model_request") == []
        # The same call through the gateway, with the attempt's key: answered and recorded.
        agent = openai.OpenAI(
            base_url=proxy_base_url(gateway.url, "r1", rollout.attempt, rollout.mode),
            api_key=rollout.attempt_key,
            max_retries=0,
        )
        answer = agent.chat.completions.create(**CHAT)
        (event,) = admin.get_events("r1", type="model_request")
        assert event.data["response"] == answer.choices[0].message.content
        assert len(event.data["response_ids"]) > 0
    # Where an agent could find the key: the gateway's command line, the run folder (its
    # store, its log), the environment the trainer hands its agents.
    assert gateway.process is not None
    cmdline = Path(f"/proc/{gateway.process.pid}/cmdline").read_bytes()
    assert key.encode() not in cmdline
    assert files_holding(tmp_path, key) == []
    assert key not in os.environ.values()


# ------------------------------------------------------------------- a whole agl.train run


async def attacker(env: Mapping[str, str]) -> None:
    """A harness (``task.harness``) that calls the run's inference server at the port
    its input names, with no key and with its own attempt key, then once through its
    gateway; it reports the status codes it got as its reward's metrics."""
    from agl.agent import AgentContext

    agent = AgentContext.from_env(env)
    url = f"http://127.0.0.1:{agent.input['attack_port']}/v1"
    async with httpx.AsyncClient(timeout=60) as http:
        keyless = await http.post(f"{url}/chat/completions", json=CHAT)
        bearer = {"Authorization": f"Bearer {agent.api_key}"}
        own_key = await http.post(f"{url}/chat/completions", json=CHAT, headers=bearer)
        proxied = await http.post(f"{agent.base_url}/chat/completions", json=CHAT, headers=bearer)
        metrics = {
            "keyless": keyless.status_code,
            "own_key": own_key.status_code,
            "proxied": proxied.status_code,
        }
        await agent.finish(reward=1.0, metrics=metrics, http=http)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_agents_of_a_training_run_cannot_call_its_inference_directly(tmp_path: Path) -> None:
    """``python -m agl.train``: every agent calls the trainer's embedded server directly
    (its port given away: an agent could scan for it) and is refused, while its call
    through the gateway is answered and recorded; the run's key, given by
    ``inference.key_file`` so that it is known here, is in no file of the run folder."""
    run_dir, key_file = tmp_path / "run", tmp_path / "inference_key"
    key_file.write_text(KEY + "\n")
    port = free_port()
    result = run_train(
        run_dir,
        "trainer.steps=1",
        "trainer.groups_per_step=2",
        "trainer.group_size=2",
        "trainer.val_every=0",
        "task.warmup=null",  # the model need not play: its agents attack
        f"task.harness={__name__}:attacker",
        f"+task.agent.attack_port={port}",
        f"inference.port={port}",
        f"+inference.key_file={key_file}",
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with sqlite3.connect(run_dir / "gateway" / "gateway.db") as db:
        rewards = [
            json.loads(r[0]) for r in db.execute("SELECT data FROM events WHERE type = 'reward'")
        ]
        calls = db.execute("SELECT COUNT(*) FROM events WHERE type = 'model_request'").fetchone()
    assert len(rewards) == 4
    for reward in rewards:
        assert reward["metrics"] == {"keyless": 401, "own_key": 401, "proxied": 200}
    assert calls[0] == 4  # each proxied call, recorded
    assert files_holding(run_dir, KEY) == []
    assert KEY not in result.stderr and KEY not in result.stdout
