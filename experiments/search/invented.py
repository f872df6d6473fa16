"""Invented places for the warm-up: a fresh country or city for every question, named by
a character model of real names, so that the only way to write a name into a query, or
an answer out of a result, is to copy it.

The tiny model remembers any fixed set of names it is warmed up on and writes them from
memory instead of copying: warmed on real facts, it searched for a held-out country's
name exactly 0 times in 100; with 1,000 invented countries and 4,000 cities beside them,
3 times in 100 (README). A name drawn afresh for every question cannot be remembered, so
the gradient on it can only teach the copy.

The names come from an order-3 character Markov chain over the training side's real
names (countries, capitals and cities of the countries validation never asks about), so
they are spelled, and tokenized, like the real ones the model must copy later; none is a
real place's name (held-out ones included).
"""

from __future__ import annotations

import functools
import random
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from experiments.search.facts import (
    City,
    Country,
    World,
    kind_weights,
    passages,
    question,
    world,
)

ORDER = 3  # characters of context per draw
MIN_CHARS, MAX_CHARS = 3, 24  # as the real names kept (facts.world)
_START, _END = "\x02", "\x03"


@functools.cache
def _chain() -> tuple[dict[str, tuple[str, ...]], frozenset[str], tuple[str, ...]]:
    """The chain's successors per context, every real name (lowercased) and the real
    continents."""
    real = world()
    countries, cities = real.split(validation=False)
    names = [c.name for c in countries] + [c.capital for c in countries]
    names += [city.name for found in cities.values() for city in found]
    successors: dict[str, list[str]] = defaultdict(list)
    for name in names:
        padded = _START * ORDER + name + _END
        for i in range(ORDER, len(padded)):
            successors[padded[i - ORDER : i]].append(padded[i])
    taken = {c.name.lower() for c in real.countries} | {c.capital.lower() for c in real.countries}
    taken |= {c.name.lower() for c in real.cities}
    continents = tuple(sorted({c.continent for c in real.countries}))
    return {k: tuple(v) for k, v in successors.items()}, frozenset(taken), continents


def invented_name(rng: random.Random) -> str:
    """A new name, spelled like the real ones and none of them."""
    successors, taken, _ = _chain()
    while True:
        name = ""
        context = _START * ORDER
        while len(name) <= MAX_CHARS:
            char = rng.choice(successors[context])
            if char == _END:
                break
            name += char
            context = context[1:] + char
        if MIN_CHARS <= len(name) <= MAX_CHARS and name.lower() not in taken:
            return name


@dataclass(frozen=True)
class Invented:
    """A question about places invented for it."""

    question: dict[str, Any]
    country: Country
    city: City | None  # None for a question about the country alone

    def passages(self) -> dict[str, str]:
        """The places' passages (facts.passages' text: "X is a city in Y.") by the name
        each is found by."""
        rows = passages(World((self.country,), (self.city,) if self.city else ()))
        return {row["contents"].partition("\n")[0].strip('"'): row["contents"] for row in rows}


def invented_question(rng: random.Random, kinds: Mapping[str, float] | None) -> Invented:
    """A question of one of ``kinds`` (``facts.kind_weights``) about places invented for
    it."""
    names, weights = kind_weights(kinds)
    kind = rng.choices(names, weights)[0]
    *_, continents = _chain()
    country = Country("XX", invented_name(rng), invented_name(rng), rng.choice(continents))
    city = None if kind == "capital" else City(invented_name(rng), country)
    return Invented(question(kind, country, city), country, city)
