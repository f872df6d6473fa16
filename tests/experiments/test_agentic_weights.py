"""How the Figure 9 settings weigh rollouts before training (experiments/agentic/weights.py):
the chain is the trainer's, rollout-level advantage with rollout-mean pushes nowhere on the
whole, token-mean pushes down where failures are longer, the figures match a hand-computed
example, and the long task pulls the settings further apart than today's at the start."""

from __future__ import annotations

import functools
import math
from fractions import Fraction

import pytest

from agl.core.contracts.records import Status
from agl.core.contracts.samples import ModelCall
from agl.core.trainer.assemble import FinishedRollout, MergeStrategy, assemble
from agl.strategies.registry import get
from experiments.agentic.structure import Played
from experiments.agentic.weights import (
    MERGE,
    PLAYERS,
    SETTINGS,
    TASKS,
    Row,
    batch,
    measure,
    rollout_id,
    simulate,
    table,
    weigh,
    weigh_step,
)
from experiments.guess.baselines import task_options

GROUPS = 32


@pytest.fixture(scope="module")
def played() -> dict[tuple[str, str], list[list[Played]]]:
    """(task, player) -> groups of games, as the report simulates them."""
    return {
        (task, player): simulate(task_options(path), make, GROUPS, seed=0)
        for task, (path, _) in TASKS.items()
        for player, make in PLAYERS.items()
    }


@pytest.fixture(scope="module")
def rows() -> list[Row]:
    return measure(GROUPS, seed=0)


def _call(prompt: list[int], response: list[int]) -> ModelCall:
    return ModelCall(prompt, response, [0.0] * len(response))


# A won game: one call of 3 action tokens. A lost one: two calls of 4 and 5, the second's
# prompt not extending the first call, so the prefix merge makes two samples of them.
WIN = Played([_call([1, 2], [3, 4, 5])], 1.0, 1)
LOSS = Played([_call([1, 2], [6, 7, 8, 9]), _call([1, 2, 10], [11, 12, 13, 14, 15])], 0.0, 2)


@pytest.mark.parametrize(
    ("advantage", "loss", "win_loss", "on_failures", "net_push"),
    [
        # 3 + 9 tokens, each 1/12; A = ±c, so (3 - 9) / (3 + 9).
        ("rollout", "token_mean", Fraction(3, 9), Fraction(9, 12), Fraction(-1, 2)),
        # Each rollout 1/2, A = ±c: no push.
        ("rollout", "rollout_mean", Fraction(1), Fraction(1, 2), Fraction(0)),
        # Three samples, each 1/3: the win 1/3, the loss 2/3; (1 - 2) / (1 + 2).
        ("rollout", "seq_mean", Fraction(1, 2), Fraction(2, 3), Fraction(-1, 3)),
        # Over samples, rewards [1, 0, 0]: A = 2c for the win, -c for each lost sample;
        # (3 * 2 - 9) / (3 * 2 + 9).
        ("sample", "token_mean", Fraction(3, 9), Fraction(9, 12), Fraction(-1, 5)),
    ],
)
def test_a_hand_computed_group_of_two(
    advantage: str, loss: str, win_loss: Fraction, on_failures: Fraction, net_push: Fraction
) -> None:
    weighing = weigh([[WIN, LOSS]], 1, advantage, loss)
    assert weighing.win_loss == pytest.approx(float(win_loss), abs=1e-12)
    assert weighing.on_failures == pytest.approx(float(on_failures), abs=1e-12)
    assert weighing.net_push == pytest.approx(float(net_push), abs=1e-12)


@pytest.mark.parametrize("advantage", ["rollout", "sample"])
def test_the_chain_is_the_trainers(played: dict, advantage: str) -> None:
    """``batch`` gives what ``agl.core.trainer.assemble`` gives for the same step."""
    groups = played[("long", "start")][:8] + played[("today", "start")][:8]
    finished = [
        FinishedRollout(
            rollout_id(g, k), f"g{g}", "train", Status.SUCCEEDED, game.reward, game.calls
        )
        for g, group in enumerate(groups)
        for k, game in enumerate(group)
    ]
    trainer = assemble(
        finished, MergeStrategy(get("merge", MERGE)), functools.partial(get("advantage", advantage))
    )
    samples, advantages = batch(groups, advantage)
    assert samples == trainer.samples
    assert advantages == trainer.advantages


def _mixes(groups: list[list[Played]]) -> list[list[Played]]:
    """One group per number of wins, 0 to 8, of the games in ``groups``."""
    games = [game for group in groups for game in group]
    wins = [g for g in games if g.reward]
    losses = [g for g in games if not g.reward]
    return [wins[:k] + losses[: 8 - k] for k in range(9)]


def test_rollout_advantage_with_rollout_mean_pushes_nowhere_in_every_mix(played: dict) -> None:
    """Each rollout weighs 1/R in all, and a group's rollout advantages sum to 0."""
    for groups in played.values():
        mixes = _mixes(groups)
        for mix in mixes:
            assert abs(weigh_step([mix], "rollout", "rollout_mean").net_push) <= 1e-9
        assert abs(weigh_step(mixes, "rollout", "rollout_mean").net_push) <= 1e-9
        assert abs(weigh(groups, 16, "rollout", "rollout_mean").net_push) <= 1e-9
    # And a step's push is not 0 by accident: token-mean pushes the same mixes down.
    assert weigh_step(_mixes(played[("long", "start")]), "rollout", "token_mean").net_push < -0.1


def test_token_mean_pushes_down_where_failures_are_longer(played: dict) -> None:
    assert weigh([[WIN, LOSS]], 1, "rollout", "token_mean").net_push < 0
    # The same rollouts with the lengths the other way round push up.
    long_win = Played(LOSS.calls, 1.0, 2)
    short_loss = Played(WIN.calls, 0.0, 1)
    assert weigh([[long_win, short_loss]], 1, "rollout", "token_mean").net_push > 0
    for groups in played.values():
        assert weigh(groups, 16, "rollout", "token_mean").net_push < 0


def test_the_late_player_plays_at_its_exact_reward(played: dict) -> None:
    """The consistent player's reward: W(n, t) = 1/n + Σ_g [(g-1) W(g-1, t-1) +
    (n-g) W(n-g, t-1)] / n² on uniform targets (0.533 for 1..32 in 5 turns)."""

    @functools.cache
    def won(n: int, t: int) -> Fraction:
        if n == 0 or t == 0:
            return Fraction(0)
        rest = sum(
            ((g - 1) * won(g - 1, t - 1) + (n - g) * won(n - g, t - 1) for g in range(1, n + 1)),
            Fraction(0),
        )
        return Fraction(1, n) + rest / n**2

    games = [game for group in played[("long", "late")] for game in group]
    reward = sum(game.reward for game in games) / len(games)
    # 256 games: the standard error is 0.031.
    assert reward == pytest.approx(float(won(32, 5)), abs=0.08)
    assert float(won(32, 5)) == pytest.approx(0.533, abs=5e-4)


def test_the_long_task_pulls_token_and_seq_mean_further_than_today_at_the_start(
    rows: list[Row],
) -> None:
    push = {(r.task, r.player, r.setting): r.weighing.net_push for r in rows}
    for setting in ("rollout+token_mean", "rollout+seq_mean"):
        assert abs(push[("long", "start", setting)]) > abs(push[("today", "start", setting)])
    # A first-guess win: 1 sample of 5 on the long task, 1 of 3 today.
    ratio = {(r.task, r.player, r.setting): r.weighing.win_loss for r in rows}
    assert ratio[("long", "start", "rollout+seq_mean")] == pytest.approx(1 / 5)
    assert ratio[("today", "start", "rollout+seq_mean")] == pytest.approx(1 / 3)
    assert ratio[("long", "late", "rollout+rollout_mean")] == pytest.approx(1.0)


def test_the_table_has_a_row_per_task_player_and_setting(rows: list[Row]) -> None:
    lines = table(rows)
    assert len(lines) == 1 + len(TASKS) * len(PLAYERS) * len(SETTINGS)
    assert all(len(line) == len(lines[0]) for line in lines)
    assert all(not math.isnan(r.weighing.win_loss) for r in rows)
