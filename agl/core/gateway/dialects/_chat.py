"""The chat side of a translation: what a chat answer says, as an ordered list of blocks
(text, tool calls) with its finish and usage, whether it came whole or as chunks.

Both dialects build their answer from an :class:`Outcome`; a stream's final object is
built from the outcome its chunks added up to, so it cannot differ from the unary
translation of the same answer."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from agl.core.gateway.answer_ids import RawIds


@dataclass
class Block:
    kind: Literal["text", "tool"]
    text: str = ""  # the text, or a tool call's arguments (JSON as the model wrote it)
    call_id: str = ""
    name: str = ""


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0


@dataclass
class Outcome:
    blocks: list[Block] = field(default_factory=list)
    finish_reason: str | None = None
    # vLLM's ``stop_reason``: the stop string that ended the answer (or a token id).
    matched_stop: str | int | None = None
    usage: Usage | None = None


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def usage_of(usage: Any) -> Usage | None:
    if not isinstance(usage, dict):
        return None
    prompt_details = usage.get("prompt_tokens_details") or {}
    completion_details = usage.get("completion_tokens_details") or {}
    return Usage(
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        completion_tokens=int(usage.get("completion_tokens") or 0),
        cached_tokens=int(prompt_details.get("cached_tokens") or 0),
        reasoning_tokens=int(completion_details.get("reasoning_tokens") or 0),
    )


def outcome_of(answer: dict[str, Any], call_id_prefix: str) -> Outcome:
    """A unary ``chat.completion``'s first choice (the dialects ask for one)."""
    choice = answer["choices"][0]
    message = choice.get("message") or {}
    blocks = []
    if message.get("content"):
        blocks.append(Block("text", message["content"]))
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        blocks.append(
            Block(
                "tool",
                function.get("arguments") or "",
                call.get("id") or new_id(call_id_prefix),
                function.get("name") or "",
            )
        )
    return Outcome(
        blocks,
        choice.get("finish_reason"),
        choice.get("stop_reason"),
        usage_of(answer.get("usage")),
    )


@dataclass
class Start:
    block: Block


@dataclass
class Delta:
    """More of the open block: text, or a piece of a tool call's arguments."""

    text: str


@dataclass
class End:
    block: Block


Piece = Start | Delta | End


class ChunkReader:
    """Reads ``chat.completion.chunk`` dicts into pieces: blocks start, grow and end one
    at a time, in order. A tool call starts once its name is whole (its first piece of
    arguments, or whatever comes next), since a chat server may split the name too."""

    def __init__(self, call_id_prefix: str) -> None:
        self.outcome = Outcome()
        self.prompt_tokens: int | None = None
        self._call_id_prefix = call_id_prefix
        self._open: Block | None = None
        self._started = False  # whether the open block's Start went out
        self._tool_index: int | None = None  # the open block's chat tool-call index
        self._done_indexes: set[int] = set()

    def feed(self, chunk: dict[str, Any]) -> list[Piece]:
        if isinstance(chunk.get("prompt_token_ids"), list | RawIds):
            # vLLM's first chunk (return_token_ids): the prompt's size before usage comes.
            self.prompt_tokens = len(chunk["prompt_token_ids"])
        if chunk.get("usage"):
            self.outcome.usage = usage_of(chunk["usage"])
        pieces: list[Piece] = []
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if delta.get("content"):
                pieces += self._text(delta["content"])
            for call in delta.get("tool_calls") or ():
                pieces += self._tool(call)
            if choice.get("finish_reason"):
                self.outcome.finish_reason = choice["finish_reason"]
            if choice.get("stop_reason") is not None:
                self.outcome.matched_stop = choice["stop_reason"]
        return pieces

    def finish(self) -> list[Piece]:
        return self._close()

    def _text(self, text: str) -> list[Piece]:
        pieces: list[Piece] = []
        block = self._open
        if block is None or block.kind != "text":
            pieces += self._close()
            block = Block("text")
            pieces += self._begin(block)
        block.text += text
        pieces.append(Delta(text))
        return pieces

    def _tool(self, call: dict[str, Any]) -> list[Piece]:
        index = call.get("index", 0)
        if index in self._done_indexes:
            raise ValueError(f"the chat stream resumed tool call {index} after it had ended")
        pieces: list[Piece] = []
        if self._tool_index != index:
            pieces += self._close()
            self._open, self._started, self._tool_index = Block("tool"), False, index
        block = self._open
        assert block is not None
        function = call.get("function") or {}
        if call.get("id") and not block.call_id:
            block.call_id = call["id"]
        block.name += function.get("name") or ""
        arguments = function.get("arguments") or ""
        if not arguments:
            return pieces
        block.text += arguments
        if self._started:
            pieces.append(Delta(arguments))
        else:
            pieces += self._start_tool(block)
        return pieces

    def _start_tool(self, block: Block) -> list[Piece]:
        """Start a tool call whose name is now whole, with the arguments it has so far."""
        if not block.call_id:
            block.call_id = new_id(self._call_id_prefix)
        self._started = True
        self.outcome.blocks.append(block)
        return [Start(block), Delta(block.text)] if block.text else [Start(block)]

    def _begin(self, block: Block) -> list[Piece]:
        self._open, self._started, self._tool_index = block, True, None
        self.outcome.blocks.append(block)
        return [Start(block)]

    def _close(self) -> list[Piece]:
        block = self._open
        if block is None:
            return []
        pieces: list[Piece] = [] if self._started else self._start_tool(block)
        if self._tool_index is not None:
            self._done_indexes.add(self._tool_index)
        self._open, self._tool_index = None, None
        return [*pieces, End(block)]
