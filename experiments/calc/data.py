"""Arithmetic questions for the calculator task: deterministic in (seed, step)."""

from __future__ import annotations

import random
from typing import Any

OPERATORS = ("+", "-", "*")


def _question(rng: random.Random, digits: int) -> dict[str, Any]:
    low, high = 10 ** (digits - 1), 10**digits - 1
    a, b = rng.randint(low, high), rng.randint(low, high)
    op = rng.choice(OPERATORS)
    answer = {"+": a + b, "-": a - b, "*": a * b}[op]
    return {"question": f"What is {a} {op} {b}?", "answer": answer}


def train_inputs(step: int, n: int, seed: int, digits: int = 2, **_: Any) -> list[dict[str, Any]]:
    rng = random.Random(f"calc-train-{seed}-{step}")
    return [_question(rng, digits) for _ in range(n)]


def val_inputs(n: int, digits: int = 2, **_: Any) -> list[dict[str, Any]]:
    rng = random.Random("calc-val")
    return [_question(rng, digits) for _ in range(n)]
