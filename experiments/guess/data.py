"""Inputs of the guessing game: training examples per step and a fixed validation set.

The house does not pick its numbers uniformly: ``target_weights`` (one weight per number
of the range; default favours the middle) is its habit. A player can learn it from the
rewards alone — a first gain RL finds within minutes, before the slower one of reading
the feedback. Uniform targets: ``target_weights: null``.

An input is what the harness reads (``experiments.guess.harness.Game.from_input``):
``{"target", "low", "high", "max_turns"}`` plus whatever other task options the trainer
passes (the sampling options ``temperature`` and ``max_tokens``), copied as they are.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Sequence
from typing import Any


def _game(
    target: int, low: int, high: int, max_turns: int, extra: dict[str, Any]
) -> dict[str, Any]:
    return {**extra, "target": target, "low": low, "high": high, "max_turns": max_turns}


def _check(n: int, low: int, high: int, max_turns: int) -> None:
    if n < 0 or low > high or max_turns < 1:
        raise ValueError(f"bad task: n={n}, low={low}, high={high}, max_turns={max_turns}")


def house_weights(low: int, high: int, target_weights: Sequence[float] | None) -> list[float]:
    """One weight per number of ``low..high``: ``target_weights`` checked, or uniform for
    None (also what ``baselines.py`` computes its figures under)."""
    span = high - low + 1
    if target_weights is None:
        return [1.0] * span
    if len(target_weights) != span or min(target_weights) < 0 or sum(target_weights) <= 0:
        raise ValueError(
            f"target_weights needs {span} non-negative weights (one per number of "
            f"{low}..{high}), not {list(target_weights)}"
        )
    return [float(w) for w in target_weights]


def train_inputs(
    step: int,
    n: int,
    seed: int,
    *,
    low: int = 1,
    high: int = 8,
    max_turns: int = 3,
    target_weights: Sequence[float] | None = None,
    **extra: Any,
) -> list[dict[str, Any]]:
    """``n`` games for training step ``step``: targets drawn from the house's weights
    (uniform by default), the same for the same ``(seed, step)`` (a resumed run replays
    its data)."""
    _check(n, low, high, max_turns)
    weights = house_weights(low, high, target_weights)
    # A string seed is hashed with SHA-512: stable across processes and Python versions.
    rng = random.Random(f"guess-train:{seed}:{step}")
    targets = rng.choices(range(low, high + 1), weights, k=n)
    return [_game(t, low, high, max_turns, extra) for t in targets]


def val_inputs(
    n: int,
    *,
    low: int = 1,
    high: int = 8,
    max_turns: int = 3,
    target_weights: Sequence[float] | None = None,
    **extra: Any,
) -> list[dict[str, Any]]:
    """``n`` fixed games whose targets follow the house's weights exactly (the target at
    each of ``n`` evenly spaced quantiles), so validation has no data noise; uniform
    weights spread the targets evenly over the range.

    No randomness at all: the same options give the same games at every step and in
    every run, for the house's weights and for ``target_weights=None`` alike (uniform:
    ``task.val_sets.uniform``, 16 of each number in 128 games), so two validation points
    differ only by the policy and its sampling."""
    _check(n, low, high, max_turns)
    weights = house_weights(low, high, target_weights)
    cumulative = list(itertools.accumulate(weights))
    total = cumulative[-1]
    targets = [low + bisect.bisect_right(cumulative, (i + 0.5) * total / n) for i in range(n)]
    return [_game(min(t, high), low, high, max_turns, extra) for t in targets]
