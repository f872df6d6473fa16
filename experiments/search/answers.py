"""Search-R1's rewards: exact match and token F1 of an answer against its gold answers,
after SQuAD's answer normalisation (lower case, no punctuation, no articles, single
spaces). Pure functions; the best gold answer counts."""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation, in its order: lower, punctuation, articles, whitespace."""
    text = text.lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, golds: Sequence[str]) -> float:
    """1.0 when the normalised prediction equals a normalised gold answer."""
    predicted = normalize_answer(prediction)
    return float(any(predicted == normalize_answer(gold) for gold in golds))


def _f1(prediction: str, gold: str) -> float:
    predicted, truth = normalize_answer(prediction).split(), normalize_answer(gold).split()
    common = sum((Counter(predicted) & Counter(truth)).values())
    if not common:
        return 0.0
    precision, recall = common / len(predicted), common / len(truth)
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str, golds: Sequence[str]) -> float:
    """The best token F1 of the normalised prediction against a gold answer."""
    return max((_f1(prediction, gold) for gold in golds), default=0.0)


REWARDS = {"em": exact_match, "f1": f1_score}


def reward_of(kind: str, prediction: str | None, golds: Sequence[str]) -> float:
    """``kind`` (``em`` or ``f1``) of ``prediction``; 0.0 without an answer."""
    if kind not in REWARDS:
        raise ValueError(f"reward {kind!r}: choose one of {sorted(REWARDS)}")
    return 0.0 if prediction is None else REWARDS[kind](prediction, golds)
