"""Tasks the coding pipeline makes from schema, made once per run for every test file that
needs some (tests/experiments/swe/: the pipeline's, the safeguards', the training run's).

``python -m experiments.swe.pipeline make --projects schema --per-project 8`` validates
each candidate bug by running schema's suite with it, which is most of what these tests
would otherwise each pay for. The folder is shared: a test copies what it changes (the
next stages write beside ``0-make/``) and never writes into it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from experiments.swe import mirror, pipeline
from experiments.swe.instances import Instance, read_instances
from experiments.swe.stages import INSTANCES
from tests.helpers.shared import built_once

PROJECT = "schema"
MAKE = ["make", "--projects", PROJECT, "--per-project", "8"]


def _make(out: Path) -> None:
    assert pipeline.main([*MAKE, "--out", str(out)]) == 0


def schema_made(factory: pytest.TempPathFactory) -> Path:
    """The pipeline's folder after ``make`` (``0-make/`` and ``mirror/``): read only."""
    return built_once(factory, "swe-schema-make", _make)


def copy_made(factory: pytest.TempPathFactory, dest: Path) -> Path:
    """The shared ``make`` output copied to ``dest`` (which must not exist), for a test
    that runs the next stages there or changes it."""
    shutil.copytree(schema_made(factory), dest)
    return dest


def first_with_branch(out: Path) -> Instance:
    """The first task ``make`` kept whose branch the mirror holds (a seeded share of the
    records is left without one, for the filter to find)."""
    held = mirror.branches(out / pipeline.MIRROR)
    made = read_instances([out / pipeline.MAKE / INSTANCES])
    found = [i for i in made if i.branch in held.get(i.repo, [])]
    assert found, made
    return found[0]


CPU_MAKE = ["make", "--projects", "toolz", "--cpu", "--per-project", "6"]


def _make_cpu(out: Path) -> None:
    assert pipeline.main([*CPU_MAKE, "--out", str(out)]) == 0


def toolz_cpu_made(factory: pytest.TempPathFactory) -> Path:
    """CPU-scale tasks (experiments/swe/cpu.py) made from toolz, once per run: read only."""
    return built_once(factory, "swe-toolz-cpu-make", _make_cpu)
