"""The default CPU experiment: a multi-turn number-guessing game (see README.md)."""
