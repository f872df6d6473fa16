"""What simple players of the guessing game score, exactly: the figures a trained model's
reward and ``feedback_in_range`` must be read against.

Reward alone does not show that a player reads the feedback: under the house's weights
``[1, 1, 2, 4, 4, 2, 1, 1]`` the fixed sequence 3, 4, 5, which never looks at the answers,
wins 10 games in 16, more than a player that reads the range but guesses at random inside
it (0.577). So each figure
here comes with ``feedback_in_range`` (the share of the later guesses inside the range
the user stated just before them, as the harness reports it) and ``repeated_guesses``.

Every figure is an exact expectation (``Fraction``), computed by walking the whole game
tree of each target with the harness's own rules (``harness.feedback``) and metrics
(``harness.in_range_counts``, ``harness.repeat_counts``), not by simulation. Like the
trainer's means, ``feedback_in_range`` and ``repeated_guesses`` average over the games that
have a later guess (a game won at the first guess has none).

The players:

- **uniform random**: each guess uniform over the whole range, independent of everything
  (what the warm-up produces);
- **best blind**: the best fixed sequence of guesses, found by enumerating all of them; no
  feedback-blind player does better (a random one is a mixture of fixed sequences), so a
  reward above it shows the feedback was read. Of the sequences that tie, the table shows
  the one whose later guesses land inside the stated range most often;
- **consistent random**: each guess uniform inside the range stated last (so it never
  repeats a refuted number);
- **binary search**: the middle of the stated range (the lower middle of an even range);
- **optimal**: the best feedback-using player under the target weights, by dynamic
  programming over (stated range, turns left): what the feedback tells is only the range,
  so the range is the whole belief state. Ties go to the guess nearest the middle.

``feedback_in_range`` alone proves nothing either: climbing from the bottom (1, 2, 3) is
blind and always in range. ``blind_in_range_bound`` gives, for a reward, the highest
``feedback_in_range`` of any blind player scoring at least that much; a figure above it
shows the feedback was read.

``python -m experiments.guess.baselines`` prints the table for the options of
``conf/task/guess.yaml`` (``--low``, ``--high``, ``--max-turns``, ``--weights`` override
them), under the house's weights and under uniform targets. The bound walks the tree of
every fixed sequence, ``(high - low + 2) ** max_turns`` of them (a reply without a number
included): 1.5 s for 1..8 in 3 turns, about 80 s for 1..16 in 4.
"""

from __future__ import annotations

import argparse
import functools
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import yaml

from experiments.guess.data import house_weights
from experiments.guess.harness import Range, feedback, in_range_counts, repeat_counts

TASK_CONFIG = Path(__file__).resolve().parents[2] / "conf" / "task" / "guess.yaml"


@dataclass(frozen=True)
class Setting:
    """One game as ``conf/task/guess.yaml``'s options describe it."""

    low: int = 1
    high: int = 8
    max_turns: int = 3
    # One weight per number of low..high (exact); None in the options means uniform.
    weights: tuple[Fraction, ...] = (Fraction(1),) * 8

    @classmethod
    def of(
        cls,
        low: int = 1,
        high: int = 8,
        max_turns: int = 3,
        target_weights: Sequence[float] | None = None,
    ) -> Setting:
        if low > high or max_turns < 1:
            raise ValueError(f"bad game: low={low}, high={high}, max_turns={max_turns}")
        # Fraction of a float is its exact binary value: YAML's 0.5 stays 1/2.
        weights = tuple(Fraction(w) for w in house_weights(low, high, target_weights))
        return cls(low, high, max_turns, weights)

    @property
    def numbers(self) -> range:
        return range(self.low, self.high + 1)

    def weight(self, number: int) -> Fraction:
        return self.weights[number - self.low]

    def mass(self, low: int, high: int) -> Fraction:
        """The weight of the targets in ``low..high`` (0 for an empty range)."""
        return sum((self.weight(n) for n in range(low, high + 1)), Fraction(0))


@dataclass(frozen=True)
class View:
    """What a player knows when it guesses: the range stated last, its own guesses so far,
    and the turns left (this one included)."""

    low: int
    high: int
    guesses: tuple[int | None, ...]
    turns_left: int


# A player: what it knows -> the probability of each guess (they sum to 1); None is a
# reply without a number.
Policy = Callable[[View], Mapping[int | None, Fraction]]


@dataclass(frozen=True)
class Figures:
    """A player's expected figures; a metric is None where no game has a later guess."""

    reward: Fraction
    feedback_in_range: Fraction | None
    repeated_guesses: Fraction | None


# ---------------------------------------------------------------------------- players


def _uniform(numbers: range) -> dict[int | None, Fraction]:
    return {n: Fraction(1, len(numbers)) for n in numbers}


def uniform_random(setting: Setting) -> Policy:
    """Independent uniform guesses over the whole range: the warmed-up model."""
    choice = _uniform(setting.numbers)
    return lambda view: choice


def consistent_random(setting: Setting) -> Policy:
    """A uniform guess inside the range stated last. Every refuted number lies outside
    that range, so it never repeats one."""
    return lambda view: _uniform(range(view.low, view.high + 1))


def binary_search(setting: Setting) -> Policy:
    """The (lower) middle of the range stated last."""
    return lambda view: {(view.low + view.high) // 2: Fraction(1)}


def blind(sequence: Sequence[int | None]) -> Policy:
    """The fixed sequence of guesses, whatever the answers."""
    fixed = tuple(sequence)
    return lambda view: {fixed[len(view.guesses)]: Fraction(1)}


def optimal(setting: Setting) -> Policy:
    """The guess that maximises the chance of a hit in the turns left, given the range."""
    return lambda view: {_best_guess(setting, view.low, view.high, view.turns_left): Fraction(1)}


@functools.cache
def _won_mass(setting: Setting, low: int, high: int, turns: int) -> Fraction:
    """The most target weight in ``low..high`` that ``turns`` guesses can hit."""
    if turns == 0 or low > high:
        return Fraction(0)
    return max(_split(setting, low, high, turns, g) for g in range(low, high + 1))


def _split(setting: Setting, low: int, high: int, turns: int, guess: int) -> Fraction:
    # Guessing inside the range is never worse than outside it (that only wastes a turn).
    return (
        setting.weight(guess)
        + _won_mass(setting, low, guess - 1, turns - 1)
        + _won_mass(setting, guess + 1, high, turns - 1)
    )


@functools.cache
def _best_guess(setting: Setting, low: int, high: int, turns: int) -> int:
    middle = Fraction(low + high, 2)
    return max(
        range(low, high + 1),
        # The best split; of those, the one nearest the middle, then the lower one.
        key=lambda g: (_split(setting, low, high, turns, g), -abs(g - middle), -g),
    )


def optimal_reward(setting: Setting) -> Fraction:
    """The optimal player's reward, straight from the dynamic programme."""
    total = setting.mass(setting.low, setting.high)
    return _won_mass(setting, setting.low, setting.high, setting.max_turns) / total


# ------------------------------------------------------------------------- the game tree


@dataclass(frozen=True)
class Leaf:
    """One way a game against one target can go, and its probability."""

    probability: Fraction
    guesses: tuple[int | None, ...]
    ranges: tuple[Range, ...]
    won: bool


def games(policy: Policy, setting: Setting, target: int) -> Iterator[Leaf]:
    """Every game ``policy`` can play against ``target``, under the harness's rules."""

    def walk(
        probability: Fraction,
        low: int,
        high: int,
        guesses: tuple[int | None, ...],
        ranges: tuple[Range, ...],
    ) -> Iterator[Leaf]:
        view = View(low, high, guesses, setting.max_turns - len(guesses))
        for guess, p in policy(view).items():
            if p == 0:
                continue
            answer, next_low, next_high = feedback(guess, target, low, high)
            played, stated = (*guesses, guess), (*ranges, (low, high))
            if answer is None or len(played) == setting.max_turns:
                yield Leaf(probability * p, played, stated, answer is None)
            else:
                yield from walk(probability * p, next_low, next_high, played, stated)

    return walk(Fraction(1), setting.low, setting.high, (), ())


@dataclass(frozen=True)
class Sums:
    """Expectations over games: the reward, the chance of a later guess, and the shares
    of later guesses in range / repeated (counted 0 in games without a later guess)."""

    reward: Fraction
    later: Fraction
    in_range: Fraction
    repeated: Fraction

    @property
    def figures(self) -> Figures:
        if self.later == 0:
            return Figures(self.reward, None, None)
        return Figures(self.reward, self.in_range / self.later, self.repeated / self.later)


def sums(policy: Policy, setting: Setting) -> Sums:
    """The exact expected sums of ``policy`` over the targets' weights."""
    total = setting.mass(setting.low, setting.high)
    reward = later = in_range = repeated = Fraction(0)
    for target in setting.numbers:
        if setting.weight(target) == 0:
            continue
        for leaf in games(policy, setting, target):
            p = leaf.probability * setting.weight(target) / total
            reward += p * leaf.won
            inside, n = in_range_counts(leaf.guesses, leaf.ranges)
            if n:
                repeats, _ = repeat_counts(leaf.guesses)
                later += p
                in_range += p * Fraction(inside, n)
                repeated += p * Fraction(repeats, n)
    return Sums(reward, later, in_range, repeated)


def evaluate(policy: Policy, setting: Setting) -> Figures:
    """The exact expected figures of ``policy`` over the targets' weights."""
    return sums(policy, setting).figures


def blind_sequences(setting: Setting) -> Iterator[tuple[int | None, ...]]:
    """Every fixed sequence of replies, a reply without a number (None) included."""
    return itertools.product((None, *setting.numbers), repeat=setting.max_turns)


def best_blind(setting: Setting) -> tuple[Fraction, list[tuple[int | None, ...]]]:
    """The best reward of a fixed sequence of guesses, and every sequence that has it.
    No feedback-blind player does better: a blind player, random or not, is a mixture of
    fixed sequences (its guesses depend on nothing but its own earlier guesses)."""
    best, sequences = Fraction(-1), []
    for sequence in blind_sequences(setting):
        # A fixed sequence wins exactly when the target is one of its numbers.
        numbers = {n for n in sequence if n is not None}
        reward = sum((setting.weight(n) for n in numbers), Fraction(0))
        if reward > best:
            best, sequences = reward, [sequence]
        elif reward == best:
            sequences.append(sequence)
    return best / setting.mass(setting.low, setting.high), sequences


@functools.cache
def _blind_points(setting: Setting) -> tuple[Sums, ...]:
    """The distinct sums of the fixed sequences."""
    return tuple({sums(blind(s), setting) for s in blind_sequences(setting)})


def blind_in_range_bound(setting: Setting, reward: Fraction) -> Fraction | None:
    """The highest ``feedback_in_range`` of any feedback-blind player (any mixture of
    fixed sequences) whose expected reward is at least ``reward``; None when no such
    player exists or none of them ever makes a later guess.

    A mixture's figure is sum(q * in_range) / sum(q * later), linear-fractional in its
    weights q, so its best under one linear constraint (the reward) lies at a vertex of
    what is allowed: one sequence, or two mixed so that the reward is exactly met."""
    points = _blind_points(setting)
    candidates = [a.in_range / a.later for a in points if a.reward >= reward and a.later]
    for a in points:
        for b in points:
            if a.reward < reward < b.reward:
                q = (reward - a.reward) / (b.reward - a.reward)  # b's weight, in (0, 1)
                later = q * b.later + (1 - q) * a.later
                if later:
                    candidates.append((q * b.in_range + (1 - q) * a.in_range) / later)
    return max(candidates, default=None)


# --------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class Row:
    policy: str
    weighting: str
    figures: Figures
    # The highest feedback_in_range of a feedback-blind player with at least this reward
    # (None: no blind player reaches it). A figure above it shows the feedback was read.
    blind_bound: Fraction | None


def baselines(setting: Setting, weighting: str) -> list[Row]:
    """The five players' figures under ``setting``."""
    _, sequences = best_blind(setting)
    blind_figures = {s: evaluate(blind(s), setting) for s in sequences}
    # Of the tied sequences, the one a learner's in-range figure must beat.
    sequence = max(sequences, key=lambda s: blind_figures[s].feedback_in_range or 0)
    shown = ",".join("-" if n is None else str(n) for n in sequence)
    rows = [
        ("uniform random", evaluate(uniform_random(setting), setting)),
        (f"best blind ({shown})", blind_figures[sequence]),
        ("consistent random", evaluate(consistent_random(setting), setting)),
        ("binary search", evaluate(binary_search(setting), setting)),
        ("optimal", evaluate(optimal(setting), setting)),
    ]
    return [
        Row(name, weighting, figures, blind_in_range_bound(setting, figures.reward))
        for name, figures in rows
    ]


def _cell(value: Fraction | None) -> str:
    if value is None:
        return "-"
    return f"{float(value):.4f} ({value.numerator}/{value.denominator})"


def table(rows: Sequence[Row]) -> str:
    """The rows as aligned text, each figure as a decimal and its exact fraction."""
    header = (
        "policy",
        "weighting",
        "reward",
        "feedback_in_range",
        "blind_bound",
        "repeated_guesses",
    )
    lines = [header] + [
        (
            r.policy,
            r.weighting,
            _cell(r.figures.reward),
            _cell(r.figures.feedback_in_range),
            _cell(r.blind_bound),
            _cell(r.figures.repeated_guesses),
        )
        for r in rows
    ]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )


def task_options(path: Path) -> dict[str, object]:
    """The ``options`` of a task yaml ({} when it has none)."""
    if not path.exists():
        return {}
    options = yaml.safe_load(path.read_text()).get("options", {})
    return dict(options) if isinstance(options, Mapping) else {}


def _weights_arg(text: str) -> list[float] | None:
    if text.strip().lower() in ("uniform", "null", "none"):
        return None
    return [float(w) for w in text.split(",")]


def main(
    argv: Sequence[str] | None = None,
    task_config: Path = TASK_CONFIG,
    prog: str = "python -m experiments.guess.baselines",
) -> None:
    """Print the table for the options of ``task_config`` (a task yaml playing this game)."""
    options = task_options(task_config)
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Exact reward and feedback_in_range of simple players of the game.",
    )
    parser.add_argument("--low", type=int, default=options.get("low", 1))
    parser.add_argument("--high", type=int, default=options.get("high", 8))
    parser.add_argument("--max-turns", type=int, default=options.get("max_turns", 3))
    parser.add_argument(
        "--weights",
        type=_weights_arg,
        default=options.get("target_weights"),
        help="comma-separated, one per number (default: the task's); 'uniform' for none",
    )
    args = parser.parse_args(argv)
    weightings = [("house", args.weights)] if args.weights is not None else []
    rows = [
        row
        for name, weights in [*weightings, ("uniform", None)]
        for row in baselines(Setting.of(args.low, args.high, args.max_turns, weights), name)
    ]
    print(
        f"guess {args.low}..{args.high} in {args.max_turns} turns; house weights "
        f"{args.weights}\n\n{table(rows)}\n\nblind_bound: the highest feedback_in_range "
        "of any feedback-blind player with at least that reward (-: none reaches it)"
    )


if __name__ == "__main__":
    main()
