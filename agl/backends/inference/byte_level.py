"""GPT-2's byte-to-unicode table: the alphabet byte-level BPE vocabularies are spelled in."""

from __future__ import annotations

from functools import cache


@cache
def byte_level_chars() -> tuple[str, ...]:
    """The character standing for each byte, indexed by byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return tuple(chars[b] for b in range(256))
