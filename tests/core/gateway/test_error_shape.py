"""Every 4xx/5xx the gateway sends is in one shape, OpenAI's ``ErrorResponse``
(``agl.core.http_errors``): its own refusals, FastAPI's and Starlette's, the body and rate
limits, the proxy's, and the inference endpoint's errors, wrapped whatever shape they
came in. The Anthropic routes' bodies are Anthropic's shape as well."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import anthropic
import httpx
import openai
import pytest
from aiohttp import web

from agl.core.client import GatewayClient, proxy_base_url
from agl.core.contracts.records import Rollout
from agl.core.http_errors import UPSTREAM_CODE, ErrorResponse
from agl.core.ports import free_port
from agl.testing.fake_vllm import FakeVllm, serve_in_thread
from agl.testing.processes import GatewayProcess, gateway_process

BURST = 3  # calls an attempt key makes before its 429 (the rate refills none meanwhile)
CHAT = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
MESSAGES = {**CHAT, "max_tokens": 16}

OPENAI_SHAPE = (
    b'{"error": {"message": "%s", "type": "BadRequestError", "param": null, "code": 400}}'
)
# vLLM before 0.6: the error's fields at the top, no "error" key.
OLD_VLLM_SHAPE = b'{"object": "error", "message": "%s", "type": "BadRequestError", "code": 400}'


class CannedEndpoint(FakeVllm):
    """The fake endpoint, answering the next calls with ``answers`` as given: (status,
    body, content type)."""

    def __init__(self) -> None:
        super().__init__()
        self.answers: list[tuple[int, bytes, str]] = []

    async def _take(self, request: web.Request) -> object:
        if self.answers:
            status, body, kind = self.answers.pop(0)
            return web.Response(status=status, body=body, content_type=kind)
        return await super()._take(request)


@dataclass
class Setup:
    gateway: GatewayProcess
    admin: GatewayClient
    endpoint: CannedEndpoint

    def running(self, **spec: object) -> Rollout:
        rollout_id = f"r-{uuid.uuid4().hex[:12]}"
        self.admin.create_rollouts([{"rollout_id": rollout_id, **spec}])
        return self.admin.patch_rollout(rollout_id, "running")

    def send(
        self, method: str, path: str, token: str | None = None, **kwargs: object
    ) -> httpx.Response:
        headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        return httpx.request(method, self.gateway.url + path, headers=headers, timeout=60, **kwargs)

    def proxy(
        self,
        answers: list[tuple[int, bytes, str]],
        body: object = CHAT,
        tail: str = "openai/v1/chat/completions",
        rollout: Rollout | None = None,
    ) -> httpx.Response:
        """A call of a fresh attempt through the proxy, the endpoint answering ``answers``."""
        r = rollout or self.running()
        self.endpoint.answers = list(answers)
        root = proxy_base_url("", r.rollout_id, r.attempt, r.mode).removesuffix("/openai/v1")
        sent = {"content": body} if isinstance(body, bytes) else {"json": body}
        return self.send("POST", f"{root}/{tail}", r.attempt_key, **sent)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    with (
        serve_in_thread(CannedEndpoint()) as (url, endpoint),
        gateway_process(
            tmp_path_factory.mktemp("shape"),
            max_body_mb=0.05,
            attempt_rps=0.001,
            attempt_burst=BURST,
            upstream_retries=0,
        ) as gw,
        GatewayClient(gw.url, gw.token, retries=0) as admin,
    ):
        assert isinstance(endpoint, CannedEndpoint)
        down = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
        admin.register_models(
            [{"model": "policy", "endpoint": url}, {"model": "gone", "endpoint": down}]
        )
        yield Setup(gw, admin, endpoint)


def json_answer(status: int, body: bytes) -> list[tuple[int, bytes, str]]:
    return [(status, body, "application/json")]


def finished_call(s: Setup, tail: str = "openai/v1/chat/completions") -> httpx.Response:
    r = s.running()
    s.admin.patch_rollout(r.rollout_id, "succeeded", attempt=r.attempt)
    return s.proxy([], MESSAGES, tail, rollout=r)


def rate_limited(s: Setup) -> httpx.Response:
    r = s.running()
    for _ in range(BURST):
        assert s.send("GET", f"/api/rollouts/{r.rollout_id}", r.report_key).is_success
    return s.send("GET", f"/api/rollouts/{r.rollout_id}", r.report_key)


def streamed_body(s: Setup) -> httpx.Response:
    r = s.running()

    def chunks() -> Iterator[bytes]:
        for _ in range(80):
            yield b" " * 1024

    path = proxy_base_url("", r.rollout_id, 1) + "/chat/completions"
    return s.send("POST", path, r.attempt_key, content=chunks())


Case = Callable[[Setup], httpx.Response]

# (what provokes it, the status, words of its message)
CASES: list[tuple[str, int, str, Case]] = [
    ("no key", 401, "missing key", lambda s: s.send("GET", "/api/rollouts")),
    ("a forged key", 401, "invalid", lambda s: s.send("GET", "/api/rollouts", "agl-x.y")),
    (
        "an attempt key on an admin route",
        403,
        "admin",
        lambda s: s.send("GET", "/api/models", s.running().attempt_key),
    ),
    (
        "an attempt key on another rollout",
        403,
        "not valid",
        lambda s: s.send("GET", f"/api/rollouts/{s.running().rollout_id}", s.running().attempt_key),
    ),
    ("no such route", 404, "no route", lambda s: s.send("GET", "/api/nothing", s.gateway.token)),
    (
        "no such rollout",
        404,
        "does not exist",
        lambda s: s.send("GET", "/api/rollouts/nope", s.gateway.token),
    ),
    ("an unknown model", 404, "not registered", lambda s: s.proxy([], {**CHAT, "model": "x"})),
    ("a method the route lacks", 405, "PUT", lambda s: s.send("PUT", "/api/rollouts", "t")),
    (
        "a body over the limit",
        413,
        "limit",
        lambda s: s.send("POST", "/api/rollouts", s.gateway.token, content=b" " * 80_000),
    ),
    ("a streamed body over the limit", 413, "limit", streamed_body),
    ("a body that is no JSON", 400, "JSON", lambda s: s.proxy([], b"{not json")),
    (
        "a record that does not validate",
        422,
        "rollout_id",
        lambda s: s.send("POST", "/api/rollouts", s.gateway.token, json=[{"rollout_id": 5}]),
    ),
    (
        "a path FastAPI does not parse",
        422,
        "attempt",
        lambda s: s.send("PATCH", "/api/rollouts/x/attempt/one", s.gateway.token, json={}),
    ),
    (
        "a query FastAPI does not parse",
        422,
        "limit",
        lambda s: s.send("GET", "/api/rollouts?limit=many", s.gateway.token),
    ),
    ("too many calls", 429, "too many calls", rate_limited),
    ("a call of a finished attempt", 409, "not running", finished_call),
    (
        "an endpoint's 400, OpenAI's shape",
        400,
        "answered 400: prompt too long",
        lambda s: s.proxy(json_answer(400, OPENAI_SHAPE % b"prompt too long")),
    ),
    (
        "an endpoint's 400, vLLM's older shape",
        400,
        "answered 400: prompt too long",
        lambda s: s.proxy(json_answer(400, OLD_VLLM_SHAPE % b"prompt too long")),
    ),
    (
        "an endpoint's 500, vLLM's older shape",
        500,
        "answered 500: engine died",
        lambda s: s.proxy(json_answer(500, OLD_VLLM_SHAPE % b"engine died")),
    ),
    (
        "an endpoint's 503 in plain text",
        503,
        "answered 503: busy",
        lambda s: s.proxy([(503, b"busy", "text/plain")]),
    ),
    (
        "an endpoint's 504 as an HTML page",
        504,
        "answered 504: <html>",
        lambda s: s.proxy([(504, b"<html>gateway timeout</html>", "text/html")]),
    ),
    (
        "an endpoint's error on a streamed call",
        400,
        "answered 400: no",
        lambda s: s.proxy(json_answer(400, OLD_VLLM_SHAPE % b"no"), {**CHAT, "stream": True}),
    ),
    (
        "an endpoint answering a status that is no error",
        502,
        "answered 204",
        lambda s: s.proxy([(204, b"", "application/json")]),
    ),
    (
        "an endpoint that is down",
        502,
        "unreachable",
        lambda s: s.proxy([], {**CHAT, "model": "gone"}),
    ),
    (
        "a malformed answer",
        502,
        "malformed",
        lambda s: s.proxy(json_answer(200, b'{"choices": 5}')),
    ),
    (
        "an answer that is no JSON",
        502,
        "malformed",
        lambda s: s.proxy([(200, b"<html>", "application/json")]),
    ),
    (
        "Responses: an endpoint's error",
        400,
        "answered 400: prompt too long",
        lambda s: s.proxy(
            json_answer(400, OLD_VLLM_SHAPE % b"prompt too long"),
            {"model": "policy", "input": "hi"},
            "openai/v1/responses",
        ),
    ),
]

ANTHROPIC_PATH = proxy_base_url("", "r", 1).removesuffix("/openai/v1") + "/anthropic/v1/messages"

# The Anthropic routes: the same cases in Anthropic's shape, which is also the gateway's.
ANTHROPIC_CASES: list[tuple[str, int, str, Case]] = [
    (
        "no key",
        401,
        "missing key",
        lambda s: s.send("POST", ANTHROPIC_PATH, json=MESSAGES),
    ),
    (
        "a request Messages does not allow",
        400,
        "max_tokens",
        lambda s: s.proxy([], CHAT, "anthropic/v1/messages"),
    ),
    (
        "a call of a finished attempt",
        409,
        "not running",
        lambda s: finished_call(s, "anthropic/v1/messages"),
    ),
    (
        "an endpoint's error, vLLM's older shape",
        400,
        "answered 400: prompt too long",
        lambda s: s.proxy(
            json_answer(400, OLD_VLLM_SHAPE % b"prompt too long"), MESSAGES, "anthropic/v1/messages"
        ),
    ),
    (
        "count_tokens: an endpoint's error",
        500,
        "/tokenize answered 500: no tokenizer",
        lambda s: s.proxy(
            json_answer(500, OLD_VLLM_SHAPE % b"no tokenizer"),
            CHAT,
            "anthropic/v1/messages/count_tokens",
        ),
    ),
    (
        "an endpoint that is down",
        502,
        "unreachable",
        lambda s: s.proxy([], {**MESSAGES, "model": "gone"}, "anthropic/v1/messages"),
    ),
]


def assert_one_shape(response: httpx.Response, status: int, says: str) -> ErrorResponse:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json"), response.headers
    error = ErrorResponse.model_validate_json(response.content)
    assert says in error.error.message, error
    return error


@pytest.mark.parametrize(
    ("status", "says", "case"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_every_error_is_in_openais_error_shape(
    setup: Setup, status: int, says: str, case: Case
) -> None:
    error = assert_one_shape(case(setup), status, says)
    if "answered" in says:  # the endpoint's error, saying so
        assert error.error.message.startswith("the inference endpoint answered"), error
        assert error.error.code == UPSTREAM_CODE


@pytest.mark.parametrize(
    ("status", "says", "case"),
    [c[1:] for c in ANTHROPIC_CASES],
    ids=[c[0] for c in ANTHROPIC_CASES],
)
def test_every_anthropic_error_is_in_both_shapes(
    setup: Setup, status: int, says: str, case: Case
) -> None:
    response = case(setup)
    assert_one_shape(response, status, says)
    body = anthropic.types.ErrorResponse.model_validate(response.json())
    assert body.type == "error" and says in body.error.message


def test_a_rate_limited_call_says_when_to_retry(setup: Setup) -> None:
    limited = rate_limited(setup)
    error = assert_one_shape(limited, 429, "too many calls")
    assert (error.error.type, error.error.code) == ("rate_limit_error", "rate_limit_exceeded")
    assert int(limited.headers["Retry-After"]) >= 1
    assert error.model_extra is not None and error.model_extra["retry_after_s"] > 0


def test_a_conflict_carries_the_rollout_as_it_is(setup: Setup) -> None:
    error = assert_one_shape(finished_call(setup), 409, "not running")
    assert error.model_extra is not None and error.model_extra["current"]["status"] == "succeeded"


def test_the_openai_client_shows_the_endpoints_message(setup: Setup) -> None:
    r = setup.running()
    client = openai.OpenAI(
        base_url=proxy_base_url(setup.gateway.url, r.rollout_id, r.attempt, r.mode),
        api_key=r.attempt_key,
        max_retries=0,
    )
    setup.endpoint.answers = json_answer(400, OLD_VLLM_SHAPE % b"prompt too long")
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(**CHAT)  # type: ignore[call-overload]
    assert raised.value.message == (
        "Error code: 400 - the inference endpoint answered 400: prompt too long"
    )
    assert (raised.value.type, raised.value.code) == ("BadRequestError", UPSTREAM_CODE)
    # The record says what the harness was told.
    (failed,) = setup.admin.get_events(r.rollout_id, type="model_request_failed")
    assert failed.data["status"] == 400 and "prompt too long" in failed.data["error"]


def test_the_anthropic_client_shows_the_endpoints_message(setup: Setup) -> None:
    r = setup.running()
    root = proxy_base_url(setup.gateway.url, r.rollout_id, r.attempt, r.mode)
    client = anthropic.Anthropic(
        base_url=root.removesuffix("/openai/v1") + "/anthropic",
        api_key=r.attempt_key,
        max_retries=0,
    )
    setup.endpoint.answers = json_answer(400, OLD_VLLM_SHAPE % b"prompt too long")
    with pytest.raises(anthropic.BadRequestError) as raised:
        client.messages.create(**MESSAGES)  # type: ignore[arg-type]
    assert raised.value.type == "invalid_request_error"
    assert raised.value.api_message == "the inference endpoint answered 400: prompt too long"
