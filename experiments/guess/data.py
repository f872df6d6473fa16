"""Inputs of the guessing game: training examples per step and a fixed validation set.

An input is what the harness reads (``experiments.guess.harness.Game.from_input``):
``{"target", "low", "high", "max_turns"}`` plus whatever other task options the trainer
passes (the sampling options ``temperature`` and ``max_tokens``), copied as they are.
"""

from __future__ import annotations

import random
from typing import Any


def _game(
    target: int, low: int, high: int, max_turns: int, extra: dict[str, Any]
) -> dict[str, Any]:
    return {**extra, "target": target, "low": low, "high": high, "max_turns": max_turns}


def _check(n: int, low: int, high: int, max_turns: int) -> None:
    if n < 0 or low > high or max_turns < 1:
        raise ValueError(f"bad task: n={n}, low={low}, high={high}, max_turns={max_turns}")


def train_inputs(
    step: int,
    n: int,
    seed: int,
    *,
    low: int = 1,
    high: int = 8,
    max_turns: int = 3,
    **extra: Any,
) -> list[dict[str, Any]]:
    """``n`` games for training step ``step``: targets uniform in ``[low, high]``, the
    same for the same ``(seed, step)`` (a resumed run replays its data)."""
    _check(n, low, high, max_turns)
    # A string seed is hashed with SHA-512: stable across processes and Python versions.
    rng = random.Random(f"guess-train:{seed}:{step}")
    return [_game(rng.randint(low, high), low, high, max_turns, extra) for _ in range(n)]


def val_inputs(
    n: int, *, low: int = 1, high: int = 8, max_turns: int = 3, **extra: Any
) -> list[dict[str, Any]]:
    """``n`` fixed games whose targets are spread evenly over the range (every target
    equally often when ``n`` is a multiple of its size), so validation has no data noise."""
    _check(n, low, high, max_turns)
    span = high - low + 1
    return [_game(low + i * span // n, low, high, max_turns, extra) for i in range(n)]
