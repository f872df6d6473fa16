"""The tokenizer as the server uses it: ids to text and back on the Rust tokenizer's hot
paths, each token's text and bytes for logprobs, and incremental detokenization under a
text rule (``agl.core.contracts.text_rule``), exactly as vLLM's detokenizer does it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from tokenizers.decoders import DecodeStream

from agl.backends.inference.byte_level import byte_level_chars
from agl.core.contracts.text_rule import TextRule

# tokenizers' DecodeStream raises this when a byte-level decode is not monotonic; vLLM
# starts a fresh stream (without the prompt) and goes on, and so does agl.
_INVALID_PREFIX = "Invalid prefix encountered"


class TokenCodec:
    """What the server needs from the tokenizer, the hot paths on the Rust tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        self._added = {v: k for k, v in tokenizer.get_added_vocab().items()}
        decoder = getattr(self.backend, "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"
        self._byte_of = {ch: b for b, ch in enumerate(byte_level_chars())}
        self._entries: dict[int, tuple[str, list[int]]] = {}

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        if self.backend is not None:
            return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def detokenizer(self, prompt_ids: Sequence[int], rule: TextRule) -> Detokenizer:
        """Text of the tokens sampled after ``prompt_ids``, one token at a time."""
        if self.backend is not None:
            return StreamDetokenizer(self.backend, prompt_ids, rule, self._added)
        return WindowDetokenizer(self, rule)

    def encode_prompt(self, text: str) -> list[int]:
        return self.encode_text(text, add_special_tokens=False)

    def encode_text(self, text: str, add_special_tokens: bool) -> list[int]:
        """A text completion's prompt: with the tokenizer's special tokens (a bos) by
        default, as vLLM; a rendered chat template already holds its own."""
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def entry(self, token_id: int) -> tuple[str, list[int]]:
        """A token's text and its bytes, for ``logprobs.content`` (cached)."""
        found = self._entries.get(token_id)
        if found is None:
            text = self.decode([token_id])
            raw = text.encode()
            if self._byte_level and token_id not in self._added:
                piece = self.tokenizer.convert_ids_to_tokens(token_id)
                if piece is not None and all(ch in self._byte_of for ch in piece):
                    raw = bytes(self._byte_of[ch] for ch in piece)
            found = self._entries[token_id] = (text, list(raw))
        return found


class Detokenizer(Protocol):
    """Releases text as tokens arrive; ``flush`` gives what is still held at the end."""

    def add(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


class StreamDetokenizer:
    """vLLM's ``FastIncrementalDetokenizer``: tokenizers' ``DecodeStream`` primed with the
    prompt (a response's first token decodes as it follows the prompt, which matters
    for decoders that treat the start of a text apart), and, when special tokens are kept
    without spaces between them, a special token after another as its bare content."""

    def __init__(
        self, backend: Any, prompt_ids: Sequence[int], rule: TextRule, added: dict[int, str]
    ) -> None:
        self._backend = backend
        self._skip = rule.skip_special_tokens
        self._stream = DecodeStream(ids=list(prompt_ids), skip_special_tokens=self._skip)
        spaces = rule.skip_special_tokens or rule.spaces_between_special_tokens
        self._bare = None if spaces or not added else added
        self._last_special = False

    def add(self, token_id: int) -> str:
        try:
            text = self._stream.step(self._backend, token_id)
        except Exception as error:  # tokenizers raises a plain Exception here
            if not str(error).startswith(_INVALID_PREFIX):
                raise
            self._stream = DecodeStream(skip_special_tokens=self._skip)
            text = self._stream.step(self._backend, token_id)
        if self._bare is not None:
            special = self._bare.get(token_id)
            if special is not None and self._last_special:
                text = special
            self._last_special = special is not None
        return text or ""

    def flush(self) -> str:
        return ""  # as vLLM: an unfinished character at the end is never released


class WindowDetokenizer:
    """For a tokenizer without a Rust backend (vLLM's slow path): text is released once
    the window ``ids[prefix:]`` decodes without a trailing replacement character."""

    def __init__(self, tokens: TokenCodec, rule: TextRule) -> None:
        self._tokens = tokens
        self._skip = rule.skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        return self._release(final=False)

    def flush(self) -> str:
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        before = self._tokens.decode(self._ids[self._prefix : self._read], self._skip)
        text = self._tokens.decode(self._ids[self._prefix :], self._skip)
        if not final and (len(text) <= len(before) or text.endswith("\ufffd")):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(before) :]
