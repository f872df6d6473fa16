"""Retokenization testbed: a real byte-level BPE, a Qwen3-like template, drifting traces.

Merge strategies are only as well tested as the drift they meet. This package makes the
drift real instead of simulated: the tiny model's tokenizer
(``agl/backends/inference/tiny_tokenizer.json``) is a small byte-level BPE (trained by
``make_tokenizer.py``), ``template.py`` renders chats the way Qwen3's template does, and
``traces.py`` runs a simulated harness whose recorded calls break token continuity
(the paper's eq. 9) only through named, labelled mechanisms.

This module holds the tokenizer wrapper; ``load_tokenizer()`` is cached, so every test
and benchmark shares one instance.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from functools import cache, cached_property
from pathlib import Path

from tokenizers import Tokenizer

from agl.backends.inference.byte_level import byte_level_chars
from agl.backends.inference.qwen_chat import TINY_TOKENIZER_PATH

# Qwen's chat specials; the two tool_response tags are added tokens in Qwen as well.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)


class RetokTokenizer:
    """A thin wrapper over ``tokenizers.Tokenizer`` with the operations drift tests need.

    ``encode`` recognises special tokens in the text (as a chat server does for a rendered
    prompt) and ``decode`` writes them back literally, so ``decode(encode(t)) == t`` for
    every string: the only way two texts get different ids is a different segmentation.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._specials = {tokenizer.token_to_id(s): s for s in SPECIAL_TOKENS}
        if None in self._specials:
            raise ValueError("the tokenizer lacks some of the chat special tokens")

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset(self._specials)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``encode`` for many texts at once (parallel in Rust; for trace generation)."""
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary entry, in its byte-level spelling (``Ġ`` for a space)."""
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (a special token's literal text, UTF-8)."""
        return self._bytes_of[token_id]

    def is_special(self, token_id: int) -> bool:
        return token_id in self._specials

    @cached_property
    def _bytes_of(self) -> list[bytes]:
        byte_of = {ch: i for i, ch in enumerate(byte_level_chars())}
        out: list[bytes] = []
        for token_id in range(self.vocab_size):
            if token_id in self._specials:
                out.append(self._specials[token_id].encode())
            else:
                out.append(bytes(byte_of[ch] for ch in self._tok.id_to_token(token_id)))
        return out

    @cached_property
    def _splits(self) -> dict[int, list[tuple[int, int]]]:
        """For each non-special token, the pairs of vocabulary tokens that spell its bytes."""
        by_bytes = {b: i for i, b in enumerate(self._bytes_of) if i not in self._specials}
        splits: dict[int, list[tuple[int, int]]] = {}
        for token_id, b in enumerate(self._bytes_of):
            if token_id in self._specials or len(b) < 2:
                continue
            pairs = [
                (by_bytes[b[:k]], by_bytes[b[k:]])
                for k in range(1, len(b))
                if b[:k] in by_bytes and b[k:] in by_bytes
            ]
            if pairs:
                splits[token_id] = pairs
        return splits

    def splittable(self, ids: Sequence[int]) -> list[int]:
        """Positions in ``ids`` whose token can be spelled as two shorter tokens."""
        return [i for i, t in enumerate(ids) if t in self._splits]

    def resegment(self, ids: Sequence[int], rng: random.Random, splits: int = 1) -> list[int]:
        """A valid non-canonical segmentation of the same bytes: ``splits`` tokens split in two.

        A BPE model can sample such a sequence (every piece is in the vocabulary), but
        ``encode(decode(...))`` never returns it, because BPE always merges the pieces back:
        this is decode-retokenize drift (the paper's eq. 11, Figure 3's h|aving vs hav|ing).
        Raises ``ValueError`` if no token of ``ids`` can be split.
        """
        out = list(ids)
        for _ in range(splits):
            positions = self.splittable(out)
            if not positions:
                if len(out) == len(ids):
                    raise ValueError("no token of the sequence can be split")
                break
            i = rng.choice(positions)
            out[i : i + 1] = rng.choice(self._splits[out[i]])
        return out


@cache
def load_tokenizer(path: str | Path = TINY_TOKENIZER_PATH) -> RetokTokenizer:
    """The committed testbed tokenizer (cached: one instance per path)."""
    return RetokTokenizer(Tokenizer.from_file(str(path)))
