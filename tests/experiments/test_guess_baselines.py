"""experiments/guess/baselines.py: the exact figures of simple players of the guessing
game, checked by hand where they can be, against invariants (Hypothesis) and against the
harness's real ``play()`` driven by scripted players (every target played once for the
deterministic ones, a seeded Monte-Carlo for the random ones)."""

from __future__ import annotations

import asyncio
import functools
import random
import re
from collections.abc import Callable, Sequence
from fractions import Fraction
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments.guess.baselines import (
    Policy,
    Setting,
    View,
    best_blind,
    binary_search,
    blind,
    blind_in_range_bound,
    blind_sequences,
    consistent_random,
    evaluate,
    games,
    main,
    optimal,
    optimal_reward,
    sums,
    uniform_random,
)
from experiments.guess.harness import (
    FEEDBACK_IN_RANGE,
    REPEATED_GUESSES,
    Ask,
    Episode,
    Game,
    Message,
    parse_guess,
    play,
)

ROOT = Path(__file__).resolve().parents[2]
OPTIONS = yaml.safe_load((ROOT / "conf/task/guess.yaml").read_text())["options"]
DEFAULT = Setting.of(**OPTIONS)  # the default experiment's game: 2 turns
DEFAULT_UNIFORM = Setting.of(**(OPTIONS | {"target_weights": None}))
# The figures checked below are for the 3-turn game (the harder variant), which has more
# to check: a third guess, a binary search that covers 7 numbers.
HOUSE = Setting.of(**(OPTIONS | {"max_turns": 3}))
UNIFORM = Setting.of(**(OPTIONS | {"max_turns": 3, "target_weights": None}))
F = Fraction


# ------------------------------------------------------------------------ by hand


def test_the_task_is_the_one_these_figures_are_for() -> None:
    assert (DEFAULT.low, DEFAULT.high, DEFAULT.max_turns) == (1, 8, 2)
    assert DEFAULT.weights == HOUSE.weights == tuple(F(w) for w in (1, 1, 2, 4, 4, 2, 1, 1))


def test_the_default_games_figures_by_hand() -> None:
    """Two guesses: a blind player covers two numbers, one that reads the answer three
    (its first guess, then one on each side), so reading the feedback is the only way
    past the blind baseline: experiments/guess/README.md's table for the default game."""
    assert best_blind(DEFAULT)[0] == F(8, 16)  # 4 and 5, 4 + 4 of 16
    assert (4, 5) in best_blind(DEFAULT)[1]
    assert optimal_reward(DEFAULT) == F(10, 16)  # 4, then 3 after lower, 5 after higher
    assert best_blind(DEFAULT_UNIFORM)[0] == F(2, 8)
    assert optimal_reward(DEFAULT_UNIFORM) == F(3, 8)
    # 4, 5 under the weights: the 2nd guess (5) is in range for 5..8 only, 8 of 12.
    assert blind_in_range_bound(DEFAULT, F(8, 16)) == F(2, 3)
    assert blind_in_range_bound(DEFAULT, F(8, 16) + F(1, 1000)) is None
    for setting in (DEFAULT, DEFAULT_UNIFORM):
        assert evaluate(uniform_random(setting), setting).reward == 1 - F(7, 8) ** 2


def test_figures_that_can_be_checked_by_hand() -> None:
    # Blind: the three heaviest numbers, 4 + 4 + 2 of 16; any three of eight.
    assert best_blind(HOUSE)[0] == F(10, 16)
    assert (3, 4, 5) in best_blind(HOUSE)[1]
    assert best_blind(UNIFORM)[0] == F(3, 8)
    # 3, 4, 5 under the weights: targets 1 and 2 (2/16) get "lower, 1 to 2" and then two
    # guesses outside it; target 3 wins at once; 4..8 keep every later guess in range.
    assert evaluate(blind((3, 4, 5)), HOUSE).feedback_in_range == F(12, 14)
    # 4, 5, 6 under uniform targets: 1..3 (3/8) get two outside; 5..8 none.
    assert evaluate(blind((4, 5, 6)), UNIFORM).feedback_in_range == F(4, 7)
    # Climbing from the bottom is blind and always in range: the metric alone is no proof.
    assert evaluate(blind((1, 2, 3)), UNIFORM).feedback_in_range == 1
    # Three halvings cover 2^3 - 1 = 7 numbers; the one left out is 8 (weight 1 of 16).
    assert evaluate(binary_search(UNIFORM), UNIFORM).reward == F(7, 8)
    assert evaluate(binary_search(HOUSE), HOUSE).reward == F(15, 16)
    assert optimal_reward(HOUSE) == evaluate(optimal(HOUSE), HOUSE).reward == F(15, 16)
    # Random: three independent 1-in-8 chances, whatever the targets' weights.
    for setting in (HOUSE, UNIFORM):
        figures = evaluate(uniform_random(setting), setting)
        assert figures.reward == 1 - F(7, 8) ** 3
        assert figures.repeated_guesses is not None and figures.repeated_guesses > 0
    assert evaluate(consistent_random(UNIFORM), UNIFORM).reward == consistent_uniform(8, 3)
    # experiments/guess/README.md: consistent ≈ 0.62 with uniform targets, ≈ 0.577 weighted.
    assert round(float(evaluate(consistent_random(UNIFORM), UNIFORM).reward), 3) == 0.619
    assert round(float(evaluate(consistent_random(HOUSE), HOUSE).reward), 3) == 0.577


@functools.cache
def consistent_uniform(n: int, turns: int) -> Fraction:
    """A uniform guess inside a range of n numbers holding a uniform target: it hits with
    1/n, else the target is uniform in the side it lies on. Written apart from the
    module's game-tree walk, as a check on it."""
    if n == 0 or turns == 0:
        return F(0)
    rest = sum(
        (F(g - 1, n) * consistent_uniform(g - 1, turns - 1))
        + (F(n - g, n) * consistent_uniform(n - g, turns - 1))
        for g in range(1, n + 1)
    )
    return F(1, n) + rest / n


def test_the_blind_bound() -> None:
    # At the best blind reward only the best sequences count: 3, 4, 5 is the most in range.
    assert blind_in_range_bound(HOUSE, F(10, 16)) == F(6, 7)
    assert blind_in_range_bound(HOUSE, F(10, 16) + F(1, 1000)) is None
    # With uniform targets 1, 2, 3 is both the best blind player and always in range.
    assert blind_in_range_bound(UNIFORM, F(3, 8)) == 1
    assert blind_in_range_bound(HOUSE, F(0)) == 1
    # The consistent player's (0.577, 1.0) is out of every blind player's reach.
    consistent = evaluate(consistent_random(HOUSE), HOUSE)
    bound = blind_in_range_bound(HOUSE, consistent.reward)
    assert bound is not None and bound < consistent.feedback_in_range == 1


def test_the_table_prints(capsys: pytest.CaptureFixture[str]) -> None:
    main([])
    out = capsys.readouterr().out
    assert "best blind (4,5)   house      0.5000 (1/2)" in out
    assert "optimal            uniform    0.3750 (3/8)" in out
    main(["--max-turns", "3"])
    out = capsys.readouterr().out
    assert "best blind (3,4,5)  house      0.6250 (5/8)" in out
    assert "binary search       uniform    0.8750 (7/8)" in out
    main(["--high", "4", "--max-turns", "2", "--weights", "uniform"])
    out = capsys.readouterr().out
    assert "house" not in out.split("\n\n")[1] and "optimal" in out


# ------------------------------------------------------------------------- invariants


@st.composite
def small_settings(draw: st.DrawFn, max_span: int = 5, max_turns: int = 3) -> Setting:
    low = draw(st.integers(0, 3))
    span = draw(st.integers(1, max_span))
    weights = draw(st.lists(st.integers(0, 5), min_size=span, max_size=span))
    if sum(weights) == 0:
        weights[draw(st.integers(0, span - 1))] = 1
    turns = draw(st.integers(1, max_turns))
    return Setting.of(low, low + span - 1, turns, weights)


def players(setting: Setting) -> dict[str, Policy]:
    return {
        "uniform random": uniform_random(setting),
        "consistent random": consistent_random(setting),
        "binary search": binary_search(setting),
        "optimal": optimal(setting),
        "best blind": blind(best_blind(setting)[1][0]),
    }


@settings(max_examples=60, deadline=None)
@given(small_settings())
def test_every_player_plays_a_whole_game_tree(setting: Setting) -> None:
    for name, policy in players(setting).items():
        for target in setting.numbers:
            leaves = list(games(policy, setting, target))
            assert sum(leaf.probability for leaf in leaves) == 1, name
            for leaf in leaves:
                assert len(leaf.guesses) == len(leaf.ranges) <= setting.max_turns
                assert leaf.won == (leaf.guesses[-1] == target)
                assert leaf.won or len(leaf.guesses) == setting.max_turns
        figures = evaluate(policy, setting)
        for value in (figures.reward, figures.feedback_in_range, figures.repeated_guesses):
            assert value is None or 0 <= value <= 1, name


@settings(max_examples=60, deadline=None)
@given(small_settings())
def test_the_players_rank_as_they_must(setting: Setting) -> None:
    figures = {name: evaluate(p, setting) for name, p in players(setting).items()}
    best = optimal_reward(setting)
    assert figures["optimal"].reward == best
    assert all(f.reward <= best for f in figures.values())
    # Best blind: the heaviest max_turns numbers; the random player is a blind mixture.
    top = sorted(setting.weights, reverse=True)[: setting.max_turns]
    blind_reward = best_blind(setting)[0]
    assert blind_reward == sum(top) / sum(setting.weights) == figures["best blind"].reward
    assert figures["uniform random"].reward <= blind_reward
    # Players that read the range never leave it, so never repeat a refuted number.
    for name in ("consistent random", "binary search", "optimal"):
        assert figures[name].feedback_in_range in (None, 1), name
        assert figures[name].repeated_guesses in (None, 0), name


@settings(max_examples=30, deadline=None)
@given(
    small_settings(max_span=4, max_turns=3),
    st.lists(st.tuples(st.integers(1, 5), st.integers(0, 10**6)), min_size=1, max_size=3),
)
def test_no_blind_mixture_beats_the_bound(setting: Setting, mixture: list[tuple[int, int]]) -> None:
    sequences = list(blind_sequences(setting))
    parts = [(F(w), sums(blind(sequences[i % len(sequences)]), setting)) for w, i in mixture]
    total = sum(w for w, _ in parts)
    reward = sum(w * s.reward for w, s in parts) / total
    later = sum(w * s.later for w, s in parts)
    bound = blind_in_range_bound(setting, reward)
    if later:  # then the mixture itself is a blind player the bound covers
        assert bound is not None
        assert sum(w * s.in_range for w, s in parts) / later <= bound


# ------------------------------------------------------- against the harness's play()

_RANGE = re.compile(r"(\d+) to (\d+)")


def scripted(policy: Policy, game: Game, rng: random.Random) -> Ask:
    """``policy`` as a model: it reads the stated range from the last user message and its
    own guesses from its replies, as a model would, and answers "maybe N"."""

    async def ask(messages: list[Message]) -> str:
        low, high = (int(n) for n in _RANGE.findall(messages[-1]["content"])[-1])
        guesses = tuple(parse_guess(m["content"]) for m in messages if m["role"] == "assistant")
        view = View(low, high, guesses, game.max_turns - len(guesses))
        choices = list(policy(view).items())
        (guess,) = rng.choices([g for g, _ in choices], [float(p) for _, p in choices])
        return "hmm" if guess is None else f"maybe {guess}"

    return ask


def played(
    setting: Setting, policy: Policy, targets: Sequence[int], rng: random.Random
) -> list[Episode]:
    """One game per target through ``play()``, in one event loop (one each costs more)."""

    async def all_games() -> list[Episode]:
        episodes = []
        for target in targets:
            game = Game(target, setting.low, setting.high, setting.max_turns)
            episodes.append(await play(game, scripted(policy, game, rng)))
        return episodes

    return asyncio.run(all_games())


def means(episodes: Sequence[tuple[float, Episode]]) -> dict[str, float]:
    """Weighted means over the episodes, each metric over those that report it (as the
    trainer reads them)."""
    total = sum(w for w, _ in episodes)
    out = {"reward": sum(w * e.reward for w, e in episodes) / total}
    for name in (FEEDBACK_IN_RANGE, REPEATED_GUESSES):
        reported = [(w, e.metrics[name]) for w, e in episodes if name in e.metrics]
        out[name] = sum(w * v for w, v in reported) / sum(w for w, _ in reported)
    return out


def expected(policy: Policy, setting: Setting) -> dict[str, float]:
    figures = evaluate(policy, setting)
    return {
        "reward": float(figures.reward),
        FEEDBACK_IN_RANGE: float(figures.feedback_in_range or 0),
        REPEATED_GUESSES: float(figures.repeated_guesses or 0),
    }


@pytest.mark.parametrize("setting", [HOUSE, UNIFORM], ids=["house", "uniform"])
def test_deterministic_players_score_the_same_in_the_harness(setting: Setting) -> None:
    """Each target played once through ``play()``, weighted: the figures exactly."""
    rng = random.Random(0)  # unused: these players have one choice each time
    sequences = best_blind(setting)[1]
    policies = [binary_search(setting), optimal(setting), *(blind(s) for s in sequences)]
    policies += [blind(s) for s in [(1, 2, 3), (8, 1, 7), (None, 4, 4), (2, None, 9)]]
    for policy in policies:
        episodes = played(setting, policy, setting.numbers, rng)
        weights = [float(w) for w in setting.weights]
        assert means(list(zip(weights, episodes, strict=True))) == pytest.approx(
            expected(policy, setting), abs=1e-12
        )


# 20000 games: one standard deviation of the reward's mean is ≤ 0.0035, so 0.015 is over
# 4 of them, and the seed is fixed: the check cannot flake, yet it tells 0.577 from 0.62.
GAMES = 20_000
TOLERANCE = 0.015


@pytest.mark.slow
@pytest.mark.parametrize("setting", [HOUSE, UNIFORM], ids=["house", "uniform"])
@pytest.mark.parametrize("player", [uniform_random, consistent_random])
def test_random_players_score_the_same_in_the_harness(
    setting: Setting, player: Callable[[Setting], Policy]
) -> None:
    """A seeded Monte-Carlo of ``play()``: targets drawn from the weights, guesses by the
    scripted player."""
    policy = player(setting)
    rng = random.Random(f"baselines:{setting.weights}:{player.__name__}")
    targets = rng.choices(setting.numbers, [float(w) for w in setting.weights], k=GAMES)
    episodes = [(1.0, e) for e in played(setting, policy, targets, rng)]
    assert means(episodes) == pytest.approx(expected(policy, setting), abs=TOLERANCE)
