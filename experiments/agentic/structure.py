"""``python -m experiments.agentic.structure``: what each harness mechanism makes of the
calls, with no model and no sampling noise.

The warm-up's scripted random player plays games through the real harness (``Play``);
each call becomes a ``ModelCall`` with the prompt ids the server would render (the tiny
model's tokenizer and chat template) and the reply's canonical ids (``--dropout`` for the
warm-up's BPE-dropout segmentations instead). Then the trainer's own dedup and merges
turn them into samples. So the table shows what the harness's behaviour alone does to
``merge/samples_per_rollout``, the single-sample share and tokens computed per unique
token, one mechanism at a time and all together (the task's default), under each merge;
a trained model changes the figures only through how often it reaches a second turn.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from agl.backends.inference.models import load_model
from agl.core.contracts.samples import ModelCall
from agl.strategies.dedup import dedup
from agl.strategies.merge_metrics import merge_metrics, unique_tokens
from agl.strategies.registry import get, names
from experiments.agentic.baselines import TASK_CONFIG
from experiments.agentic.harness import Game, Mechanisms, play
from experiments.agentic.warmup import ScriptedPlayer, encode_reply, prompt_ids
from experiments.guess.baselines import task_options
from experiments.guess.data import house_weights
from experiments.guess.warmup import DropoutBPE, at_once

NONE = Mechanisms(tools=False, think=False, subagent=False, summary_chars=0, retry_rate=0.0)
# Past 30 characters: every history that reaches a second turn is summarized.
SUMMARY_CHARS = 30
SETTINGS: tuple[tuple[str, Mechanisms], ...] = (
    ("none", NONE),
    ("tools", dataclasses.replace(NONE, tools=True)),
    ("think", dataclasses.replace(NONE, think=True)),
    ("subagent", dataclasses.replace(NONE, subagent=True)),
    ("summary", dataclasses.replace(NONE, summary_chars=SUMMARY_CHARS)),
    ("retries", dataclasses.replace(NONE, retry_rate=0.1)),
    ("default", Mechanisms(retry_rate=0.1, format_retries=0)),
    ("all", Mechanisms(summary_chars=SUMMARY_CHARS, retry_rate=0.1, format_retries=0)),
)


@functools.cache
def tiny_tokenizer() -> Any:
    # Built once: load_model builds the whole tiny model around it.
    return load_model("tiny").tokenizer


@dataclass(frozen=True)
class Structure:
    samples_per_rollout: float
    single_sample_rollouts: float
    tokens_per_unique_token: float
    calls_per_rollout: float  # as sent, retries included
    trained_calls_per_rollout: float  # after dedup


def rollouts(
    mechanisms: Mechanisms, n: int, seed: int, dropout: float = 0.0, max_turns: int = 2
) -> list[list[ModelCall]]:
    """``n`` games of the random player (targets from the task's house weights), as calls."""
    option = task_options(TASK_CONFIG).get("target_weights")
    weights = house_weights(1, 8, option if isinstance(option, list) else None)
    played = games(mechanisms, n, seed, low=1, high=8, max_turns=max_turns, weights=weights)
    return [g.calls for g in played]


# A scripted player of ``low..high`` (``ScriptedPlayer``'s arguments).
Player = Callable[[random.Random, int, int, Mechanisms], ScriptedPlayer]


@dataclass(frozen=True)
class Played:
    """One game: its calls as the server saw them, the harness's reward and its turns."""

    calls: list[ModelCall]
    reward: float
    turns: int


def games(
    mechanisms: Mechanisms,
    n: int,
    seed: int,
    *,
    low: int,
    high: int,
    max_turns: int,
    weights: Sequence[float],
    dropout: float = 0.0,
    player: Player = ScriptedPlayer,
) -> list[Played]:
    """``n`` games of ``player`` (the warm-up's random player by default) through the
    harness, targets drawn from ``weights`` (one per number of ``low..high``)."""
    tokenizer = tiny_tokenizer()
    rng = random.Random(f"agentic-structure:{seed}")
    segment = DropoutBPE(tokenizer, dropout, random.Random(f"agentic-structure-bpe:{seed}"))
    scripted = player(rng, low, high, mechanisms)
    out = []
    for _ in range(n):
        target = rng.choices(range(low, high + 1), weights)[0]
        game = Game(target=target, low=low, high=high, max_turns=max_turns)
        scripted.calls = []
        episode = at_once(play(game, mechanisms, scripted, rng), "a scripted game")
        calls = [
            ModelCall(
                prompt_ids(tokenizer, messages),
                (ids := encode_reply(tokenizer, text, segment)),
                [0.0] * len(ids),
            )
            for messages, text in scripted.calls
        ]
        out.append(Played(calls, episode.reward, len(episode.guesses)))
    return out


def structure(calls: Sequence[Sequence[ModelCall]], merge: str) -> Structure:
    decode = tiny_tokenizer().decode
    strategy = get("merge", merge)
    options = {"decode": decode} if merge == "stitch" else {}
    kept = [dedup(c) for c in calls]
    merged = [strategy(c, f"r{i}", "g", **options) for i, c in enumerate(kept)]
    unique = sum(unique_tokens([[*c.prompt_ids, *c.response_ids] for c in r]) for r in kept)
    m = merge_metrics(merged, sum(map(len, kept)), unique)
    return Structure(
        m["merge/samples_per_rollout"],
        m["merge/single_sample_rollouts"],
        m["merge/tokens_per_unique_token"],
        sum(map(len, calls)) / len(calls),
        sum(map(len, kept)) / len(kept),
    )


COLUMNS = ["merge", "samples/rollout", "one sample", "tokens/unique", "calls", "trained"]


def merge_rows(label: str, calls: Sequence[Sequence[ModelCall]]) -> list[list[str]]:
    """A table's rows for ``calls`` (``label`` first): each merge's ``structure``."""
    rows = []
    for merge in names("merge"):
        s = structure(calls, merge)
        rows.append(
            [
                label,
                merge,
                f"{s.samples_per_rollout:.2f}",
                f"{s.single_sample_rollouts:.0%}",
                f"{s.tokens_per_unique_token:.2f}",
                f"{s.calls_per_rollout:.2f}",
                f"{s.trained_calls_per_rollout:.2f}",
            ]
        )
    return rows


def text_table(rows: Sequence[Sequence[str]]) -> str:
    """Rows (the head first) in columns padded to their widest cell."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows
    )


def report(n: int, seed: int, dropout: float) -> str:
    rows = [["mechanisms", *COLUMNS]]
    for label, mechanisms in SETTINGS:
        rows += merge_rows(label, rollouts(mechanisms, n, seed, dropout))
    return (
        f"{n} games of the random player per setting (seed {seed}, BPE-dropout {dropout})\n"
        + text_table(rows)
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.agentic.structure")
    parser.add_argument("--games", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dropout", type=float, default=0.0)
    args = parser.parse_args(argv)
    print(report(args.games, args.seed, args.dropout))


if __name__ == "__main__":
    main()
