"""The agentic game's warm-up: a random player that knows every format the harness uses.

As in ``experiments.guess.warmup``, the tiny model first learns to copy (an induction
phase) and then imitates a player that knows the format and not the game. Here the
transcripts are made by the harness itself: ``Play`` runs against a scripted player, and
every call it makes (main agent, subagent, retries, after a summary) becomes a training
row, the prompt rendered with the chat template exactly as the server renders it and the
loss on the reply and its end-of-turn token. So each mechanism's calls are learned as the
harness sends them, including the prompts where the template dropped reasoning or
re-serialized a tool call.

The scripted player:

- main agent: the think block restates the range it was told last (a copy, when
  ``think`` is on), then a guess drawn uniformly from the whole range (blind: the
  transcripts carry no strategy), as a compact tool call or ``maybe N``;
- subagent: the right report of the raw output it is given (a copy the subagent is
  taught, so that its report is worth reading; RL still has to learn to read it).

Replies are segmented with BPE-dropout (``experiments.guess.warmup.DropoutBPE``) around
the added tokens (``<think>``, ``<tool_call>`` and their ends), so the warmed model
samples noncanonical segmentations as a pretrained model does.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Sequence
from typing import Any

import torch

from experiments.agentic.harness import (
    CALL_END,
    CALL_START,
    THINK_END,
    THINK_START,
    Game,
    Mechanisms,
    Message,
    guess_text,
    play,
    report_text,
)
from experiments.guess.warmup import (
    INDUCTION_LR,
    Deck,
    DropoutBPE,
    at_once,
    copying_phase,
    masked_batch,
    trained,
)

STEPS = 300
GAMES_PER_STEP = 8  # ~20 calls: each one a row
LR = 5e-3
DROPOUT = 0.1
INDUCTION_STEPS = 300

_MARKERS = re.compile(
    "(" + "|".join(map(re.escape, (THINK_START, THINK_END, CALL_START, CALL_END))) + ")"
)
_QUESTION = re.compile(r"Tool output: Checked \d+: (higher|lower)\. Left: ([\d ]+)\. Report it\.")
_TOLD = re.compile(r"(\d+) to (\d+)")

Row = tuple[list[int], list[int]]  # prompt ids, reply ids (with the end-of-turn token)


class ScriptedPlayer:
    """The random player, as an ``Ask``: it records every call it answers."""

    def __init__(self, rng: random.Random, low: int, high: int, mechanisms: Mechanisms) -> None:
        self._guesses = Deck(rng, low, high)
        self.mechanisms = mechanisms
        self.calls: list[tuple[list[Message], str]] = []

    async def __call__(self, messages: list[Message], max_tokens: int) -> str:
        text = self.answer(messages)
        self.calls.append((messages, text))
        return text

    def answer(self, messages: list[Message]) -> str:
        last = str(messages[-1].get("content") or "")
        question = _QUESTION.fullmatch(last) if len(messages) == 1 else None
        if question is not None:
            direction, numbers = question.groups()
            left = [int(n) for n in numbers.split()]
            return report_text(direction, (left[0], left[-1]))
        low, high = (int(x) for x in _TOLD.findall(last)[-1])
        return guess_text(self._guesses.draw(), low, high, self.mechanisms)


def encode_reply(tokenizer: Any, text: str, dropout: DropoutBPE) -> list[int]:
    """A reply's ids: the added tokens as themselves, the text between them segmented
    with BPE-dropout, then the end-of-turn token. Checked to decode to ``text``."""
    ids: list[int] = []
    for piece in _MARKERS.split(text):
        if not piece:
            continue
        if _MARKERS.fullmatch(piece):
            ids.append(tokenizer.convert_tokens_to_ids(piece))
        else:
            ids += dropout.encode(piece)
    if tokenizer.decode(ids, skip_special_tokens=False) != text:
        raise ValueError(f"the reply {text!r} does not encode back to itself")
    return [*ids, tokenizer.eos_token_id]


def prompt_ids(tokenizer: Any, messages: list[Message]) -> list[int]:
    """The prompt as the server makes it: the template's text, tokenized plainly."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def transcripts(
    player: ScriptedPlayer, games: Sequence[Game], mechanisms: Mechanisms, rng: random.Random
) -> list[tuple[list[Message], str]]:
    """Every call of ``games`` played by ``player`` through the harness. The scripted
    player never waits, so each game runs to its end at once (also inside an event loop,
    where the trainer calls the warm-up)."""
    player.calls = []
    for game in games:
        at_once(play(game, mechanisms, player, rng), "a scripted game")
    return player.calls


def rows_batch(tokenizer: Any, rows: Sequence[Row]) -> tuple[torch.Tensor, ...]:
    """Right-padded ids, attention mask and labels (-100 off the replies)."""
    return masked_batch(
        tokenizer,
        [(prompt + reply, [0] * len(prompt) + [1] * len(reply)) for prompt, reply in rows],
    )


def warm_up(
    model: torch.nn.Module,
    tokenizer: Any,
    *,
    steps: int = STEPS,
    games_per_step: int = GAMES_PER_STEP,
    lr: float = LR,
    seed: int = 0,
    low: int = 1,
    high: int = 8,
    max_turns: int = 2,
    dropout: float = DROPOUT,
    induction_steps: int = INDUCTION_STEPS,
    target_weights: Sequence[float] | None = None,
    **options: Any,
) -> dict[str, float]:
    """Train ``model`` in place into a random player of the agentic game (the module's
    docstring); ``options`` are the task's mechanisms (``Mechanisms``) and whatever else
    the task passes. Answers ``loss`` (last 10 steps), ``first_loss``, ``induction_loss``
    and ``seconds``. ``target_weights`` is accepted and ignored: a random player does not
    know the house's habit."""
    del target_weights
    if steps < 1 or games_per_step < 1 or not low <= high or max_turns < 1:
        raise ValueError("warm_up needs steps, games_per_step, max_turns >= 1 and low <= high")
    mechanisms = Mechanisms.from_input(options)
    start = time.perf_counter()
    metrics, rehearsal = copying_phase(
        model, tokenizer, induction_steps, INDUCTION_LR, f"agentic-warmup-induction:{seed}"
    )
    rng = random.Random(f"agentic-warmup:{seed}")
    targets = Deck(rng, low, high)
    player = ScriptedPlayer(rng, low, high, mechanisms)
    segment = DropoutBPE(tokenizer, dropout, random.Random(f"agentic-warmup-dropout:{seed}"))
    retries = random.Random(f"agentic-warmup-retries:{seed}")

    def games() -> tuple[torch.Tensor, ...]:
        batch = [
            Game(target=targets.draw(), low=low, high=high, max_turns=max_turns)
            for _ in range(games_per_step)
        ]
        calls = transcripts(player, batch, mechanisms, retries)
        rows = [(prompt_ids(tokenizer, m), encode_reply(tokenizer, t, segment)) for m, t in calls]
        return rows_batch(tokenizer, rows)

    return {**metrics, **trained(model, [games, *rehearsal], steps, lr, start)}
