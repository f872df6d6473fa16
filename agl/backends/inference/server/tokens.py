"""The tokenizer as the server uses it: ids to text and back on the Rust tokenizer's hot
paths, each token's text and bytes for logprobs, and incremental detokenization."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agl.backends.inference.byte_level import byte_level_chars


class TokenCodec:
    """What the server needs from the tokenizer, the hot paths on the Rust tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._decode = (
            (lambda ids: backend.decode(ids, skip_special_tokens=False))
            if backend is not None
            else (lambda ids: tokenizer.decode(ids, skip_special_tokens=False))
        )
        self._added = {v: k for k, v in tokenizer.get_added_vocab().items()}
        decoder = getattr(backend, "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"
        self._byte_of = {ch: b for b, ch in enumerate(byte_level_chars())}
        self._entries: dict[int, tuple[str, list[int]]] = {}

    def decode(self, ids: Sequence[int]) -> str:
        return self._decode(list(ids))

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
            text = self._decode([token_id])
            raw = text.encode()
            if self._byte_level and token_id not in self._added:
                piece = self.tokenizer.convert_ids_to_tokens(token_id)
                if piece is not None and all(ch in self._byte_of for ch in piece):
                    raw = bytes(self._byte_of[ch] for ch in piece)
            found = self._entries[token_id] = (text, list(raw))
        return found


class Detokenizer:
    """Token ids to text, one token at a time, never splitting a UTF-8 character: text is
    released once the window ``ids[prefix:]`` decodes without a trailing replacement
    character (vLLM's incremental detokenization)."""

    def __init__(self, tokens: TokenCodec) -> None:
        self._tokens = tokens
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
        before = self._tokens.decode(self._ids[self._prefix : self._read])
        text = self._tokens.decode(self._ids[self._prefix :])
        if not final and (len(text) <= len(before) or text.endswith("\ufffd")):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(before) :]
