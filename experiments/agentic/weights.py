"""``python -m experiments.agentic.weights``: how far the Figure 9 settings' per-rollout
weights and net push move apart, before any training.

Scripted players play groups of games through the real harness (``structure.games``: the
tiny model's tokenizer and chat template), on the long task (``conf/task/agentic_long.yaml``)
and on today's (``conf/task/agentic.yaml``). Each step of ``groups_per_step`` groups (the
run config's) goes through agl's own chain, as the trainer builds a batch: dedup, the
prefix merge, the advantage strategy over the step's samples, the loss strategy's weights
over the step, and the trainer's ``train/net_push`` (``agl.strategies.weights.push``).

The players:

- ``start``: the warm-up's random player (``ScriptedPlayer``), uniform over the whole range
  and blind to the feedback: the policy as training starts;
- ``late``: guesses uniformly inside the range it was told last (``ConsistentPlayer``;
  exactly 0.533 on the long task), standing in for a policy late in training.

What is measured, per setting (advantage level + loss normalisation):

- a rollout's weight, Σ of ``w`` over its samples' action tokens (every loss strategy's
  weights sum to 1 over a step); ``win/loss``: the mean weight of a game won by its first
  guess over that of a lost game; ``on failures``: the share of a step's weight on
  rollouts with reward 0;
- ``net push`` = Σ w·A / Σ |w·A| over the step's action tokens (A: the sample's advantage),
  in [-1, 1]: below 0, the loss pushes sampled tokens down on the whole.

The trainer builds a batch with ``agl.core.trainer.assemble``, which an experiment may not
import (tests/test_layering.py, rule 9); ``batch`` chains the same strategies in the same
order, and tests/experiments/test_agentic_weights.py checks that both give the same
samples and advantages. The torch backend normalises each of its optimizer mini-batches
on its own; ``train/net_push`` and these figures normalise the whole step once.
"""

from __future__ import annotations

import argparse
import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agl.core.contracts.samples import Sample
from agl.strategies.dedup import dedup
from agl.strategies.registry import get
from agl.strategies.weights import push
from experiments.agentic.harness import Mechanisms, Message, guess_text
from experiments.agentic.structure import Played, Player, games, text_table
from experiments.agentic.warmup import ScriptedPlayer
from experiments.guess.baselines import task_options
from experiments.guess.data import house_weights

CONF = Path(__file__).resolve().parents[2] / "conf"
# name -> (task yaml, run config whose trainer.groups_per_step makes a step)
TASKS = {
    "long": (CONF / "task" / "agentic_long.yaml", "agentic_long"),
    "today": (CONF / "task" / "agentic.yaml", "agentic"),
}
# Figure 9's settings (advantage level, loss normalisation), the reference third.
SETTINGS = (
    ("sample", "token_mean"),
    ("rollout", "token_mean"),
    ("rollout", "rollout_mean"),
    ("rollout", "seq_mean"),
)
MERGE = "prefix"
GROUP_SIZE = 8
# The range a main-agent prompt states last: "1 to 32", "higher, 17 to 32", a summary's.
_TOLD = re.compile(r"(\d+) to (\d+)")


class ConsistentPlayer(ScriptedPlayer):
    """The warm-up's player, but each guess uniform inside the range it was told last
    (the subagent still reports right): it never repeats a refuted number."""

    def __init__(self, rng: random.Random, low: int, high: int, mechanisms: Mechanisms) -> None:
        super().__init__(rng, low, high, mechanisms)
        self._rng = rng

    def answer(self, messages: list[Message]) -> str:
        told = _TOLD.findall(str(messages[-1].get("content") or ""))
        if not told:  # the subagent's question states no range
            return super().answer(messages)
        low, high = (int(x) for x in told[-1])
        return guess_text(self._rng.randint(low, high), low, high, self.mechanisms)


PLAYERS: dict[str, Player] = {"start": ScriptedPlayer, "late": ConsistentPlayer}


def simulate(options: dict[str, Any], player: Player, groups: int, seed: int) -> list[list[Played]]:
    """``groups`` groups of ``GROUP_SIZE`` games of ``player`` under a task's options."""
    low, high = int(options.get("low", 1)), int(options.get("high", 8))
    option = options.get("target_weights")
    played = games(
        Mechanisms.from_input(options),
        groups * GROUP_SIZE,
        seed,
        low=low,
        high=high,
        max_turns=int(options.get("max_turns", 2)),
        weights=house_weights(low, high, option if isinstance(option, list) else None),
        player=player,
    )
    return [played[i : i + GROUP_SIZE] for i in range(0, len(played), GROUP_SIZE)]


def rollout_id(group: int, k: int) -> str:
    return f"g{group}.{k}"


def batch(groups: Sequence[Sequence[Played]], advantage: str) -> tuple[list[Sample], list[float]]:
    """One step's samples and advantages, as ``agl.core.trainer.assemble`` makes them for
    a synchronous step in which every rollout has a reward: each rollout's calls deduped
    and merged, then the advantage over all the step's samples. Rollout ids are
    ``rollout_id(group, k)``, group ids ``g<group>``."""
    merge = get("merge", MERGE)
    samples: list[Sample] = []
    rewards: dict[str, float] = {}
    for g, group in enumerate(groups):
        for k, game in enumerate(group):
            rewards[rollout_id(g, k)] = game.reward
            calls = dedup(game.calls)
            samples += merge(calls, rollout_id(g, k), f"g{g}") if calls else []
    return samples, get("advantage", advantage)(samples, rewards)


@dataclass(frozen=True)
class Step:
    """One step's weighing: each rollout's weight (Σ w over its action tokens; they sum
    to 1) and the trainer's ``push`` metrics."""

    weights: dict[str, float]
    net_push: float
    negative_weight: float


def weigh_step(groups: Sequence[Sequence[Played]], advantage: str, loss: str) -> Step:
    samples, advantages = batch(groups, advantage)
    rows = get("loss", loss)(samples)
    weights = {rollout_id(g, k): 0.0 for g, group in enumerate(groups) for k in range(len(group))}
    for sample, row in zip(samples, rows, strict=True):
        weights[sample.rollout_id] += math.fsum(row)
    metrics = push(rows, advantages)
    return Step(weights, metrics["net_push"], metrics["negative_weight"])


@dataclass(frozen=True)
class Weighing:
    """A setting over several steps, each figure the mean of the steps': ``net_push`` and
    ``negative_weight`` as the trainer logs them; ``win_loss`` the mean weight of a
    first-guess win over that of a lost game (over the steps that have both; nan if none
    has); ``on_failures`` the share of the weight on rollouts with reward 0."""

    net_push: float
    negative_weight: float
    win_loss: float
    on_failures: float


def weigh(
    groups: Sequence[Sequence[Played]], groups_per_step: int, advantage: str, loss: str
) -> Weighing:
    steps = [groups[i : i + groups_per_step] for i in range(0, len(groups), groups_per_step)]
    pushes, negatives, ratios, failures = [], [], [], []
    for step in steps:
        weighed = weigh_step(step, advantage, loss)
        pushes.append(weighed.net_push)
        negatives.append(weighed.negative_weight)
        wins: list[float] = []
        losses: list[float] = []
        for g, group in enumerate(step):
            for k, game in enumerate(group):
                w = weighed.weights[rollout_id(g, k)]
                if game.reward == 0:
                    losses.append(w)
                elif game.turns == 1:
                    wins.append(w)
        # Within a step, where every weight has the same normaliser.
        if wins and losses:
            ratios.append(_mean(wins) / _mean(losses))
        failures.append(math.fsum(losses) / math.fsum(weighed.weights.values()))
    ratio = _mean(ratios) if ratios else math.nan
    return Weighing(_mean(pushes), _mean(negatives), ratio, _mean(failures))


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


def groups_per_step(config: str) -> int:
    """``trainer.groups_per_step`` of the run config ``conf/<config>.yaml``, composed."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return int(compose(config_name=config).trainer.groups_per_step)


@dataclass(frozen=True)
class Row:
    task: str
    player: str
    reward: float  # the players' mean reward over the simulated games
    setting: str
    weighing: Weighing


def measure(groups: int, seed: int) -> list[Row]:
    rows = []
    for task, (path, config) in TASKS.items():
        options = task_options(path)
        per_step = groups_per_step(config)
        for player, make in PLAYERS.items():
            played = simulate(options, make, groups, seed)
            reward = _mean([game.reward for group in played for game in group])
            for advantage, loss in SETTINGS:
                weighing = weigh(played, per_step, advantage, loss)
                rows.append(Row(task, player, reward, f"{advantage}+{loss}", weighing))
    return rows


COLUMNS = [
    "task",
    "player (reward)",
    "setting",
    "net push",
    "x today's",
    "win/loss weight",
    "weight on failures",
    "negative_weight",
]


def table(rows: Sequence[Row]) -> list[list[str]]:
    """The head, then one row per measurement; ``x today's``: the long task's net push
    over today's for the same player and setting (- where either is near 0: a ratio
    with a push that balances says nothing)."""
    today = {(r.player, r.setting): r.weighing.net_push for r in rows if r.task == "today"}
    out = [COLUMNS]
    for r in rows:
        w = r.weighing
        base = today.get((r.player, r.setting), 0.0)
        pushes = r.task != "today" and min(abs(base), abs(w.net_push)) >= 0.01
        times = f"{w.net_push / base:.1f}x" if pushes else "-"
        out.append(
            [
                r.task,
                f"{r.player} ({r.reward:.2f})",
                r.setting,
                f"{w.net_push:+.3f}",
                times,
                f"{w.win_loss:.2f}",
                f"{w.on_failures:.0%}",
                f"{w.negative_weight:.0%}",
            ]
        )
    return out


def markdown(rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(row) + " |" for row in rows]
    lines.insert(1, "|" + "---|" * len(rows[0]))
    return "\n".join(lines)


def report(groups: int, seed: int, plain: bool = False) -> str:
    rows = table(measure(groups, seed))
    head = (
        f"{groups} groups of {GROUP_SIZE} per task and player (seed {seed}), merge {MERGE}; "
        "a step is the run config's groups_per_step"
    )
    return head + "\n\n" + (text_table(rows) if plain else markdown(rows))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.agentic.weights")
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plain", action="store_true", help="padded columns, not markdown")
    args = parser.parse_args(argv)
    print(report(args.groups, args.seed, args.plain))


if __name__ == "__main__":
    main()
