"""The guessing-game harness: a real agent that talks to its model through the OpenAI API.

The user states a range; each assistant turn is a guess (the first integer of the reply,
so "maybe 7" guesses 7); the user answers "higher", "lower", or "a number, please" (a reply
without a number still costs its turn), each followed by the range the target is known to
lie in. Reward 1.0 when the target is hit within ``max_turns``, else 0.0. Besides the
reward, a rollout reports ``feedback_in_range`` (the share of its later guesses inside the
range stated just before them: what only reading the feedback raises) and
``repeated_guesses``.

Like any real harness it appends each reply to the history as the *text* it received, so
the next prompt is a retokenization of that text: the natural drift agl studies.

It runs as a worker entry point (``run(env)``, ``module:function``) or as a command
(``python -m experiments.guess.harness`` with the attempt's environment).
"""

from __future__ import annotations

import asyncio
import math
import random
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import openai

from agl.agent.harness import Attempt, BadInput, Outcome, run_command, run_episode

HIGHER = "higher"
LOWER = "lower"
NOT_A_NUMBER = "a number, please"

_INTEGER = re.compile(r"\d+")

Message = dict[str, str]
# The model as the game sees it: the chat so far -> the reply text.
Ask = Callable[[list[Message]], Awaitable[str]]


# ------------------------------------------------------------------------------ the game


class GameInputError(BadInput):
    """The rollout's input does not describe a game."""


@dataclass(frozen=True)
class Game:
    target: int
    low: int = 1
    high: int = 8
    max_turns: int = 3
    temperature: float = 1.0
    top_p: float = 1.0  # the trainer scores each token under the same truncation
    # The warmed player answers "maybe 7" and the end-of-turn token: 6 tokens canonically,
    # up to 8 when it samples a noncanonical segmentation ("m|a|y|b|e| |7").
    max_tokens: int = 10
    # Agent latency (bench/async.py): before each call the harness "thinks" for a time
    # drawn from a lognormal with this median (0: no wait) and shape.
    think_median_s: float = 0.0
    think_sigma: float = 0.0

    def think_s(self, rng: random.Random) -> float:
        """One think time, in seconds."""
        if self.think_median_s <= 0:
            return 0.0
        return rng.lognormvariate(math.log(self.think_median_s), self.think_sigma)

    @classmethod
    def from_input(cls, data: object) -> Game:
        """Validate a rollout input (``target``, ``low``, ``high``, ``max_turns``, the
        sampling options ``temperature``, ``top_p``, ``max_tokens`` and the agent options
        ``think_median_s``, ``think_sigma``); other keys are ignored."""
        if not isinstance(data, Mapping):
            raise GameInputError(f"the input must be a JSON object, not {type(data).__name__}")
        if "target" not in data:
            raise GameInputError("the input lacks 'target'")
        defaults = cls(target=0)
        game = cls(
            target=_integer(data, "target", None),
            low=_integer(data, "low", defaults.low),
            high=_integer(data, "high", defaults.high),
            max_turns=_integer(data, "max_turns", defaults.max_turns),
            temperature=_number(data, "temperature", defaults.temperature),
            top_p=_number(data, "top_p", defaults.top_p),
            max_tokens=_integer(data, "max_tokens", defaults.max_tokens),
            think_median_s=_number(data, "think_median_s", defaults.think_median_s),
            think_sigma=_number(data, "think_sigma", defaults.think_sigma),
        )
        if not game.low <= game.target <= game.high:
            raise GameInputError(f"target {game.target} is not in [{game.low}, {game.high}]")
        if game.max_turns < 1 or game.max_tokens < 1:
            raise GameInputError("max_turns and max_tokens must be at least 1")
        if min(game.temperature, game.think_median_s, game.think_sigma) < 0:
            raise GameInputError("temperature, think_median_s and think_sigma must be >= 0")
        if not 0 < game.top_p <= 1:
            raise GameInputError("top_p must be in (0, 1]")
        return game


def _integer(data: Mapping[str, Any], key: str, default: int | None) -> int:
    value = data.get(key, default)
    # bool is an int in Python, but a JSON true is no number.
    if not isinstance(value, int) or isinstance(value, bool):
        raise GameInputError(f"{key!r} must be an integer, not {value!r}")
    return value


def _number(data: Mapping[str, Any], key: str, default: float) -> float:
    value = data.get(key, default)
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise GameInputError(f"{key!r} must be a number, not {value!r}")
    return float(value)


def opening(low: int, high: int) -> str:
    """The first user message. Short: every token costs on 2 cores."""
    return f"Guess my number, {low} to {high}."


def parse_guess(text: str) -> int | None:
    """The first integer in a reply (digits only: a model that wants 0 - 3 gets 3)."""
    match = _INTEGER.search(text)
    return int(match.group()) if match else None


def feedback(guess: int | None, target: int, low: int, high: int) -> tuple[str | None, int, int]:
    """The user's answer to a guess (None when it hits) and the range the target is now
    known to lie in. The answer restates that range ("higher, 9 to 16"), as a person
    keeping score would: the game stays multi-turn, but what the model must use sits in
    the last message, which a small model learns to read far sooner than its own history.
    """
    if guess is None:
        return f"{NOT_A_NUMBER}, {low} to {high}", low, high
    if guess == target:
        return None, low, high
    if guess < target:
        low = max(low, guess + 1)
        return f"{HIGHER}, {low} to {high}", low, high
    high = min(high, guess - 1)
    return f"{LOWER}, {low} to {high}", low, high


# The metrics a rollout reports besides its reward (AgentContext.finish's ``metrics``).
FEEDBACK_IN_RANGE = "feedback_in_range"
REPEATED_GUESSES = "repeated_guesses"

Range = tuple[int, int]


def in_range_counts(guesses: Sequence[int | None], ranges: Sequence[Range]) -> tuple[int, int]:
    """(how many, of how many) of the guesses after the first lie inside the range the
    user stated just before them; a reply with no number counts as outside.

    Reward alone cannot show that a player reads the feedback: under the house's weights
    the blind sequence 3, 4, 5 already wins 10 times in 16. Only a player that reads the
    range can keep its later guesses inside it (baselines.py has the figures)."""
    later = list(zip(guesses[1:], ranges[1:], strict=True))
    inside = sum(g is not None and low <= g <= high for g, (low, high) in later)
    return inside, len(later)


def repeat_counts(guesses: Sequence[int | None]) -> tuple[int, int]:
    """(how many, of how many) of the guesses after the first name a number guessed
    before: a turn thrown away, whatever the feedback said (a reply with no number
    repeats nothing)."""
    seen: set[int] = set()
    repeats = 0
    for guess in guesses:
        if guess is not None:
            repeats += guess in seen
            seen.add(guess)
    return repeats, max(len(guesses) - 1, 0)


def share(counts: tuple[int, int]) -> float | None:
    """``k / n``, or None where there is nothing to count (a game won at the first
    guess has no later guess: it says nothing about reading the feedback)."""
    k, n = counts
    return k / n if n else None


@dataclass
class Episode:
    """One game: the chat as the harness built it, and how it ended."""

    messages: list[Message] = field(default_factory=list)
    replies: list[str] = field(default_factory=list)
    guesses: list[int | None] = field(default_factory=list)
    # The range the user had stated when each guess was made (the opening's for the first).
    ranges: list[Range] = field(default_factory=list)
    won: bool = False

    @property
    def reward(self) -> float:
        return 1.0 if self.won else 0.0

    @property
    def metrics(self) -> dict[str, float]:
        """The rollout's metrics besides its reward; one left out where it has no value."""
        values = {
            FEEDBACK_IN_RANGE: share(in_range_counts(self.guesses, self.ranges)),
            REPEATED_GUESSES: share(repeat_counts(self.guesses)),
        }
        return {name: value for name, value in values.items() if value is not None}


async def play(game: Game, ask: Ask, rng: random.Random | None = None) -> Episode:
    """Play one game against ``ask``. The history holds each reply's text exactly as
    received (as a real harness does), so the model sees its retokenized words.
    ``rng`` draws the think times (when the game has any)."""
    rng = rng or random.Random()
    episode = Episode(messages=[{"role": "user", "content": opening(game.low, game.high)}])
    low, high = game.low, game.high
    for _ in range(game.max_turns):
        think = game.think_s(rng)
        if think > 0:
            await asyncio.sleep(think)
        reply = await ask(list(episode.messages))
        guess = parse_guess(reply)
        episode.messages.append({"role": "assistant", "content": reply})
        episode.replies.append(reply)
        episode.guesses.append(guess)
        episode.ranges.append((low, high))
        answer, low, high = feedback(guess, game.target, low, high)
        if answer is None:
            episode.won = True
            break
        episode.messages.append({"role": "user", "content": answer})
    return episode


def openai_ask(client: openai.AsyncOpenAI, model: str, game: Game) -> Ask:
    """``ask`` over an OpenAI-compatible endpoint (the gateway's recording proxy)."""

    async def ask(messages: list[Message]) -> str:
        completion = await client.chat.completions.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            temperature=game.temperature,
            top_p=game.top_p,
            max_tokens=game.max_tokens,
        )
        return completion.choices[0].message.content or ""

    return ask


# --------------------------------------------------------------------------- the agent


async def run(env: Mapping[str, str]) -> None:
    """Play the rollout's game through the proxy and report the reward."""
    await run_episode(env, _episode)


async def _episode(attempt: Attempt) -> Outcome:
    game = Game.from_input(attempt.agent.input)
    episode = await play(game, openai_ask(attempt.client, attempt.model, game))
    return Outcome(episode.reward, episode.metrics)


def main() -> None:
    """``python -m experiments.guess.harness``: one attempt, from ``os.environ``."""
    run_command(run, "experiments.guess.harness")


if __name__ == "__main__":
    main()
