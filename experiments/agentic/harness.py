"""The guessing game played the way agent harnesses play: tool calls, thinking, a
subagent, context summaries and retries, each switchable (``Mechanisms``).

The game is ``experiments.guess``'s (guess 1..8 in ``max_turns``; "higher, 5 to 8"
after a miss; reward 1 on a hit), so its exact baselines hold here: no feedback-blind
player scores more than the best fixed sequence (``python -m experiments.agentic.baselines``).
What changes is how the harness talks to the model, and so how its calls merge:

- ``tools``: the model guesses with a tool call written as text,
  ``<tool_call>{"name":"guess","arguments":{"n":4}}</tool_call>``. The harness parses it
  and sends it back as a structured ``tool_calls`` entry, which the chat template
  re-serializes in its own layout (``<tool_call>\\n{"name": "guess", ...}\\n</tool_call>``),
  and the answer comes back as a ``tool`` message: the next prompt does not extend the
  sampled tokens (what harnesses on top of a tool parser do to every call).
- ``think``: a reply starts with ``<think>\\n5 to 8\\n</think>\\n\\n`` (the model restates
  the range it was told). The harness splits it off into ``reasoning_content``, as a
  reasoning parser does, and the template drops reasoning from the turns before the last
  user message (Qwen3's rule). Inside a tool loop no user message follows, so the
  reasoning is kept: with ``tools`` on, ``think`` moves nothing (as with Qwen3).
- ``subagent``: after a miss the harness hands the check's raw output ("Checked 4:
  higher. Left: 5 6 7 8.") to a subagent in a fresh context, and tells the main agent
  the subagent's report ("higher, 5 to 8") instead, as harnesses delegate reading long
  tool output. The subagent's call is a sample of its own under every merge; a wrong
  report costs the main agent its next guess. Without it the harness reports itself.
- ``summary_chars``: before a call whose history holds more characters than this, the
  harness replaces the history with one user message that summarizes it ("Guess my
  number, 1 to 8. So far: 4, higher, 5 to 8."); 0: never.
- ``retry_rate``: the share of answers the harness throws away and asks again, as on a
  dropped connection or a timeout (drawn per rollout, attempt and call, so a rollout
  retries the same calls in every run); a reply it cannot read is asked again too, up
  to ``format_retries`` times. The trainer's dedup leaves retried calls out.

The model is the game's only player: the harness makes no move of its own. It runs as a
worker entry point (``run(env)``) or as ``python -m experiments.agentic.harness``.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import openai

from agl.agent.harness import Attempt, Outcome, run_command, run_episode
from experiments.guess.harness import (
    FEEDBACK_IN_RANGE,
    REPEATED_GUESSES,
    Game,
    GameInputError,
    in_range_counts,
    opening,
    repeat_counts,
    share,
)

THINK_START = "<think>"
THINK_END = "</think>"
CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
TOOL_NAME = "guess"
_CALL = re.compile(re.escape(CALL_START) + r"(.*?)" + re.escape(CALL_END), re.DOTALL)
_INTEGER = re.compile(r"\d+")
_REPORT = re.compile(r"(higher|lower), \d+ to \d+")

# The metrics a rollout reports besides its reward and the guessing game's own.
SUBAGENT_CORRECT = "subagent_correct"
RETRIED_CALLS = "retried_calls"
SUMMARIES = "summaries"
MODEL_CALLS = "model_calls"

Message = dict[str, Any]
Range = tuple[int, int]
T = TypeVar("T")


# ------------------------------------------------------------------------ the options


@dataclass(frozen=True)
class Mechanisms:
    """How the harness talks to the model (the module's docstring says what each does)."""

    tools: bool = True
    think: bool = True
    subagent: bool = True
    summary_chars: int = 0
    retry_rate: float = 0.0
    format_retries: int = 1

    @classmethod
    def from_input(cls, data: Mapping[str, Any]) -> Mechanisms:
        defaults = cls()
        values: dict[str, Any] = {}
        for name in ("tools", "think", "subagent"):
            value = data.get(name, getattr(defaults, name))
            if not isinstance(value, bool):
                raise GameInputError(f"{name!r} must be true or false, not {value!r}")
            values[name] = value
        for name in ("summary_chars", "format_retries"):
            value = data.get(name, getattr(defaults, name))
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise GameInputError(f"{name!r} must be an integer >= 0, not {value!r}")
            values[name] = value
        rate = data.get("retry_rate", defaults.retry_rate)
        if not isinstance(rate, int | float) or isinstance(rate, bool) or not 0 <= rate < 1:
            raise GameInputError(f"'retry_rate' must be a number in [0, 1), not {rate!r}")
        values["retry_rate"] = float(rate)
        return cls(**values)


# ------------------------------------------------------------------- what is written


def think_text(low: int, high: int) -> str:
    """The reasoning the model is taught to start a guess with: the range it was told."""
    return f"{THINK_START}\n{low} to {high}\n{THINK_END}\n\n"


def tool_call_text(guess: int) -> str:
    """A guess as the model writes a tool call: compact JSON, unlike the template."""
    call = {"name": TOOL_NAME, "arguments": {"n": guess}}
    return CALL_START + json.dumps(call, separators=(",", ":")) + CALL_END


def guess_text(guess: int, low: int, high: int, mechanisms: Mechanisms) -> str:
    """The whole reply of a player that guesses ``guess`` having been told ``low`` to
    ``high`` (what the warm-up teaches, with a random guess)."""
    head = think_text(low, high) if mechanisms.think else ""
    return head + (tool_call_text(guess) if mechanisms.tools else f"maybe {guess}")


def observation(guess: int, direction: str, left: Range) -> str:
    """What checking a guess returns, raw: the numbers left one by one. The main agent
    never sees it with ``subagent`` on; the subagent reads it and reports."""
    numbers = " ".join(str(n) for n in range(left[0], left[1] + 1))
    return f"Checked {guess}: {direction}. Left: {numbers}."


def subagent_question(raw: str) -> str:
    return f"Tool output: {raw} Report it."


def report_text(direction: str, left: Range) -> str:
    """What the subagent should answer, and the harness says without one."""
    return f"{direction}, {range_text(left)}"


def left_after(low: int, high: int, guess: int, direction: str) -> Range:
    """The range left once ``guess`` in ``low..high`` was answered ``direction``."""
    return (max(low, guess + 1), high) if direction == "higher" else (low, min(high, guess - 1))


def range_text(known: Range) -> str:
    return f"{known[0]} to {known[1]}"


def summary_text(low: int, high: int, moves: list[str]) -> str:
    return f"{opening(low, high)} So far: {'; '.join(moves)}."


# ------------------------------------------------------------------------- what is read


@dataclass(frozen=True)
class Reply:
    """One answer as the harness reads it."""

    reasoning: str | None  # the think block's text, when the reply has one
    content: str  # the text after it
    guess: int | None
    # The parsed tool call, re-serialized as the harness sends it back (None: no call).
    tool_call: dict[str, Any] | None = None


def split_reasoning(text: str) -> tuple[str | None, str]:
    """``(reasoning, content)`` of a reply that starts with a think block (as vLLM's
    Qwen3 reasoning parser splits it); ``(None, text)`` otherwise."""
    if not text.startswith(THINK_START) or THINK_END not in text:
        return None, text
    inner, _, rest = text[len(THINK_START) :].partition(THINK_END)
    return inner.strip("\n"), rest.lstrip("\n")


def read_reply(text: str, mechanisms: Mechanisms, call_id: str) -> Reply:
    """The guess in a reply: the ``guess`` tool call's integer ``n`` with ``tools``,
    else the first integer after the reasoning."""
    reasoning, content = split_reasoning(text) if mechanisms.think else (None, text)
    if not mechanisms.tools:
        match = _INTEGER.search(content)
        return Reply(reasoning, content, int(match.group()) if match else None)
    match = _CALL.search(content)
    if match is None:
        return Reply(reasoning, content, None)
    try:
        call = json.loads(match.group(1))
    except ValueError:
        return Reply(reasoning, content, None)
    arguments = call.get("arguments") if isinstance(call, dict) else None
    n = arguments.get("n") if isinstance(arguments, dict) else None
    if call.get("name") != TOOL_NAME or not isinstance(n, int) or isinstance(n, bool):
        return Reply(reasoning, content, None)
    tool_call = {
        "id": call_id,
        "type": "function",
        "function": {"name": TOOL_NAME, "arguments": json.dumps({"n": n})},
    }
    return Reply(reasoning, content[: match.start()].rstrip("\n"), n, tool_call)


def assistant_message(reply: Reply) -> Message:
    message: Message = {"role": "assistant", "content": reply.content}
    if reply.reasoning is not None:
        message["reasoning_content"] = reply.reasoning
    if reply.tool_call is not None:
        message["tool_calls"] = [reply.tool_call]
    return message


# ---------------------------------------------------------------------------- the play


# The model as the harness sees it: a chat and a token budget -> the reply's text.
Ask = Callable[[list[Message], int], Awaitable[str]]


@dataclass
class Episode:
    """One game: every call's chat, and how it ended."""

    guesses: list[int | None] = field(default_factory=list)
    ranges: list[Range] = field(default_factory=list)  # the true range at each guess
    subagent_answers: list[bool] = field(default_factory=list)  # each right or not
    calls: int = 0
    retried: int = 0
    summaries: int = 0
    won: bool = False

    @property
    def reward(self) -> float:
        return 1.0 if self.won else 0.0

    @property
    def metrics(self) -> dict[str, float]:
        values = {
            FEEDBACK_IN_RANGE: share(in_range_counts(self.guesses, self.ranges)),
            REPEATED_GUESSES: share(repeat_counts(self.guesses)),
            SUBAGENT_CORRECT: share((sum(self.subagent_answers), len(self.subagent_answers))),
            RETRIED_CALLS: float(self.retried),
            SUMMARIES: float(self.summaries),
            MODEL_CALLS: float(self.calls),
        }
        return {name: value for name, value in values.items() if value is not None}


@dataclass
class Play:
    """One game in progress against ``ask``; ``rng`` draws the dropped answers."""

    game: Game
    mechanisms: Mechanisms
    ask: Ask
    rng: random.Random
    episode: Episode = field(default_factory=Episode)

    async def _call(
        self, messages: list[Message], max_tokens: int, read: Callable[[str], T | None]
    ) -> tuple[str, T | None]:
        """Ask until an answer is kept: a dropped one (``retry_rate``) is asked again, an
        unreadable one (``read`` gives None) up to ``format_retries`` times. Answers the
        kept text and what ``read`` made of it."""
        unreadable = 0
        while True:
            text = await self.ask(list(messages), max_tokens)
            self.episode.calls += 1
            if self.rng.random() < self.mechanisms.retry_rate:
                self.episode.retried += 1
                continue
            value = read(text)
            if value is None and unreadable < self.mechanisms.format_retries:
                unreadable += 1
                self.episode.retried += 1
                continue
            return text, value

    async def run(self) -> Episode:
        game, m = self.game, self.mechanisms
        low, high = game.low, game.high  # the range the target truly lies in
        messages: list[Message] = [{"role": "user", "content": opening(low, high)}]
        moves: list[str] = []
        for turn in range(game.max_turns):
            if m.summary_chars and turn and _chars(messages) > m.summary_chars:
                messages = [{"role": "user", "content": summary_text(game.low, game.high, moves)}]
                self.episode.summaries += 1
            call_id = f"call_{turn}"
            text, _ = await self._call(
                messages, game.max_tokens, lambda t, c=call_id: read_reply(t, m, c).guess
            )
            reply = read_reply(text, m, call_id)
            guess = reply.guess
            messages.append(assistant_message(reply))
            self.episode.guesses.append(guess)
            self.episode.ranges.append((low, high))
            if guess == game.target:
                self.episode.won = True
                break
            if turn + 1 == game.max_turns:
                break
            if guess is None:
                result = f"a number, please, {range_text((low, high))}"
            else:
                direction = "higher" if guess < game.target else "lower"
                low, high = left_after(low, high, guess, direction)
                result = await self._feedback(guess, direction, (low, high))
            moves.append(f"{guess if guess is not None else '?'}, {result}")
            if reply.tool_call is not None:
                messages.append(
                    {"role": "tool", "tool_call_id": reply.tool_call["id"], "content": result}
                )
            else:
                messages.append({"role": "user", "content": result})
        return self.episode

    async def _feedback(self, guess: int, direction: str, left: Range) -> str:
        """What the main agent is told after a miss: the subagent's report of the raw
        observation (right or wrong), or the right report without a subagent."""
        truth = report_text(direction, left)
        if not self.mechanisms.subagent:
            return truth
        question = [
            {"role": "user", "content": subagent_question(observation(guess, direction, left))}
        ]
        text, _ = await self._call(question, SUBAGENT_MAX_TOKENS, read_report)
        self.episode.subagent_answers.append(text == truth)
        return text


# "higher, 5 to 8" and the end-of-turn token: 9 tokens; room for a noncanonical one.
SUBAGENT_MAX_TOKENS = 16


def read_report(text: str) -> str | None:
    """The subagent's report when it reads as one ("higher, 5 to 8"), else None."""
    return text if _REPORT.fullmatch(text) else None


def _chars(messages: list[Message]) -> int:
    return sum(len(m.get("content") or "") for m in messages)


async def play(game: Game, mechanisms: Mechanisms, ask: Ask, rng: random.Random) -> Episode:
    return await Play(game, mechanisms, ask, rng).run()


def retry_rng(rollout_id: str, attempt: int) -> random.Random:
    """The draws of the dropped answers: a function of the rollout and the attempt."""
    return random.Random(f"agentic-retry:{rollout_id}:{attempt}")


# --------------------------------------------------------------------------- the agent


def openai_ask(client: openai.AsyncOpenAI, model: str, game: Game) -> Ask:
    async def ask(messages: list[Message], max_tokens: int) -> str:
        completion = await client.chat.completions.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            temperature=game.temperature,
            top_p=game.top_p,
            max_tokens=max_tokens,
            # The markers (<think>, <tool_call>) are special tokens of agl's tokenizer,
            # which the engines leave out of the text unless asked (vLLM's default).
            extra_body={"skip_special_tokens": False},
        )
        return completion.choices[0].message.content or ""

    return ask


async def run(env: Mapping[str, str]) -> None:
    """Play the rollout's game through the proxy and report the reward."""
    await run_episode(env, _episode)


async def _episode(attempt: Attempt) -> Outcome:
    agent = attempt.agent
    game = Game.from_input(agent.input)
    mechanisms = Mechanisms.from_input(agent.input)
    ask = openai_ask(attempt.client, attempt.model, game)
    episode = await play(game, mechanisms, ask, retry_rng(agent.rollout_id, agent.attempt))
    return Outcome(episode.reward, episode.metrics)


def main() -> None:
    """``python -m experiments.agentic.harness``: one attempt, from ``os.environ``."""
    run_command(run, "experiments.agentic.harness")


if __name__ == "__main__":
    main()
