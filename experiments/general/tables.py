"""The general agent's files: GeoNames' countries and cities as two tab-separated tables,
far larger than the tiny model's context (24k cities, ~480 KB), so an agent must search
them with commands rather than read them.

- ``countries.tsv``: ``country<TAB>capital<TAB>continent``, one country a line;
- ``cities.tsv``: ``city<TAB>country``, one city a line.

Both have a header line. The questions are ``experiments.search.facts``' (a country's
capital, a city's country, the capital of a city's country), over the same split: the
held-out countries' rows are in the tables (an agent answers from them), but no training
question asks about them.

``grep_words`` is ``grep -Fw`` in Python, for the warm-up's scripted commands over
invented rows (``tests/experiments/test_general.py`` checks it against the real ``grep``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

from experiments.search.facts import City, Country, World, world

COUNTRIES, CITIES = "countries.tsv", "cities.tsv"
COUNTRIES_HEADER = "country\tcapital\tcontinent"
CITIES_HEADER = "city\tcountry"
_WORD = re.compile(r"\w", re.ASCII)  # grep's word constituents: letters, digits, _


def country_line(country: Country) -> str:
    return f"{country.name}\t{country.capital}\t{country.continent}"


def city_line(city: City) -> str:
    return f"{city.name}\t{city.country.name}"


def table_lines(places: World) -> dict[str, list[str]]:
    """Each table's lines, its header first."""
    return {
        COUNTRIES: [COUNTRIES_HEADER, *map(country_line, places.countries)],
        CITIES: [CITIES_HEADER, *map(city_line, places.cities)],
    }


def write_tables(folder: Path) -> dict[str, Path]:
    """The real tables in ``folder`` (once; read-only, mode 0444): name -> path."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, lines in table_lines(world()).items():
        path = folder / name
        if not path.exists():
            partial = folder / f".{name}.{os.getpid()}.partial"
            partial.write_text("\n".join(lines) + "\n", encoding="utf-8")
            os.chmod(partial, 0o444)
            partial.replace(path)
        paths[name] = path
    return paths


def _is_word_at(line: str, start: int, end: int) -> bool:
    before = start == 0 or not _WORD.match(line[start - 1])
    after = end == len(line) or not _WORD.match(line[end])
    return before and after


def grep_words(lines: Sequence[str], pattern: str) -> list[str]:
    """The lines ``grep -Fw pattern`` prints: ``pattern`` as a whole word (not inside a
    longer run of letters, digits and underscores) anywhere in the line."""
    found = []
    for line in lines:
        at = line.find(pattern)
        while at >= 0:
            if _is_word_at(line, at, at + len(pattern)):
                found.append(line)
                break
            at = line.find(pattern, at + 1)
    return found
