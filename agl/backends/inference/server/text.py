"""One choice's text output as the engine's tokens arrive: the text under the request's
text rule, cut at stop strings as vLLM cuts it, how much of it a stream may show yet, and
its tool calls once it is over; ``collect`` feeds a whole unary generation into such
outputs. A choice's text is made token by token however it is asked for (streamed or
not, with stop strings or without), so it is the same text either way, and vLLM's."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agl.backends.inference.engine import Generation
from agl.backends.inference.server.tokens import Detokenizer, TokenCodec
from agl.backends.inference.server.tools import ToolParser, partial_suffix
from agl.core.contracts.text_rule import TextRule


@dataclass
class ChoiceOutput:
    """One choice's answer as it grows: ids, logprobs, text after stop strings, and how
    much of the text a stream may already show."""

    index: int
    tokens: TokenCodec
    prompt_ids: list[int]
    stops: tuple[str, ...]
    rule: TextRule
    tool_parser: ToolParser | None  # None: tool calls are not parsed
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    shown: int = 0  # characters of text already streamed
    finish_reason: str | None = None
    stop_reason: str | None = None  # the stop string that ended it, as vLLM reports
    detokenizer: Detokenizer = field(init=False)

    def __post_init__(self) -> None:
        self.detokenizer = self.tokens.detokenizer(self.prompt_ids, self.rule)

    def add(self, token_ids: list[int], logprobs: list[float], finish: str | None) -> bool:
        """Take the engine's next tokens; answers True when a stop string ended the choice
        (the engine should stop sampling it)."""
        if self.finish_reason:
            return False
        if finish == "abort":
            self.finish_reason = finish
            return False
        # An engine "stop" means the last token is eos: sampled, and text only when stop
        # strings are kept (vLLM's include_stop_str_in_output), if then not skipped.
        eos = (
            len(token_ids) - 1
            if finish == "stop" and not self.rule.include_stop_str_in_output
            else -1
        )
        for i, (token, logprob) in enumerate(zip(token_ids, logprobs, strict=True)):
            self.token_ids.append(token)
            self.logprobs.append(logprob)
            if i != eos and self._extend(self.detokenizer.add(token)):
                return True
        if finish:
            if self._extend(self.detokenizer.flush()):
                return True
            self.finish_reason = finish
        return False

    def _extend(self, new: str) -> bool:
        """Add text; a stop string in it ends the choice (vLLM's ``check_stop_strings``:
        the one that completes first, the text cut before it, or after it when kept)."""
        if not new:
            return False
        checked = len(self.text)
        self.text += new
        hits = [
            (at + len(s), at, s)
            for s in self.stops
            if (at := self.text.find(s, max(0, checked - len(s) + 1))) >= 0
        ]
        if not hits:
            return False
        end, at, self.stop_reason = min(hits, key=lambda hit: hit[0])
        self.text = self.text[: end if self.rule.include_stop_str_in_output else at]
        self.finish_reason = "stop"
        return True

    def visible(self) -> int:
        """How much of the text a stream may show now: not what may still turn out to be
        a stop string, nor anything from a tool call on (it may parse into tool_calls)."""
        text = self.text
        if self.finish_reason:
            return len(text)
        held = () if self.rule.include_stop_str_in_output else self.stops
        end = len(text) - max((partial_suffix(text, s) for s in held), default=0)
        if self.tool_parser is not None:
            end = min(end, self.tool_parser.held_from(text))
        return max(end, self.shown)

    def take_text(self) -> str:
        end = self.visible()
        text, self.shown = self.text[self.shown : end], max(self.shown, end)
        return text

    def emit(self) -> tuple[str, list[dict[str, Any]] | None]:
        """What a stream shows after the latest tokens: new content, and, once the
        choice is over and its text parses, the tool calls (with the content before
        them that was still held back)."""
        if self.finish_reason:
            content, tool_calls = self.message()
            if tool_calls:
                text = (content or "")[self.shown :]
                self.shown = len(self.text)
                return text, tool_calls
        return self.take_text(), None

    def message(self) -> tuple[str | None, list[dict[str, Any]] | None]:
        parsed = self.tool_parser.parse(self.text) if self.tool_parser else None
        if parsed is None:
            return self.text, None
        return parsed

    def final_reason(self, tool_calls: list[dict[str, Any]] | None) -> str | None:
        return "tool_calls" if tool_calls else self.finish_reason


async def collect(generation: Generation, outputs: list[ChoiceOutput], stops: bool) -> None:
    """Run a unary generation to its end into ``outputs``."""
    if stops:  # stop strings are found token by token, as the text grows
        async for batch in generation.deltas():
            for delta in batch:
                if outputs[delta.index].add(delta.token_ids, delta.logprobs, delta.finish_reason):
                    generation.cancel(delta.index)
    else:
        for choice in await generation.wait():
            outputs[choice.index].add(choice.token_ids, choice.logprobs, choice.finish_reason)
