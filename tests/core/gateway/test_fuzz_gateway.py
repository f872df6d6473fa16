"""Bad input against the real gateway process: schemathesis over its own OpenAPI schema, and
hypothesis-made chat calls and event bodies sent to the recording proxy.

What must hold whatever comes in: no 5xx, no hang, a 4xx carries the JSON error shape, and a
2xx chat completion is recorded as exactly one ``model_request`` event.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error, response_schema_conformance

from agl.core.client import GatewayClient, proxy_base_url
from agl.core.contracts.records import MAX_JSON_DEPTH
from agl.core.gateway.paths import EVENTS, PROXY_CHAT
from agl.testing.fake_vllm import FakeVllm
from agl.testing.processes import GatewayProcess

TIMEOUT_S = 10.0  # a request that takes longer is a hang: every call here is local and small


@dataclass
class Live:
    """The running rollout that cases aim at; replaced once a case ends it."""

    rollout_id: str
    attempt: int
    mode: str
    key: str


class Target:
    def __init__(self, gateway: GatewayProcess, upstream: str) -> None:
        self.gateway = gateway
        self.upstream = upstream
        self.client = GatewayClient(gateway.url, gateway.token, retries=0)
        self.live = self.fresh()

    def fresh(self) -> Live:
        rollout_id = f"fz-{uuid.uuid4().hex[:12]}"
        self.client.create_rollouts([{"rollout_id": rollout_id, "group_id": "fuzz"}])
        r = self.client.patch_rollout(rollout_id, "running")
        assert r.report_key is not None
        # The report key: it reaches every route the attempt may (the model key, the proxy).
        return Live(r.rollout_id, r.attempt, r.mode, r.report_key)

    def ensure_running(self) -> None:
        r = self.client.get_rollout(self.live.rollout_id)
        if r.status != "running" or r.attempt != self.live.attempt:
            self.live = self.fresh()

    def restore(self) -> None:
        """Undo what a case may have changed for the cases after it: admission paused, the
        models replaced or deleted (a model at a made-up host would make the proxy wait
        on DNS and connection retries), the live rollout ended."""
        self.client.resume()
        models = self.client.list_models()
        if [(m.model, m.endpoint) for m in models] != [("policy", self.upstream)]:
            self.client.delete_models(None)
            self.client.register_models(
                [{"model": "policy", "endpoint": self.upstream, "policy_version": 3}]
            )
        self.ensure_running()


@pytest.fixture(scope="module")
def target(gateway: GatewayProcess, upstream: tuple[str, FakeVllm]) -> Iterator[Target]:
    t = Target(gateway, upstream[0])
    yield t
    t.restore()
    t.client.close()


def assert_error_shape(response: httpx.Response | Any) -> None:
    """A 4xx says what was wrong: ``{"error": {"message": ...}}``, the gateway's one shape
    (errors.py), in which the proxy also wraps the endpoint's errors."""
    body = response.json()
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), body
    assert isinstance(body["error"].get("message"), str) and body["error"]["message"], body


# -- 1. schemathesis over the gateway's own schema -----------------------------------------

# The chat route reads its body by hand (it forwards whatever the harness sent), so the
# schema declares none and schemathesis would only ever send an empty body. Give it the
# least a chat call has, so its cases get past the first 400.
CHAT_BODY = {
    "type": "object",
    "required": ["messages"],
    "properties": {
        "model": {"type": "string"},
        "messages": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"role": {"type": "string"}, "content": {"type": "string"}},
            },
        },
        "stream": {"type": "boolean"},
        "max_tokens": {"type": "integer"},
    },
}


def body_schemas(raw: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for operations in raw["paths"].values():
        for operation in operations.values():
            for content in operation.get("requestBody", {}).get("content", {}).values():
                yield content["schema"]


def dangling_refs(raw: dict[str, Any]) -> list[str]:
    """``$ref``s that do not resolve against the document (an OpenAPI ``$ref`` is relative
    to the document root, not to the schema it sits in)."""
    out = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/"):
                here: Any = raw
                for part in ref[2:].split("/"):
                    here = here.get(part) if isinstance(here, dict) else None
                if here is None:
                    out.append(ref)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(raw)
    return sorted(set(out))


def hoist_defs(raw: dict[str, Any]) -> dict[str, Any]:
    """The body schemas' ``$defs`` moved into ``components/schemas``, their refs rewritten,
    as the gateway itself should serve them (see test_openapi_refs_resolve)."""
    raw = copy.deepcopy(raw)
    components = raw.setdefault("components", {}).setdefault("schemas", {})
    for body in body_schemas(raw):
        components.update(body.pop("$defs", {}))

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                node["$ref"] = "#/components/schemas/" + ref[len("#/$defs/") :]
            for value in node.values():
                rewrite(value)
        elif isinstance(node, list):
            for value in node:
                rewrite(value)
        return node

    return rewrite(raw)


def test_openapi_refs_resolve(gateway: GatewayProcess) -> None:
    raw = httpx.get(f"{gateway.url}/openapi.json", timeout=TIMEOUT_S).json()
    assert dangling_refs(raw) == []


@pytest.fixture(scope="module")
def api_schema(gateway: GatewayProcess, target: Target) -> Any:
    served = httpx.get(f"{gateway.url}/openapi.json", timeout=TIMEOUT_S)
    assert served.status_code == 200, served.text
    raw = hoist_defs(served.json())  # without it schemathesis sends those bodies empty
    assert dangling_refs(raw) == []
    chat = raw["paths"][PROXY_CHAT]["post"]
    chat.setdefault(
        "requestBody",
        {"required": True, "content": {"application/json": {"schema": CHAT_BODY}}},
    )
    schema = schemathesis.openapi.from_dict(raw)
    schema.config.update(base_url=gateway.url, request_timeout=TIMEOUT_S)

    @schema.hook
    def flatmap_path_parameters(context: Any, path_parameters: dict[str, Any] | None) -> Any:
        # Half the cases name the live rollout (a real, running attempt), so that they get
        # past "rollout does not exist" into the handlers' own work.
        if not isinstance(path_parameters, dict) or "rollout_id" not in path_parameters:
            return st.just(path_parameters)
        live = target.live
        real = {**path_parameters, "rollout_id": live.rollout_id}
        if "attempt" in path_parameters:
            real["attempt"] = live.attempt
        if "mode" in path_parameters:
            real["mode"] = live.mode
        return st.sampled_from([path_parameters, real])

    return schema


def credentials(case: Any, target: Target) -> dict[str, str]:
    """The attempt key on the routes an agent uses, for the live rollout; else the admin."""
    live = target.live
    agent_route = case.path in (PROXY_CHAT, EVENTS) or case.path.endswith("/attempt/{attempt}")
    if agent_route and (case.path_parameters or {}).get("rollout_id") == live.rollout_id:
        return {"Authorization": f"Bearer {live.key}"}
    return {"Authorization": f"Bearer {target.gateway.token}"}


FUZZ = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
    database=None,
)


@pytest.mark.slow
def test_schema_conformance(api_schema: Any, target: Target) -> None:
    """Every operation of the schema, each with its own Hypothesis run (schemathesis's
    pytest plugin is not used: it reaches into pytest internals that pytest 9.2 changed)."""
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 10

    for operation in operations:

        @FUZZ
        @given(case=operation.as_strategy())
        def check(case: Any) -> None:
            try:
                response = case.call_and_validate(
                    headers=credentials(case, target),
                    checks=[not_a_server_error, response_schema_conformance],
                )
                if 400 <= response.status_code < 500:
                    assert_error_shape(response)
            finally:
                if case.method.upper() != "GET":
                    target.restore()

        check()


# -- 2. hypothesis-made chat calls and event bodies ----------------------------------------

INT64 = (-(2**63), 2**63 - 1)  # wider ones are refused (a test below): keep fuzzing the rest


texts = st.one_of(
    st.just(""),
    st.text(max_size=40),
    st.text(st.characters(codec="utf-8"), min_size=1, max_size=10),  # astral, RTL, controls
    st.sampled_from(["\x00", "\u202e", "\ufeff", "🧪" * 50, "a" * 5000, "NaN", "null"]),
)
numbers = st.one_of(
    st.integers(*INT64),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0, -1, 2**53 + 1, 1e308, -1e-308, 5e-324]),
)
# JSON values nested at most ~10 deep: deeper ones meet a known bug (test_known_bug_*).
json_values = st.recursive(
    st.none() | st.booleans() | numbers | texts,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
odd_messages = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool"])},
        optional={"content": json_values, "name": texts, "tool_calls": json_values},
    ),
    st.fixed_dictionaries({}, optional={"role": json_values, "content": texts}),
    json_values,
)
tools = st.lists(
    st.one_of(
        st.fixed_dictionaries(
            {
                "type": st.just("function"),
                "function": st.fixed_dictionaries(
                    {"name": texts}, optional={"parameters": json_values, "description": texts}
                ),
            },
        ),
        json_values,
    ),
    max_size=3,
)
# A chat call with any of the OpenAI fields set to something odd, some of them missing.
odd_fields = {
    "model": st.one_of(texts, json_values),
    "n": st.one_of(st.integers(-2, 5), json_values),
    "max_tokens": st.one_of(st.integers(-(2**31), 64), json_values),
    "temperature": st.one_of(st.sampled_from(["NaN", "Infinity", "-1", -1, 1e308]), numbers),
    "top_p": numbers,
    "stream": st.one_of(st.booleans(), json_values),
    "tools": st.one_of(tools, json_values),
    "tool_choice": json_values,
    "logprobs": st.booleans(),
    "stop": json_values,
    "extra": json_values,
}
plain_messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant"]), "content": texts}
    ),
    min_size=1,
    max_size=3,
)
chat_bodies = st.one_of(
    # Mostly calls an endpoint would take, with odd text and odd options ...
    st.fixed_dictionaries({"messages": plain_messages}, optional=odd_fields),
    st.fixed_dictionaries({"messages": plain_messages}, optional=odd_fields),
    st.fixed_dictionaries({"messages": plain_messages}, optional=odd_fields),
    st.fixed_dictionaries({"messages": plain_messages, "stream": st.just(True)}),
    # ... and the rest odd all through, "messages" included or missing.
    st.fixed_dictionaries(
        {},
        optional={
            "messages": st.one_of(st.lists(odd_messages, max_size=4), json_values),
            **odd_fields,
        },
    ),
)


def encode_body(body: Any, ascii_only: bool) -> bytes:
    """JSON bytes; with ``ascii_only`` every non-ASCII character is a ``\\u`` escape (astral
    ones as surrogate pairs), as json.dumps writes them."""
    import json

    return json.dumps(body, ensure_ascii=ascii_only, allow_nan=False).encode(
        "utf-8", "surrogatepass"
    )


raw_bodies = st.one_of(
    st.builds(encode_body, chat_bodies, st.booleans()),
    st.builds(encode_body, chat_bodies, st.booleans()),
    # Lone surrogates, escaped: valid JSON syntax, not valid Unicode.
    st.builds(
        lambda c: b'{"messages":[{"role":"user","content":"\\u%04x"}]}' % ord(c),
        st.characters(categories=["Cs"]),
    ),
    st.sampled_from(
        [
            b"",
            b"{",
            b"[]",
            b"null",
            b'"x"',
            b"\xff\xfe",
            b'{"messages": NaN}',
            b'{"messages":[{"role":"user","content":"hi"}],"temperature":NaN}',
            b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":1e999}',
            b'{"messages":[{"role":"user","content":"hi"}],"n":18446744073709551615}',
            b'{"messages":[],"stream":true}',
        ]
    ),
)


def fresh_rollout(target: Target) -> Live:
    return target.fresh()  # a new key per example: no example spends another's rate limit


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(body=raw_bodies)
def test_proxy_survives_odd_chat_calls(target: Target, body: bytes) -> None:
    live = fresh_rollout(target)
    url = proxy_base_url(target.gateway.url, live.rollout_id, live.attempt, live.mode)
    headers = {"Authorization": f"Bearer {live.key}", "Content-Type": "application/json"}
    response = httpx.post(
        f"{url}/chat/completions", content=body, headers=headers, timeout=TIMEOUT_S
    )
    assert response.status_code < 500, (body[:300], response.status_code, response.text[:300])
    events = target.client.get_events(live.rollout_id, type="model_request")
    if response.status_code >= 400:
        assert_error_shape(response)
        assert events == []
        return
    assert response.status_code == 200
    if response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.rstrip().endswith("data: [DONE]"), response.text[-200:]
        choices = {
            orjson.loads(line[5:])["choices"][0]["index"]
            # Not splitlines(): JSON keeps U+2028, U+0085 and the like unescaped.
            for line in response.text.split("\n")
            if line.startswith("data: {") and orjson.loads(line[5:]).get("choices")
        }
    else:
        answer = response.json()
        assert answer["object"] == "chat.completion"
        choices = {c["index"] for c in answer["choices"]}
    assert len(events) == len(choices) == 1, (events, choices)
    assert events[0].data["messages"] == orjson.loads(body)["messages"]


event_bodies = st.builds(
    lambda one, batch, as_list: batch if as_list else one,
    st.fixed_dictionaries(
        {"type": st.one_of(texts, json_values)},
        optional={
            "event_id": st.one_of(texts, json_values),
            "data": json_values,
            "extra": json_values,
        },
    ),
    st.lists(
        st.fixed_dictionaries(
            {"type": st.sampled_from(["reward", "note", "x" * 100])}, optional={"data": json_values}
        ),
        max_size=5,
    ),
    st.booleans(),
)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(body=event_bodies, ascii_only=st.booleans())
def test_events_survive_odd_bodies(target: Target, body: Any, ascii_only: bool) -> None:
    live = fresh_rollout(target)
    path = EVENTS.format(rollout_id=live.rollout_id, attempt=live.attempt)
    response = httpx.post(
        target.gateway.url + path,
        content=encode_body(body, ascii_only),
        headers={"Authorization": f"Bearer {live.key}", "Content-Type": "application/json"},
        timeout=TIMEOUT_S,
    )
    assert response.status_code < 500, (body, response.status_code, response.text[:300])
    stored = target.client.get_events(live.rollout_id)
    if response.status_code >= 400:
        assert_error_shape(response)
        assert stored == []
        return
    sent = body if isinstance(body, list) else [body]
    assert [(e.type, e.data) for e in stored] == [(e["type"], e.get("data")) for e in sent]


# -- 3. numeric query values ----------------------------------------------------------------

# Each route's integer query parameters, and whether a negative value means anything there.
NUMERIC_QUERIES = [
    ("events", "cursor", False),
    ("events", "attempt", False),
    ("events", "limit", False),
    ("rollouts", "cursor", False),
    ("rollouts", "limit", False),
    ("summaries", "step", True),
    ("summaries", "offset", False),
    ("summaries", "limit", False),
    ("ui", "step", True),
    ("ui", "page", False),
]
# What used to answer a plain-text 500: past 64 bits, or digits str.isdigit() passes.
BAD_NUMBERS = ["9223372036854775808", "18446744073709551616", "²", "①", "١٢", "1_0"]


def get_numeric(target: Target, route: str, name: str, value: str) -> httpx.Response:
    path = {
        "events": f"/api/rollouts/{target.live.rollout_id}/events",
        "rollouts": "/api/rollouts",
        "summaries": "/api/summaries",
        "ui": "/ui",
    }[route]
    return httpx.get(
        target.gateway.url + path,
        params={name: value},
        headers={"Authorization": f"Bearer {target.gateway.token}"},
        timeout=TIMEOUT_S,
    )


def assert_refused(response: httpx.Response, route: str) -> None:
    assert response.status_code in (400, 422), (response.status_code, response.text[:300])
    if route != "ui":  # the viewer answers an HTML page that says what was wrong
        assert_error_shape(response)


@pytest.mark.parametrize(("route", "name", "signed"), NUMERIC_QUERIES)
def test_numbers_past_64_bits_or_not_in_ascii_digits_are_refused(
    target: Target, route: str, name: str, signed: bool
) -> None:
    for value in [*BAD_NUMBERS, *([] if signed else ["-1"])]:
        assert_refused(get_numeric(target, route, name, value), route)


NUMBERS = st.one_of(
    st.integers().map(str),
    st.integers(min_value=2**63 - 2, max_value=2**64 + 1).map(str),
    st.integers(min_value=-(2**64), max_value=-(2**63) + 1).map(str),
    st.sampled_from([*BAD_NUMBERS, "", "-", "-0", "+1", " 1", "1 ", "0x10", "1e3", "1.0"]),
    st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=24),
)


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(where=st.sampled_from(NUMERIC_QUERIES), value=NUMBERS)
def test_no_numeric_query_value_is_a_server_error(
    target: Target, where: tuple[str, str, bool], value: str
) -> None:
    route, name, _ = where
    response = get_numeric(target, route, name, value)
    assert response.status_code < 500, (route, name, value, response.text[:300])
    if response.status_code >= 400:
        assert_refused(response, route)


# -- known bugs: deterministic reproducers -------------------------------------------------


def _post(target: Target, path: str, body: bytes, token: str) -> httpx.Response:
    # A fresh connection each: after an unhandled error uvicorn drops the connection.
    return httpx.post(
        target.gateway.url + path,
        content=body,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        timeout=TIMEOUT_S,
    )


def test_an_integer_past_64_bits_is_refused_not_a_500(target: Target) -> None:
    """The store could not write it back (it used to 500 and drop the connection)."""
    body = b'[{"rollout_id":"fz-bigint","input":[18446744073709551616]}]'
    response = _post(target, "/api/rollouts", body, target.gateway.token)
    assert response.status_code == 422 and "64 bits" in response.text, response.text
    live = target.fresh()
    path = EVENTS.format(rollout_id=live.rollout_id, attempt=live.attempt)
    response = _post(target, path, b'{"type":"t","data":18446744073709551616}', live.key)
    assert response.status_code == 422 and "64 bits" in response.text, response.text


def test_nan_in_event_data_is_refused_not_stored_as_null(target: Target) -> None:
    live = target.fresh()
    path = EVENTS.format(rollout_id=live.rollout_id, attempt=live.attempt)
    for bad in (b'{"type":"t","data":NaN}', b'{"type":"t","data":[1e400]}'):
        response = _post(target, path, bad, live.key)
        assert 400 <= response.status_code < 500, response.text


def nested(depth: int) -> bytes:
    return b'{"messages":[{"role":"user","content":"hi","x":' + b"[" * depth + b"]" * depth + b"}]}"


def test_a_chat_body_nested_too_deep_is_refused_and_its_rollout_still_reads(
    target: Target,
) -> None:
    """orjson reads 1024 levels and writes 254: a call nested ~250 deep used to be
    recorded, then made its rollout's events unreadable (500) for good."""
    live = target.fresh()
    path = PROXY_CHAT.format(rollout_id=live.rollout_id, attempt=live.attempt, mode=live.mode)
    for depth in (MAX_JSON_DEPTH, 250, 300):
        response = _post(target, path, nested(depth), live.key)
        assert response.status_code == 400 and "deeper" in response.text, response.text
    assert _post(target, path, nested(MAX_JSON_DEPTH - 8), live.key).status_code == 200
    response = httpx.get(
        f"{target.gateway.url}/api/rollouts/{live.rollout_id}/events",
        headers={"Authorization": f"Bearer {target.gateway.token}"},
        timeout=TIMEOUT_S,
    )
    assert response.status_code == 200, response.text


def test_fake_endpoint_answers_400_to_malformed_messages(target: Target) -> None:
    """The fake endpoint refuses what vLLM refuses with a 400 (it used to 500 on a message
    that is not an object), so the proxy's pass-through of its errors stays a 4xx."""
    for messages in ([1.5], [{"role": ["x"]}], [{"role": "user", "content": "hi"}, None]):
        response = httpx.post(
            f"{target.upstream}/chat/completions",
            json={"model": "policy", "messages": messages},
            timeout=TIMEOUT_S,
        )
        assert response.status_code == 400, (messages, response.text)
        assert response.json()["error"]["message"]
