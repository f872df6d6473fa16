"""One rule for what text a response is (``agl.core.contracts.text_rule``).

- the proxy's resolution: vLLM's defaults, the harness's own values, special tokens kept
  with tools, a non-boolean refused with a 400 through the real gateway;
- the embedded engine's text of sampled ids equals vLLM's (its own detokenizer, run in
  vLLM's environment) for random ids with special tokens and stop strings anywhere,
  under every rule, on three tokenizers (byte-level BPE, two word-level ones);
- the trainer's check finds no false positive on either engine's text and still catches
  ids that were changed;
- a skipped special token or a cut stop string marks the call, and a merge that breaks
  inside it says ``output_transformed``.
"""

from __future__ import annotations

import itertools
import json
import random
import subprocess
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import openai
import pytest

from agl.backends.inference.models import load_model
from agl.backends.inference.server.text import ChoiceOutput
from agl.backends.inference.server.tokens import TokenCodec
from agl.backends.inference.vllm import find_vllm_python
from agl.core.client import GatewayClient
from agl.core.config_groups import text_decode
from agl.core.contracts.records import Event
from agl.core.contracts.samples import BreakReason
from agl.core.contracts.text_rule import (
    TextRule,
    TextRuleError,
    parse_text_rule,
    requested_text_rule,
    text_rule_of,
    text_rule_record,
)
from agl.core.trainer.calls import output_transformed, read_calls, text_mismatch
from agl.strategies.merge.prefix import prefix as prefix_merge
from agl.testing.processes import GatewayProcess, gateway_process, serve_process
from tests.conftest import agent
from tests.helpers.hf_folders import write_llama, write_qwen3

RULES = [TextRule(*flags) for flags in itertools.product((True, False), repeat=3)]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


# ------------------------------------------------------------------------ resolution


def test_the_default_rule_is_vllms() -> None:
    assert requested_text_rule({"messages": []}) == TextRule(True, True, False)


def test_the_harness_chooses_its_rule() -> None:
    asked = {"skip_special_tokens": False, "include_stop_str_in_output": True}
    assert requested_text_rule(asked) == TextRule(False, True, True)
    assert requested_text_rule({"spaces_between_special_tokens": False}) == TextRule(
        True, False, False
    )


def test_with_tools_special_tokens_are_kept() -> None:
    assert not requested_text_rule({"tools": TOOLS}).skip_special_tokens
    assert not requested_text_rule(
        {"tools": TOOLS, "skip_special_tokens": True}
    ).skip_special_tokens
    # No tool can be called: the harness's rule stands.
    assert requested_text_rule({"tools": TOOLS, "tool_choice": "none"}).skip_special_tokens
    assert requested_text_rule({"tools": []}).skip_special_tokens


def test_a_rule_that_is_not_boolean_is_refused() -> None:
    with pytest.raises(TextRuleError, match="'skip_special_tokens' must be a boolean"):
        parse_text_rule({"skip_special_tokens": "no"})
    with pytest.raises(TextRuleError, match="include_stop_str_in_output"):
        parse_text_rule({"include_stop_str_in_output": 1})


def test_the_record_reads_back() -> None:
    for rule in RULES:
        assert text_rule_of({"text_rule": text_rule_record(rule)}) == rule
    assert text_rule_of({}) is None
    assert text_rule_of({"text_rule": {"skip_special_tokens": "x"}}) is None


def harness(gateway: GatewayProcess, admin: GatewayClient, model: str, url: str) -> openai.OpenAI:
    """The client of rollout ``r``'s running attempt, its calls going to ``url``."""
    admin.register_models([{"model": model, "endpoint": url}])
    admin.create_rollouts([{"rollout_id": "r", "group_id": "g", "input": {}}])
    return agent(gateway, admin.patch_rollout("r", "running"))


def test_the_gateway_refuses_a_bad_rule_in_its_error_shape(tmp_path: Path) -> None:
    with (
        gateway_process(tmp_path / "gateway") as gateway,
        GatewayClient(gateway.url, gateway.token) as admin,
    ):
        client = harness(gateway, admin, "m", "http://127.0.0.1:9/v1")
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "hi"}],
                extra_body={"skip_special_tokens": 0},
            )
    assert refused.value.status_code == 400
    assert refused.value.body["message"] == "'skip_special_tokens' must be a boolean"


# ------------------------------------------------------- both engines, one text


@dataclass(frozen=True)
class Case:
    prompt_ids: list[int]
    response_ids: list[int]
    stops: list[str]
    rule: TextRule
    eos_stop: bool  # the engine stopped on the last id, an eos


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    tiny = root / "tiny"
    load_model("tiny").tokenizer.save_pretrained(tiny)
    return {
        "tiny": tiny,
        "qwen3": write_qwen3(root / "qwen3"),
        "llama": write_llama(root / "llama"),
    }


def _load(folder: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def sampled_cases(tokenizer: Any, count: int, seed: int) -> list[Case]:
    """Random responses with special tokens anywhere, some ending in eos, and stop
    strings cut from their own text (so they do stop it), under every rule in turn."""
    rng = random.Random(seed)
    vocab = len(tokenizer)
    specials = sorted(text_decode(tokenizer).special_ids)
    tokens = TokenCodec(tokenizer)
    cases = []
    for i in range(count):
        rule = RULES[i % len(RULES)]
        response = [
            rng.choice(specials) if rng.random() < 0.15 else rng.randrange(vocab)
            for _ in range(rng.randrange(1, 40))
        ]
        eos_stop = rng.random() < 0.4
        if eos_stop:
            response.append(tokenizer.eos_token_id)
        stops: list[str] = []
        text = tokens.decode(response, rule.skip_special_tokens)
        if rng.random() < 0.6 and len(text) > 2:
            at = rng.randrange(len(text) - 1)
            stops.append(text[at : at + rng.randrange(1, 5)])
            if rng.random() < 0.3:
                stops.append("never in any text \x00")
        # Half the prompts are whole text (what a chat template renders), half random ids,
        # which may end inside a character whose bytes the response then completes.
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 8))]
        if i % 2:
            prompt = tokens.encode_prompt(tokens.decode(prompt, True).replace("\ufffd", "") + "\n")
        cases.append(Case(prompt, response, stops, rule, eos_stop))
    return cases


def embedded_text(tokens: TokenCodec, case: Case) -> dict[str, Any]:
    """The embedded engine's output for ``case``, fed as the engine streams tokens."""
    out = ChoiceOutput(0, tokens, case.prompt_ids, tuple(case.stops), case.rule, None)
    ids = case.response_ids
    for k, token in enumerate(ids):
        finish = ("stop" if case.eos_stop else "length") if k == len(ids) - 1 else None
        if out.add([token], [0.0], finish):
            break
    return {"text": out.text, "stop_reason": out.stop_reason, "kept": len(out.token_ids)}


def vllm_text(python: str, folder: Path, cases: list[Case]) -> list[dict[str, Any]]:
    job = {
        "tokenizer": str(folder),
        "cases": [{**asdict(c), "rule": text_rule_record(c.rule)} for c in cases],
    }
    script = Path(__file__).parents[2] / "vllm" / "detokenize.py"
    done = subprocess.run(
        [python, str(script)], input=json.dumps(job), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def recorded(case: Case, result: dict[str, Any]) -> dict[str, Any]:
    """The call as the proxy records it."""
    data: dict[str, Any] = {
        "prompt_ids": case.prompt_ids,
        "response_ids": case.response_ids[: result["kept"]],
        "logprobs": [0.0] * result["kept"],
        "response": result["text"],
        "text_rule": text_rule_record(case.rule),
        "finish_reason": "stop" if case.eos_stop or result["stop_reason"] else "length",
    }
    if result["stop_reason"] is not None:
        data["stop_reason"] = result["stop_reason"]
    return data


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny", "qwen3", "llama"])
def test_both_engines_make_one_text_of_the_same_ids(tokenizers: dict[str, Path], name: str) -> None:
    python = find_vllm_python()
    if python is None:
        pytest.skip("vLLM is not installed: bash tests/vllm/install.sh")
    tokenizer = _load(tokenizers[name])
    cases = sampled_cases(tokenizer, 400, seed=len(name))
    tokens = TokenCodec(tokenizer)
    ours = [embedded_text(tokens, c) for c in cases]
    theirs = vllm_text(python, tokenizers[name], cases)
    differ = [(c, a, b) for c, a, b in zip(cases, ours, theirs, strict=True) if a != b]
    assert not differ, differ[:3]
    # The cases exercise what the rule is about.
    assert sum(bool(r["stop_reason"]) for r in ours) > 50
    decode = text_decode(tokenizer)
    assert (
        sum(
            output_transformed(recorded(c, r), decode.special_ids)
            for c, r in zip(cases, ours, strict=True)
        )
        > 100
    )


@pytest.mark.parametrize("name", ["tiny", "qwen3", "llama"])
def test_the_check_finds_no_false_positive_and_catches_changed_ids(
    tokenizers: dict[str, Path], name: str
) -> None:
    tokenizer = _load(tokenizers[name])
    decode = text_decode(tokenizer)
    tokens = TokenCodec(tokenizer)
    plain = [t for t in range(len(tokenizer)) if t not in decode.special_ids]
    rng = random.Random(7)
    checked = caught = 0
    for case in sampled_cases(tokenizer, 800, seed=11):
        data = recorded(case, embedded_text(tokens, case))
        assert not text_mismatch(data, decode), data
        ids = data["response_ids"]
        at = next((k for k, t in enumerate(ids) if t not in decode.special_ids), None)
        if at is None or len(data["response"].strip()) < 3:
            continue
        changed = [*ids[:at], rng.choice([t for t in plain if t != ids[at]]), *ids[at + 1 :]]
        checked += 1
        caught += text_mismatch({**data, "response_ids": changed}, decode)
    assert checked > 300 and caught / checked > 0.9, (caught, checked)


@pytest.mark.slow
def test_through_the_gateway_the_embedded_engine_records_its_rule(tmp_path: Path) -> None:
    """Unary and streamed calls with stop strings under three rules, through the real
    gateway to ``agl.serve``: each call records the rule it was answered under and the
    stop string that cut it; the trainer reads every call as valid and marks the cut ones."""
    rules = [{}, {"skip_special_tokens": False}, {"include_stop_str_in_output": True}]
    with (
        serve_process("tiny") as served,
        gateway_process(tmp_path / "gateway") as gateway,
        GatewayClient(gateway.url, gateway.token) as admin,
    ):
        client = harness(gateway, admin, served.model, served.url)
        texts = []
        for seed in range(12):
            asked = dict(
                model="tiny",
                messages=[{"role": "user", "content": "Say something."}],
                max_tokens=30,
                seed=seed,
                stop=[" ", "e"],
                extra_body=rules[seed % 3],
            )
            if seed % 2:
                chunks = client.chat.completions.create(stream=True, **asked)
                texts.append("".join(c.choices[0].delta.content or "" for c in chunks))
            else:
                texts.append(client.chat.completions.create(**asked).choices[0].message.content)
        events = admin.get_events("r", type="model_request")
    data = [e.data for e in events]
    assert [d["response"] for d in data] == texts
    for seed, d in enumerate(data):
        assert text_rule_of(d) == parse_text_rule(rules[seed % 3])
    stopped = [d for d in data if "stop_reason" in d]
    assert len(stopped) >= 6 and all(d["stop_reason"] in (" ", "e") for d in stopped)
    kept = [d for d in stopped if d["text_rule"]["include_stop_str_in_output"]]
    assert kept and all(d["response"].endswith(d["stop_reason"]) for d in kept)
    read = read_calls(events, text_decode(load_model("tiny").tokenizer))
    assert not read.invalid and len(read.calls) == 12
    cut = ["stop_reason" in d and not d["text_rule"]["include_stop_str_in_output"] for d in data]
    assert any(cut)
    assert all(c.output_transformed for c, was in zip(read.calls, cut, strict=True) if was)


# ------------------------------------------------------------------- merge metrics


def _event(sequence: int, data: dict[str, Any]) -> Event:
    return Event(
        rollout_id="r",
        attempt=1,
        event_id=str(sequence),
        sequence=sequence,
        type="model_request",
        data=data,
        time=0.0,
    )


def test_a_break_inside_a_cut_response_is_named_output_transformed() -> None:
    """A stop string cut from the first answer: the harness's next prompt holds the text
    it got, so the sample cannot continue and the break says why."""
    tokenizer = load_model("tiny").tokenizer
    decode = text_decode(tokenizer)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    prompt = encode("Question: two and two?\nAnswer:")
    response = encode(" four. The end")
    first = {
        "prompt_ids": prompt,
        "response_ids": response,
        "logprobs": [0.0] * len(response),
        "response": " four",
        "text_rule": text_rule_record(TextRule()),
        "stop_reason": ".",
        "finish_reason": "stop",
    }
    follow = [*prompt, *encode(" four\nQuestion: and three?\nAnswer:")]
    second = {**first, "prompt_ids": follow, "stop_reason": None, "response": " four"}
    read = read_calls([_event(0, first), _event(1, second)], decode)
    assert not read.invalid
    assert [c.output_transformed for c in read.calls] == [True, False]
    samples = prefix_merge(read.calls, "r", "g")
    assert [s.break_reason for s in samples] == [None, BreakReason.OUTPUT_TRANSFORMED]
    # The same break, with a text the engine did not cut, is a retokenization.
    uncut = [replace(c, output_transformed=False) for c in read.calls]
    assert prefix_merge(uncut, "r", "g")[1].break_reason is BreakReason.RESPONSE_RETOKENIZED


def test_a_skipped_special_token_marks_the_call_and_a_final_eos_does_not() -> None:
    tokenizer = load_model("tiny").tokenizer
    specials = text_decode(tokenizer).special_ids
    eos, tool_response = tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("</tool_response>")
    base = {"text_rule": text_rule_record(TextRule()), "finish_reason": "stop"}
    assert not output_transformed({**base, "response_ids": [40, 41, eos]}, specials)
    assert output_transformed({**base, "response_ids": [40, tool_response, 41, eos]}, specials)
    # Cut short by max_tokens, the last special token did not end the turn: it is lost.
    at_length = {**base, "finish_reason": "length"}
    assert output_transformed({**at_length, "response_ids": [40, 41, tool_response]}, specials)
    kept = {**base, "text_rule": text_rule_record(TextRule(skip_special_tokens=False))}
    assert not output_transformed({**kept, "response_ids": [40, tool_response, 41]}, specials)
    # A call recorded before the rule was: nothing is known, nothing is claimed.
    assert not output_transformed({"response_ids": [40, tool_response, 41]}, specials)
