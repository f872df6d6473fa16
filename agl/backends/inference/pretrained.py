"""Any Hugging Face causal LM by a local folder or a hub id (``model=hf``), with its own
chat template and special tokens, used as they are.

Only what the user names is changed: ``chat_template`` (a jinja file) replaces the
tokenizer's template. The model is returned in eval mode on the CPU in ``dtype``; the
engine, the trainer and every backend take it from there (vLLM and verl's Ray workers get
the trainer's copy written to a folder, so they start from the same weights, warm-up
included).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PretrainedUnavailable(Exception):
    """The model at the path cannot be loaded here; the message says why, in one line."""


@dataclass(frozen=True)
class PretrainedOptions:
    path: str  # a folder with config.json, or a hub id (its files in the HF cache offline)
    dtype: str = "float32"
    attn_implementation: str | None = None  # null: transformers' default (sdpa)
    revision: str | None = None  # a hub branch, tag or commit
    trust_remote_code: bool = False  # runs the model repository's own Python
    chat_template: str | None = None  # a jinja file replacing the tokenizer's template
    max_context: int | None = None  # null: the model's positions (or the tokenizer's limit)

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("model=hf needs model.path: a model folder or a hub id")
        if self.dtype not in DTYPES:
            raise ValueError(f"model.dtype={self.dtype}: one of {', '.join(DTYPES)}")


@dataclass
class Pretrained:
    model: transformers.PreTrainedModel
    tokenizer: transformers.PreTrainedTokenizerBase
    max_context: int


# A folder's tokenizer is one of these; without any, AutoTokenizer may still answer one
# of its own (a vocabulary of one token), which would train on nonsense.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def is_local(path: str) -> bool:
    """A filesystem path rather than a hub id (``org/name``)."""
    return path.startswith(("/", ".", "~")) or Path(path).expanduser().exists()


def load_pretrained(options: PretrainedOptions) -> Pretrained:
    """The model and tokenizer at ``options.path`` (PretrainedUnavailable, one line)."""
    where = f"model.path={options.path}"
    if is_local(options.path):
        folder = Path(options.path).expanduser()
        if not (folder / "config.json").is_file():
            raise PretrainedUnavailable(f"{where}: no such model folder (no config.json)")
        if not any((folder / name).is_file() for name in TOKENIZER_FILES):
            raise PretrainedUnavailable(
                f"{where}: the folder has no tokenizer ({', '.join(TOKENIZER_FILES)})"
            )
    common: dict[str, Any] = {
        "revision": options.revision,
        "trust_remote_code": options.trust_remote_code,
    }
    try:
        tokenizer = AutoTokenizer.from_pretrained(options.path, **common)
        extra = {"attn_implementation": options.attn_implementation}
        model = AutoModelForCausalLM.from_pretrained(
            options.path,
            dtype=DTYPES[options.dtype],
            **common,
            **{k: v for k, v in extra.items() if v is not None},
        )
    except Exception as error:  # a hub miss, a corrupt file, a shape mismatch: one line
        raise PretrainedUnavailable(f"{where}: {_first_line(error)}") from None
    embeddings = cast("torch.nn.Embedding", model.get_input_embeddings())  # typed a Module
    rows = embeddings.num_embeddings
    if len(tokenizer) > rows:
        raise PretrainedUnavailable(
            f"{where}: the tokenizer has {len(tokenizer)} tokens, the model embeds {rows}"
        )
    if options.chat_template is not None:
        template = Path(options.chat_template)
        try:
            tokenizer.chat_template = template.read_text()
        except (OSError, UnicodeDecodeError) as error:
            raise PretrainedUnavailable(
                f"model.chat_template={template}: cannot be read ({_first_line(error)})"
            ) from None
    if not tokenizer.chat_template:
        raise PretrainedUnavailable(
            f"model.path={options.path}: the tokenizer has no chat template; "
            "give one with model.chat_template=FILE"
        )
    if tokenizer.eos_token_id is None and model.generation_config.eos_token_id is None:
        raise PretrainedUnavailable(
            f"model.path={options.path}: neither the tokenizer nor the generation config "
            "names an eos token, so generation would never stop"
        )
    context = options.max_context or _context_length(model, tokenizer)
    return Pretrained(model.eval(), tokenizer, context)


def _context_length(model: transformers.PreTrainedModel, tokenizer: Any) -> int:
    """The model's positions; the tokenizer's limit when it states a real one."""
    positions = getattr(model.config, "max_position_embeddings", None)
    limit = getattr(tokenizer, "model_max_length", None)
    known = [n for n in (positions, limit) if isinstance(n, int) and 0 < n < 10**8]
    if not known:
        raise PretrainedUnavailable(
            "the model states no context length; give one with model.max_context=N"
        )
    return min(known)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
