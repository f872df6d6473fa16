"""The embedded inference server over real HTTP on loopback, with the real openai client.

One server (the tiny model, an ``Engine`` and uvicorn in a thread) serves the module, so
tests can also look at the engine: its forward-pass counters and ``update_weights``.
Every returned logprob is checked against a teacher-forced forward pass of the model.
It requires an inference key, as the trainer's does: the tests send it, and the attacks
(no key, a wrong one) get 401 on every route but ``/health``.
"""

from __future__ import annotations

import asyncio
import copy
import os
import random
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
import uvicorn

from agl.backends.inference.engine import Engine
from agl.backends.inference.models import LoadedModel, load_model
from agl.backends.inference.server.app import create_app
from agl.backends.inference.server.responses import POLICY_VERSION_HEADER
from agl.backends.inference.server.text import ChoiceOutput
from agl.backends.inference.server.tokens import TokenCodec
from agl.backends.inference.server.tools import parse_tool_calls, tool_parser
from agl.core.client import GatewayClient, proxy_base_url
from agl.core.contracts.text_rule import TextRule
from agl.core.gateway.upstream import KEY_ENV_VAR
from agl.core.http_errors import ErrorResponse
from agl.testing.processes import free_port, gateway_process, serve_process, wait_healthy
from tests.conftest import vllm_text

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
BROKEN = [{"role": "user", "content": "Write broken JSON."}]
# What the trained model answers to WEATHER and to BROKEN. The first has non-canonical
# JSON ({"city":"Paris"}), so the parsed arguments visibly differ from the sampled text.
WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call>'
BROKEN_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}\n</tool_call>'
TOLERANCE = 1e-4
KEY = secrets.token_urlsafe(32)  # the served app's inference key


@dataclass
class Served:
    url: str  # the OpenAI base URL, ending in /v1
    engine: Engine
    loaded: LoadedModel

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {KEY}"}

    def client(self, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key=KEY, max_retries=0, **kwargs)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url, api_key=KEY, max_retries=0)

    def prompt_ids(self, messages: list[dict[str, Any]], tools: list | None = None) -> list[int]:
        tokenizer = self.loaded.tokenizer
        text = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False
        )
        return list(tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.loaded.tokenizer.decode(ids, skip_special_tokens=False)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    loaded = load_model("tiny", seed=0)
    engine = Engine(
        loaded.model, loaded.tokenizer, max_batch_size=16, max_context=512, num_threads=1
    )
    port = free_port()
    app = create_app(engine, loaded.tokenizer, "tiny", api_key=KEY)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.02)
    try:
        yield Served(f"http://127.0.0.1:{port}/v1", engine, loaded)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        engine.close()


def teacher_forced(
    model: torch.nn.Module,
    prompt: list[int],
    response: list[int],
    temperature: float,
    top_p: float = 1.0,
) -> list[float]:
    """Each response token's logprob under the distribution it was sampled from
    (log_softmax(logits / T), truncated to the top-p nucleus and renormalised; greedy:
    untransformed), from one forward over everything. Written out here, not with
    agl.backends.sampling, so that a drift of the engine's transform shows."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    greedy = temperature == 0
    scaled = logits[len(prompt) - 1 : -1] / (1.0 if greedy else temperature)
    if top_p < 1 and not greedy:
        probs = scaled.softmax(-1)
        ordered, order = probs.sort(-1, descending=True)
        above = ordered.cumsum(-1) - ordered
        removed = torch.zeros_like(probs, dtype=torch.bool).scatter(1, order, above >= top_p)
        scaled = scaled.masked_fill(removed, float("-inf"))
    logp = torch.log_softmax(scaled, -1)
    return logp.gather(1, torch.tensor(response)[:, None]).squeeze(1).tolist()


def assert_logprobs_match(
    served: Served,
    prompt: list[int],
    choice: Any,
    temperature: float,
    model: Any = None,
    top_p: float = 1.0,
) -> None:
    ids = choice.model_extra["token_ids"]
    got = [entry.logprob for entry in choice.logprobs.content]
    assert len(got) == len(ids) > 0
    want = teacher_forced(model or served.loaded.model, prompt, ids, temperature, top_p)
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < TOLERANCE


def extra(**kwargs: Any) -> dict[str, Any]:
    return {"return_token_ids": True, **kwargs}


# ---------------------------------------------------------------- logprobs and prompts


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 1.0), (1.0, 0.9), (0.0, 1.0)])
def test_logprobs_match_teacher_forcing_under_batching(
    served: Served, temperature: float, top_p: float
) -> None:
    """Concurrent requests of different prompt lengths are decoded in one left-padded
    batch; each one's logprobs are still those of its own sequence run alone."""
    conversations = [[{"role": "user", "content": "word " * (1 + 7 * k)}] for k in range(6)]

    async def ask(messages: list[dict[str, str]], seed: int) -> Any:
        async with served.async_client() as client:
            return await client.chat.completions.create(
                model="tiny",
                messages=messages,
                temperature=temperature,
                top_p=top_p,
                max_tokens=24 + 3 * seed,
                seed=seed,
                logprobs=True,
                extra_body=extra(),
            )

    async def all_of_them() -> list[Any]:
        return await asyncio.gather(*(ask(m, k) for k, m in enumerate(conversations)))

    for messages, answer in zip(conversations, asyncio.run(all_of_them()), strict=True):
        prompt = served.prompt_ids(messages)
        assert answer.model_extra["prompt_token_ids"] == prompt
        assert_logprobs_match(served, prompt, answer.choices[0], temperature, top_p=top_p)


def test_prompt_token_ids_are_the_chat_template_tokens(served: Served) -> None:
    answer = served.client().chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=2, extra_body=extra()
    )
    prompt = answer.model_extra["prompt_token_ids"]
    assert prompt == served.prompt_ids(MESSAGES, TOOLS)
    assert "get_weather" in served.decode(prompt)
    assert answer.usage.prompt_tokens == len(prompt)
    assert answer.model == "tiny"


def test_response_ids_decode_to_the_text(served: Served) -> None:
    answer = served.client().chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=40, seed=5, extra_body=extra()
    )
    choice = answer.choices[0]
    ids = choice.model_extra["token_ids"]
    text_ids = ids[:-1] if choice.finish_reason == "stop" else ids  # the eos is not text
    assert vllm_text(served.loaded.tokenizer, text_ids) == choice.message.content
    assert answer.usage.completion_tokens == len(ids)


def test_greedy_is_deterministic_and_n_gives_distinct_samples(served: Served) -> None:
    client = served.client()
    greedy = [
        client.chat.completions.create(
            model="tiny", messages=MESSAGES, temperature=0, max_tokens=16, extra_body=extra()
        )
        for _ in range(2)
    ]
    assert (
        greedy[0].choices[0].model_extra["token_ids"]
        == greedy[1].choices[0].model_extra["token_ids"]
    )
    answer = client.chat.completions.create(
        model="tiny", messages=MESSAGES, n=3, max_tokens=16, logprobs=True, extra_body=extra()
    )
    assert [c.index for c in answer.choices] == [0, 1, 2]
    samples = [tuple(c.model_extra["token_ids"]) for c in answer.choices]
    assert len(set(samples)) == 3
    assert answer.usage.completion_tokens == sum(len(s) for s in samples)
    for choice in answer.choices:
        assert_logprobs_match(served, served.prompt_ids(MESSAGES), choice, 1.0)


def test_seed_makes_sampling_reproducible(served: Served) -> None:
    client = served.client()

    def sample(seed: int, n: int = 1) -> list[list[int]]:
        answer = client.chat.completions.create(
            model="tiny", messages=MESSAGES, seed=seed, n=n, max_tokens=20, extra_body=extra()
        )
        return [c.model_extra["token_ids"] for c in answer.choices]

    assert sample(11) == sample(11)
    assert sample(11) != sample(12)
    assert sample(11, n=2)[0] == sample(11)[0]  # choice i uses seed + i


def test_max_tokens_ends_with_length(served: Served) -> None:
    for field in ("max_tokens", "max_completion_tokens"):
        answer = served.client().chat.completions.create(
            model="tiny", messages=MESSAGES, extra_body=extra(ignore_eos=True, **{field: 5})
        )
        assert answer.choices[0].finish_reason == "length"
        assert len(answer.choices[0].model_extra["token_ids"]) == 5
        assert answer.usage.completion_tokens == 5


# ----------------------------------------------------------------- stop strings, stream


def sampled_text(served: Served, seed: int) -> tuple[str, list[int]]:
    answer = served.client().chat.completions.create(
        model="tiny", messages=MESSAGES, seed=seed, max_tokens=48, extra_body=extra(ignore_eos=True)
    )
    return answer.choices[0].message.content, answer.choices[0].model_extra["token_ids"]


def test_stop_string_ends_the_text_before_it(served: Served) -> None:
    text, ids = sampled_text(served, seed=21)
    # A stop string taken from the middle of what this seed samples.
    stop = next(text[i : i + 3] for i in range(8, len(text) - 3) if text[i : i + 3].isascii())
    cut = text.find(stop)
    answer = served.client().chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        seed=21,
        max_tokens=48,
        stop=[stop, "never-sampled-stop"],
        logprobs=True,
        extra_body=extra(ignore_eos=True),
    )
    choice = answer.choices[0]
    assert choice.message.content == text[:cut]
    assert choice.finish_reason == "stop"
    # Like vLLM: ids run up to the token that completed the stop string.
    got = choice.model_extra["token_ids"]
    assert got == ids[: len(got)] and len(got) < len(ids)
    assert served.decode(got).startswith(text[:cut] + stop)
    assert_logprobs_match(served, served.prompt_ids(MESSAGES), choice, 1.0)
    streamed = served.client().chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        seed=21,
        max_tokens=48,
        stop=stop,
        stream=True,
        extra_body=extra(ignore_eos=True),
    )
    pieces = [c.choices[0].delta.content or "" for c in streamed if c.choices]
    assert "".join(pieces) == text[:cut]


def test_stream_concatenates_to_the_unary_answer(served: Served) -> None:
    kwargs: dict[str, Any] = {"messages": MESSAGES, "seed": 3, "max_tokens": 30, "n": 2}
    unary = served.client().chat.completions.create(
        model="tiny", logprobs=True, extra_body=extra(), **kwargs
    )
    chunks = list(
        served.client().chat.completions.create(
            model="tiny",
            stream=True,
            logprobs=True,
            stream_options={"include_usage": True},
            extra_body=extra(),
            **kwargs,
        )
    )
    assert chunks[0].model_extra["prompt_token_ids"] == served.prompt_ids(MESSAGES)
    assert chunks[-1].usage.completion_tokens == unary.usage.completion_tokens
    # After the opening, one choice per chunk as vLLM sends them: clients that read
    # choices[0] only (Qwen Code, the Vercel AI SDK) must see every finish_reason.
    assert all(len(chunk.choices) <= 1 for chunk in chunks[1:])
    for want in unary.choices:
        mine = [c for chunk in chunks for c in chunk.choices if c.index == want.index]
        text = "".join(c.delta.content or "" for c in mine)
        ids = [t for c in mine for t in (c.model_extra.get("token_ids") or [])]
        logprobs = [e.logprob for c in mine if c.logprobs for e in c.logprobs.content]
        assert text == want.message.content
        assert ids == want.model_extra["token_ids"]
        assert logprobs == [e.logprob for e in want.logprobs.content]
        assert mine[-1].finish_reason == want.finish_reason
        for c in mine[1:-1]:  # every token chunk carries its ids and their logprobs
            assert len(c.model_extra["token_ids"]) == len(c.logprobs.content) > 0


def test_incremental_detokenizer_never_splits_characters() -> None:
    """Random ids (byte tokens that make broken UTF-8 included): the pieces released one
    token at a time add up to the decode of the whole, less an unfinished character at
    the end, which vLLM's detokenizer never releases either."""
    loaded = load_model("tiny")
    tokens = TokenCodec(loaded.tokenizer)
    rng = random.Random(0)
    vocab = len(loaded.tokenizer)
    kept = TextRule(skip_special_tokens=False)
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        detokenizer = tokens.detokenizer([1], kept)
        released = "".join(detokenizer.add(t) for t in ids) + detokenizer.flush()
        whole = tokens.decode(ids)
        assert whole.startswith(released) and set(whole[len(released) :]) <= {"\ufffd"}
    text = "héllo wörld ✓ 日本"
    detokenizer = tokens.detokenizer([1], kept)
    ids = tokens.encode_prompt(text)
    assert "".join(detokenizer.add(t) for t in ids) + detokenizer.flush() == text


KEEP_SPECIALS = TextRule(skip_special_tokens=False)


def streamed_pieces(
    tokens: TokenCodec, text: str, stops: tuple[str, ...] = (), parser: str | None = None
) -> tuple[list[str], ChoiceOutput]:
    """Feed ``text`` and an eos to an output one token at a time, as a stream would."""
    ids = [*tokens.encode_prompt(text), tokens.tokenizer.eos_token_id]
    out = ChoiceOutput(0, tokens, [1], stops, KEEP_SPECIALS, tool_parser(parser))
    pieces = []
    for i, token in enumerate(ids):
        out.add([token], [0.0], "stop" if i == len(ids) - 1 else None)
        pieces.append(out.emit()[0])
        if out.finish_reason:
            break
    return pieces, out


def test_a_stream_holds_back_what_may_be_a_stop_string_or_a_tool_call() -> None:
    tokens = TokenCodec(load_model("tiny").tokenizer)
    pieces, out = streamed_pieces(tokens, "hello world, hello moon", stops=("o m", "xyz"))
    assert "".join(pieces) == "hello world, hell" == out.text
    assert (out.finish_reason, out.stop_reason) == ("stop", "o m")
    assert not any("o m" in p for p in pieces)

    text = f"Let me check.\n{WEATHER_CALL}"
    pieces, out = streamed_pieces(tokens, text, parser="hermes")
    assert "".join(pieces) == "Let me check."  # the call never shows as content
    content, calls = out.message()
    assert content == "Let me check." and calls is not None and len(calls) == 1

    pieces, out = streamed_pieces(tokens, f"Oops.\n{BROKEN_CALL}", parser="hermes")
    assert "".join(pieces) == f"Oops.\n{BROKEN_CALL}"  # malformed: all of it is content
    assert out.message() == (f"Oops.\n{BROKEN_CALL}", None)


# ------------------------------------------------------------------------ tool calls


def test_tool_call_parser() -> None:
    parsed = parse_tool_calls(WEATHER_CALL)
    assert parsed is not None
    content, (call,) = parsed
    assert content is None and call["id"].startswith("call_") and call["type"] == "function"
    # Re-serialized: the text a harness sends back is not the text the model sampled.
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    two = parse_tool_calls(f"Let me check.\n{WEATHER_CALL}\n{WEATHER_CALL}")
    assert two is not None and two[0] == "Let me check." and len(two[1]) == 2
    as_string = parse_tool_calls(
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": [1,2]}"}</tool_call>'
    )
    assert as_string is not None and as_string[1][0]["function"]["arguments"] == '{"a": [1, 2]}'
    for malformed in (
        BROKEN_CALL,
        "no call at all",
        '<tool_call>\n{"name": "f", "arguments": {}}',  # unterminated
        f"{WEATHER_CALL}<tool_call>{{",  # a second, unterminated
        '<tool_call>["f"]</tool_call>',
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
    ):
        assert parse_tool_calls(malformed) is None


def train_tool_caller(loaded: LoadedModel, served: Served) -> torch.nn.Module:
    """A copy of the tiny model that answers WEATHER and BROKEN with their tool calls
    (a few dozen AdamW steps: it only has to memorize two answers)."""
    tokenizer = loaded.tokenizer
    pairs = []
    for messages, target in ((WEATHER, WEATHER_CALL), (BROKEN, BROKEN_CALL)):
        prompt = served.prompt_ids(messages, TOOLS)
        answer = [*tokenizer.encode(target, add_special_tokens=False), tokenizer.eos_token_id]
        pairs.append((prompt, answer))
    width = max(len(p) + len(a) for p, a in pairs)
    ids = torch.full((len(pairs), width), tokenizer.pad_token_id)
    labels = torch.full((len(pairs), width), -100)
    mask = torch.zeros((len(pairs), width), dtype=torch.long)
    for j, (prompt, answer) in enumerate(pairs):
        ids[j, : len(prompt) + len(answer)] = torch.tensor(prompt + answer)
        labels[j, len(prompt) : len(prompt) + len(answer)] = torch.tensor(answer)
        mask[j, : len(prompt) + len(answer)] = 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = copy.deepcopy(loaded.model).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for _ in range(200):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if loss.item() < 0.01:  # greedy decoding reproduces both answers well before
                break
    assert loss.item() < 0.01
    return model.eval()


@pytest.mark.slow
def test_update_weights_mid_traffic_then_tool_calls(served: Served) -> None:
    """Generations running when the weights change finish under the old weights (and
    say so); the swap waits for them; later calls use the new weights: here a model
    trained to answer with tool calls, which the server parses (or, malformed, leaves as
    content)."""
    engine, loaded = served.engine, served.loaded
    old = copy.deepcopy(loaded.model)
    trained = train_tool_caller(loaded, served)
    version = engine.policy_version
    results: dict[str, Any] = {}

    def call(name: str, messages: list[dict[str, Any]], **kwargs: Any) -> None:
        raw = served.client().chat.completions.with_raw_response.create(
            model="tiny", messages=messages, logprobs=True, **kwargs
        )
        results[name] = (int(raw.headers[POLICY_VERSION_HEADER]), raw.parse())

    def old_call(k: int) -> None:
        call(f"old{k}", MESSAGES, max_tokens=150, seed=k, extra_body=extra(ignore_eos=True))

    running = [threading.Thread(target=old_call, args=(k,)) for k in range(3)]
    for thread in running:
        thread.start()
    deadline = time.monotonic() + 10
    while engine.running < 3:
        assert time.monotonic() < deadline
        time.sleep(0.002)
    swapper = threading.Thread(
        target=lambda: results.update(swapped=engine.update_weights(trained.state_dict()))
    )
    swapper.start()
    while engine.admitting and "swapped" not in results:
        time.sleep(0.001)
    # Asks while the swap waits for the running ones: it must get the new weights.
    waiting = threading.Thread(
        target=call,
        args=("new", WEATHER),
        kwargs={"tools": TOOLS, "temperature": 0, "max_tokens": 40, "extra_body": extra()},
    )
    waiting.start()
    for thread in [*running, swapper, waiting]:
        thread.join(timeout=60)
    new_version = results["swapped"]
    assert new_version == version + 1 == engine.policy_version
    for k in range(3):
        header, answer = results[f"old{k}"]
        # Sampled by the old weights from first to last token: the swap waited for them.
        assert header == version
        assert len(answer.choices[0].model_extra["token_ids"]) == 150
        assert_logprobs_match(served, served.prompt_ids(MESSAGES), answer.choices[0], 1.0, old)

    header, answer = results["new"]
    assert header == new_version
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call_,) = choice.message.tool_calls
    assert call_.id.startswith("call_") and call_.function.name == "get_weather"
    assert call_.function.arguments == '{"city": "Paris"}'  # the model wrote {"city":"Paris"}
    ids = choice.model_extra["token_ids"]
    assert served.decode(ids[:-1]) == WEATHER_CALL  # the sampled text, eos left out
    assert_logprobs_match(served, served.prompt_ids(WEATHER, TOOLS), choice, 0.0, trained)

    client = served.client()
    broken = client.chat.completions.create(
        model="tiny", messages=BROKEN, tools=TOOLS, temperature=0, max_tokens=40
    ).choices[0]
    assert broken.finish_reason == "stop" and not broken.message.tool_calls
    assert broken.message.content == BROKEN_CALL
    # tool_choice none: the same answer stays text, its special tokens skipped as vLLM
    # skips them by default; asked to keep them, it is the call's text as sampled.
    for rule, content in (
        ({}, WEATHER_CALL.removeprefix("<tool_call>").removesuffix("</tool_call>")),
        ({"skip_special_tokens": False}, WEATHER_CALL),
    ):
        plain = client.chat.completions.create(
            model="tiny",
            messages=WEATHER,
            tools=TOOLS,
            tool_choice="none",
            temperature=0,
            max_tokens=40,
            extra_body=rule,
        ).choices[0]
        assert plain.message.content == content and not plain.message.tool_calls

    # Streamed: the call arrives whole in the closing chunk; ids as in the unary answer.
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=WEATHER,
            tools=TOOLS,
            temperature=0,
            max_tokens=40,
            stream=True,
            extra_body=extra(),
        )
    )
    deltas = [c for chunk in chunks for c in chunk.choices]
    assert [t for d in deltas for t in (d.model_extra.get("token_ids") or [])] == ids
    assert "".join(d.delta.content or "" for d in deltas) == ""
    (streamed_call,) = [t for d in deltas for t in (d.delta.tool_calls or [])]
    assert streamed_call.function.arguments == '{"city": "Paris"}'
    assert deltas[-1].finish_reason == "tool_calls"

    engine.update_weights(old.state_dict(), policy_version=version)  # later tests: old weights


# ------------------------------------------------------------------------- batching


def test_concurrent_requests_are_decoded_together(served: Served) -> None:
    engine = served.engine
    requests, tokens = 8, 24

    async def ask(client: openai.AsyncOpenAI, k: int) -> Any:
        return await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": f"request {k}"}],
            max_tokens=tokens,
            extra_body={"ignore_eos": True},
        )

    async def together() -> None:
        async with served.async_client() as client:
            await asyncio.gather(*(ask(client, k) for k in range(requests)))

    async def one_by_one() -> None:
        async with served.async_client() as client:
            for k in range(requests):
                await ask(client, k)

    def forwards(run: Any) -> tuple[int, float]:
        before, start = engine.stats.forward_passes, time.perf_counter()
        asyncio.run(run())
        return engine.stats.forward_passes - before, time.perf_counter() - start

    sequential, sequential_s = forwards(one_by_one)
    assert sequential == requests * tokens  # a prefill and tokens-1 decode steps each
    engine.stats.max_running = 0
    batched, batched_s = forwards(together)
    # One decode step serves every running request: about `tokens` steps plus a few
    # prefills (however the arrivals spread) instead of requests * tokens.
    assert batched <= sequential / 3
    assert engine.stats.max_running >= requests // 2
    assert batched_s < sequential_s


def test_a_client_that_goes_away_stops_its_generation(served: Served) -> None:
    engine = served.engine
    with httpx.stream(
        "POST",
        f"{served.url}/chat/completions",
        json={"messages": MESSAGES, "max_tokens": 400, "stream": True, "ignore_eos": True},
        headers=served.headers,
        timeout=10,
    ) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert engine.running == 1
    deadline = time.monotonic() + 10
    while engine.running:  # its row leaves the batch instead of running to 400 tokens
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert engine.stats.tokens_generated > 0


def test_a_weight_update_that_cannot_drain_gives_up_and_resumes(served: Served) -> None:
    engine = served.engine
    version = engine.policy_version
    result: dict[str, Any] = {}

    def long_call() -> None:
        result["answer"] = served.client().chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=300, extra_body={"ignore_eos": True}
        )

    thread = threading.Thread(target=long_call)
    thread.start()
    deadline = time.monotonic() + 10
    while engine.running == 0:
        assert time.monotonic() < deadline
        time.sleep(0.002)
    with pytest.raises(TimeoutError):
        engine.update_weights(None, timeout=0.01)
    assert engine.admitting and engine.policy_version == version
    thread.join(timeout=60)
    assert result["answer"].choices[0].finish_reason == "length"


# ------------------------------------------------------------------------- bad requests


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b"[]", 400, "JSON object"),
        (b'{"messages": []}', 400, "messages"),
        (b'{"messages": [{"role": "wizard", "content": "x"}]}', 400, "role"),
        (b'{"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}', 404, "gpt-9"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}', 400, "context"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', 400, "max_tokens"),
        (
            b'{"messages": [{"role": "user", "content": "x"}], "temperature": -1}',
            400,
            "temperature",
        ),
        (b'{"messages": [{"role": "user", "content": "x"}], "top_p": 0}', 400, "top_p"),
        (b'{"messages": [{"role": "user", "content": "x"}], "n": 99}', 400, "'n'"),
        (b'{"messages": [{"role": "user", "content": "x"}], "stop": 3}', 400, "stop"),
        (b'{"messages": [{"role": "user", "content": "x"}], "tools": [{}]}', 400, "tools"),
        (b'{"messages": [{"role": "user", "content": "x"}], "stream": "yes"}', 400, "stream"),
    ],
)
def test_bad_requests_get_an_openai_error(
    served: Served, body: bytes, status: int, says: str
) -> None:
    response = httpx.post(
        f"{served.url}/chat/completions", content=body, headers=served.headers, timeout=10
    )
    assert response.status_code == status
    error = ErrorResponse.model_validate_json(response.content).error
    assert says in error.message and error.type


def test_openai_client_sees_the_error_message(served: Served) -> None:
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        served.client().chat.completions.create(model="other", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        served.client().chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10**6)


def test_models_and_health(served: Served) -> None:
    (model,) = served.client().models.list().data
    assert model.id == "tiny"
    # The health check alone needs no key: probes and the trainer's wait at start.
    health = httpx.get(served.url.removesuffix("/v1") + "/health", timeout=10).json()
    assert health["status"] == "ok" and health["policy_version"] == served.engine.policy_version


# -------------------------------------------------------------------- the inference key

ROUTES = [
    ("POST", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4}),
    ("POST", "/v1/completions", {"prompt": "hello", "max_tokens": 4}),
    ("POST", "/tokenize", {"prompt": "hello"}),
    ("GET", "/v1/models", None),
    ("GET", "/no/such/route", None),
]
NOT_THE_KEY = {
    "no key": {},
    "a wrong key": {"Authorization": f"Bearer {KEY[:-1]}"},  # all but its last character
    "a bearer without a key": {"Authorization": "Bearer"},
    "the key without a scheme": {"Authorization": KEY},
    "the key as Basic": {"Authorization": f"Basic {KEY}"},
    "the key as x-api-key": {"x-api-key": KEY},
}


@pytest.mark.parametrize(("method", "path", "body"), ROUTES, ids=[r[1] for r in ROUTES])
@pytest.mark.parametrize("headers", list(NOT_THE_KEY.values()), ids=list(NOT_THE_KEY))
def test_a_call_without_the_key_is_refused_on_every_route(
    served: Served, method: str, path: str, body: Any, headers: dict[str, str]
) -> None:
    """An agent on the machine calls the server on loopback directly, skipping the
    gateway (no record, no admission pause, no rate limit): 401 in the server's one error
    shape, nothing generated, and a missing route is refused like one that exists."""
    before = served.engine.stats.tokens_generated
    url = served.url.removesuffix("/v1") + path
    response = httpx.request(method, url, json=body, headers=headers, timeout=10)
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"
    error = ErrorResponse.model_validate_json(response.content).error
    assert error.type == "authentication_error" and "key" in error.message
    assert KEY not in response.text
    assert served.engine.stats.tokens_generated == before


def test_the_openai_client_with_a_wrong_key_is_told_why(served: Served) -> None:
    client = openai.OpenAI(base_url=served.url, api_key="sk-guess", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="invalid inference key"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4)


@pytest.mark.slow
def test_the_command_line_requires_the_key_it_is_given(tmp_path: Path) -> None:
    """``AGL_INFERENCE_KEY`` in agl.serve's environment: calls without it get 401, calls
    with it are answered, and the key is in none of what the server printed."""
    port = free_port()
    log_path = tmp_path / "serve.log"
    command = [sys.executable, "-m", "agl.serve", f"port={port}", "torch_threads=1"]
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            command, env={**os.environ, KEY_ENV_VAR: KEY}, stdout=log_file, stderr=log_file
        )
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", process, timeout_s=120)
        url = f"http://127.0.0.1:{port}/v1"
        guess = openai.OpenAI(base_url=url, api_key="sk-guess", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            guess.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4)
        client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0)
        answer = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4)
        assert answer.usage is not None and answer.usage.completion_tokens >= 1
    finally:
        process.terminate()
        process.wait(timeout=30)
    printed = log_path.read_text()
    assert "serving" in printed and KEY not in printed and "no key" not in printed


@pytest.mark.parametrize(
    ("args", "key", "says"),
    [
        (["host=0.0.0.0"], "", "refusing to serve on 0.0.0.0 (not loopback) without a key"),
        (["key_file=/no/such/file"], "", "key_file=/no/such/file: No such file or directory"),
        ([], "two words", f"${KEY_ENV_VAR} holds a key with whitespace inside"),
    ],
    ids=["network without a key", "missing key file", "a key of two words"],
)
def test_the_command_line_refuses_a_bad_key_in_one_line(
    args: list[str], key: str, says: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "agl.serve", *args],
        env={**os.environ, KEY_ENV_VAR: key},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert done.stderr.startswith(f"agl.serve: {says}")


def test_the_command_line_help_says_how_clients_send_the_key() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "agl.serve", "--help"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0
    assert "Authorization: Bearer <key>" in done.stdout and KEY_ENV_VAR in done.stdout
    assert "key_file=" in done.stdout


@pytest.mark.slow
def test_the_command_line_serves() -> None:
    bad = subprocess.run(
        [sys.executable, "-m", "agl.serve", "prot=1"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "prot" in bad.stderr
    with serve_process(max_batch_size=4, torch_threads=1, log_level="warning") as server:
        client = openai.OpenAI(base_url=server.url, api_key="-", max_retries=0)
        answer = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4)
        assert answer.model == "tiny" and answer.usage.completion_tokens >= 1


# ------------------------------------------------------------------ through the gateway


def test_calls_through_the_gateway_proxy_are_recorded(served: Served, tmp_path: Path) -> None:
    """The gateway, given the inference key (``inference_key_file``), sends it upstream:
    an agent's calls through the proxy with its attempt key are answered and recorded,
    while that attempt key opens nothing on the inference server itself."""
    key_file = tmp_path / "inference_key"
    key_file.write_text(KEY + "\n")
    with (
        gateway_process(tmp_path / "gateway", inference_key_file=str(key_file)) as gateway,
        GatewayClient(gateway.url, gateway.token) as admin,
    ):
        admin.register_models([{"model": "tiny", "endpoint": served.url, "policy_version": 4}])
        admin.create_rollouts([{"rollout_id": "r1", "group_id": "g", "input": {}}])
        rollout = admin.patch_rollout("r1", "running")
        agent = openai.OpenAI(
            base_url=proxy_base_url(gateway.url, "r1", rollout.attempt, rollout.mode),
            api_key=rollout.attempt_key,
            max_retries=0,
        )
        unary = agent.chat.completions.create(model="any", messages=MESSAGES, max_tokens=20)
        stream = agent.chat.completions.create(
            model="any", messages=MESSAGES, max_tokens=20, seed=1, stream=True
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        events = [e.data for e in admin.get_events("r1", type="model_request")]
        direct = openai.OpenAI(base_url=served.url, api_key=rollout.attempt_key, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            direct.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4)
    assert [e["response"] for e in events] == [unary.choices[0].message.content, streamed]
    for event in events:
        assert event["prompt_ids"] == served.prompt_ids(MESSAGES)
        ids = event["response_ids"]
        text_ids = ids[:-1] if event["finish_reason"] == "stop" else ids
        assert vllm_text(served.loaded.tokenizer, text_ids) == event["response"]
        assert event["text_rule"] == {
            "skip_special_tokens": True,
            "spaces_between_special_tokens": True,
            "include_stop_str_in_output": False,
        }
        assert len(event["logprobs"]) == len(ids) > 0
        assert event["policy_version"] == 4
        want = teacher_forced(served.loaded.model, event["prompt_ids"], ids, 1.0)
        assert max(abs(a - b) for a, b in zip(event["logprobs"], want, strict=True)) < TOLERANCE


@pytest.mark.slow
def test_impossible_engine_options_fail_in_one_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "agl.serve", "max_batch_size=0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "max_batch_size must be at least 1" in done.stderr
    assert "Traceback" not in done.stderr
