"""Invented countries and cities for the warm-up: names made of random syllables, so the
only way to write one into a query, or out of a result into an answer, is to copy it.

The tiny model remembers the few hundred real names it is warmed up on and writes them
from memory instead of copying: warmed on real facts alone, it searched for a held-out
country's name exactly 0 times in 100 while it copied answers out of the results every
time (README). Questions about invented places, asked and answered as the real ones, with
their own passages, teach the copy itself. None is a real place's name, and validation
never sees one.
"""

from __future__ import annotations

import functools
import random

from experiments.search.facts import City, Country, World, passages, world

ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "tr", "sh")
VOWELS = ("a", "e", "i", "o", "u", "ia", "ou")
CODAS = ("", "", "", "n", "r", "s", "l", "m")
CITIES_PER_COUNTRY = 4


def invented_name(rng: random.Random) -> str:
    syllables = [
        rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS)
        for _ in range(rng.randint(2, 3))
    ]
    return "".join(syllables).capitalize()


@functools.cache
def invented_world(countries: int = 1000, seed: int = 0) -> World:
    """``countries`` invented countries, each with a capital and ``CITIES_PER_COUNTRY``
    cities (the capital one of them); every name unique and no real one."""
    real = world()
    taken = {c.name.lower() for c in real.countries}
    taken |= {c.capital.lower() for c in real.countries} | {c.name.lower() for c in real.cities}
    continents = sorted({c.continent for c in real.countries})
    rng = random.Random(f"agl-search-invented:{seed}")

    def fresh() -> str:
        while True:
            name = invented_name(rng)
            if name.lower() not in taken:
                taken.add(name.lower())
                return name

    made: list[Country] = []
    cities: list[City] = []
    for i in range(countries):
        names = [fresh() for _ in range(CITIES_PER_COUNTRY)]
        country = Country(f"X{i}", fresh(), names[0], rng.choice(continents))
        made.append(country)
        cities += [City(name, country) for name in names]
    return World(tuple(made), tuple(cities))


def invented_passages(countries: int = 1000, seed: int = 0) -> list[dict[str, str]]:
    """The invented world's passages, ids apart from the real ones'."""
    return [
        {**row, "id": f"invented-{row['id']}"} for row in passages(invented_world(countries, seed))
    ]
