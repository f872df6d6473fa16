"""``python -m experiments.agentic.baselines``: the game's exact baselines for the options
of ``conf/task/agentic.yaml``.

The agentic harness plays ``experiments.guess``'s game, so ``experiments.guess.baselines``
computes its figures: what no feedback-blind player can beat, what the warm-up's random
player scores, and the optimum. The mechanisms change how the model is asked, never
which guesses win: a subagent's wrong answer can only lower what a player reaches.
"""

from __future__ import annotations

from pathlib import Path

from experiments.guess.baselines import main as guess_main

TASK_CONFIG = Path(__file__).resolve().parents[2] / "conf" / "task" / "agentic.yaml"


def main(argv: list[str] | None = None) -> None:
    guess_main(argv, TASK_CONFIG, "python -m experiments.agentic.baselines")


if __name__ == "__main__":
    main()
