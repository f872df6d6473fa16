"""experiments/swe's data pipeline: SWE-smith's record format, the paper's filters over a
committed fixture in that format (each record says which filter must remove it), the
difficulty filter's and the split's invariants, and the stages' resumption."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agl.core.contracts.records import Event, Rollout, Status
from agl.core.datasets import DatasetError
from agl.rollouts.export import export_line
from experiments.swe import filters, mirror, pipeline, selection, stages, tally
from experiments.swe.instances import Instance, instance_of, read_instances
from tests.helpers import swe_tasks

FIXTURE = Path(__file__).parents[2] / "fixtures" / "swe"
RECORDS = FIXTURE / "swe-smith.jsonl"
BRANCHES = FIXTURE / "branches.json"


def _rows() -> list[dict]:
    return [json.loads(line) for line in RECORDS.read_text().splitlines()]


def _instance(i: int, **changes: object) -> Instance:
    row = {"instance_id": f"t{i}", "repo": "r", "FAIL_TO_PASS": ["a"], "PASS_TO_PASS": ["b"]}
    return instance_of({**row, **changes})


def test_the_fixture_exercises_every_filter_and_the_edges() -> None:
    expected = [row["fixture_expect"] for row in _rows()]
    for reason in ("kept", filters.EMPTY_STATEMENT, filters.MISSING_BRANCH, filters.TOO_MANY_TESTS):
        assert expected.count(reason) >= 3, reason
    counts = [
        len(i.tests) for i in read_instances([RECORDS]) if i.extra["fixture_expect"] == "kept"
    ]
    assert 200 in counts  # the limit itself is kept


def test_records_read_as_published_lists_or_json_strings_and_keep_their_other_columns() -> None:
    rows = _rows()
    as_strings = [r for r in rows if isinstance(r["FAIL_TO_PASS"], str)]
    assert as_strings, "the fixture has SWE-bench-style string lists"
    instances = read_instances([RECORDS])
    by_id = {i.instance_id: i for i in instances}
    for row in as_strings:
        assert list(by_id[row["instance_id"]].FAIL_TO_PASS) == json.loads(row["FAIL_TO_PASS"])
    first = instances[0]
    assert first.branch == first.instance_id
    assert first.record()["fixture_expect"] == rows[0]["fixture_expect"]
    assert isinstance(first.record()["FAIL_TO_PASS"], list)


def test_parquet_as_the_hub_serves_it_reads_the_same_instances(tmp_path: Path) -> None:
    rows = []
    for row in _rows():  # the hub's parquet: lists as lists, every record has every column
        row = dict(row)
        for key in ("FAIL_TO_PASS", "PASS_TO_PASS"):
            if isinstance(row[key], str):
                row[key] = json.loads(row[key])
        row.setdefault("problem_statement", None)
        rows.append(row)
    path = tmp_path / "train-00000-of-00001.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert read_instances([path]) == read_instances([RECORDS])


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"repo": "r", "FAIL_TO_PASS": [], "PASS_TO_PASS": []}, "missing instance_id"),
        (
            {"instance_id": "a", "repo": "r", "FAIL_TO_PASS": "not json", "PASS_TO_PASS": []},
            "JSON list",
        ),
        (
            {"instance_id": "a", "repo": "r", "FAIL_TO_PASS": [1], "PASS_TO_PASS": []},
            "list of test ids",
        ),
        (
            {"instance_id": "a", "repo": 3, "FAIL_TO_PASS": [], "PASS_TO_PASS": []},
            "repo must be a string",
        ),
    ],
)
def test_a_bad_record_is_named_with_what_is_wrong(row: dict, message: str) -> None:
    with pytest.raises(DatasetError, match=message):
        instance_of(row, "record 7")


def test_a_repeated_instance_id_is_refused(tmp_path: Path) -> None:
    line = RECORDS.read_text().splitlines()[0]
    path = tmp_path / "twice.jsonl"
    path.write_text(line + "\n" + line + "\n")
    with pytest.raises(DatasetError, match="appears twice"):
        read_instances([path])


def _run(*argv: object) -> int:
    return pipeline.main([str(a) for a in argv])


def test_each_filter_removes_exactly_the_records_it_should(tmp_path: Path, capsys) -> None:
    out = tmp_path / "pipe"
    assert _run("filter", "--instances", RECORDS, "--branches", BRANCHES, "--out", out) == 0
    report = json.loads((out / pipeline.FILTER / stages.REPORT).read_text())
    expected = {r["instance_id"]: r["fixture_expect"] for r in _rows()}
    got = {r["instance_id"]: r["reason"].split(":")[0] for r in report["removed_instances"]}
    assert got == {k: v for k, v in expected.items() if v != "kept"}
    kept = read_instances([out / pipeline.FILTER / stages.INSTANCES])
    assert [i.instance_id for i in kept] == [k for k, v in expected.items() if v == "kept"]
    assert report["read"] == len(expected) and report["kept"] == len(kept)
    assert sum(report["removed"].values()) == len(got)
    assert "removed" in capsys.readouterr().out


def test_a_finished_stage_is_skipped_and_a_changed_option_runs_it_again(tmp_path: Path) -> None:
    out = tmp_path / "pipe"
    args = ["filter", "--instances", RECORDS, "--branches", BRANCHES, "--out", out]
    assert _run(*args) == 0
    report = out / pipeline.FILTER / stages.REPORT
    first = report.read_text()
    report.write_text(first.replace('"stage"', '"untouched": true, "stage"'))
    assert _run(*args) == 0
    assert "untouched" in report.read_text()  # skipped: not written again
    assert _run(*args, "--max-tests", "1000") == 0
    again = json.loads(report.read_text())
    assert "untouched" not in again and again["options"]["max_tests"] == 1000
    assert again["removed"][filters.TOO_MANY_TESTS] == 1  # only the one of 1,230 tests


def test_a_stage_stopped_before_its_report_runs_again(tmp_path: Path) -> None:
    out = tmp_path / "pipe"
    args = ["filter", "--instances", RECORDS, "--branches", BRANCHES, "--out", out]
    assert _run(*args) == 0
    (out / pipeline.FILTER / stages.REPORT).unlink()
    (out / pipeline.FILTER / stages.INSTANCES).write_text("")  # half-written
    assert _run(*args) == 0
    assert len(read_instances([out / pipeline.FILTER / stages.INSTANCES])) == 18


def test_difficulty_then_split_from_tallies(tmp_path: Path) -> None:
    out = tmp_path / "pipe"
    assert _run("filter", "--instances", RECORDS, "--branches", BRANCHES, "--out", out) == 0
    kept = read_instances([out / pipeline.FILTER / stages.INSTANCES])
    tallies = {}
    for n, item in enumerate(kept):  # 6 always, 6 mixed, 6 never solved
        tallies[item.instance_id] = [[4, 2, 0][n % 3], 4]
    path = tmp_path / "tallies.json"
    path.write_text(json.dumps(tallies))
    assert _run("difficulty", "--tallies", path, "--never-solved", 2, "--out", out) == 0
    report = json.loads((out / pipeline.DIFFICULTY / stages.REPORT).read_text())
    assert report["details"] == {
        "mixed": 6,
        "always_solved": 6,
        "never_solved": 6,
        "never_solved_kept": 2,
    }
    assert report["kept"] == 8
    assert _run("split", "--test", 0.25, "--out", out) == 0
    train = read_instances([out / pipeline.SPLIT / "train.jsonl"])
    test = read_instances([out / pipeline.SPLIT / "test.jsonl"])
    assert (len(train), len(test)) == (6, 2)
    assert not {i.instance_id for i in train} & {i.instance_id for i in test}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["filter", "--instances", "missing.jsonl", "--branches", BRANCHES], "no such file"),
        (["filter", "--instances", RECORDS], "exactly one of --mirror and --branches"),
        (["split"], "run the filter stage first"),
        (["difficulty", "--tallies", RECORDS], "expected"),
    ],
)
def test_bad_input_is_one_line(tmp_path: Path, capsys, argv: list, message: str) -> None:
    assert _run(*argv, "--out", tmp_path / "pipe") == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


# -- the difficulty filter and the split as pure functions


@st.composite
def _tallied(draw):
    n = draw(st.integers(0, 30))
    k = draw(st.integers(1, 5))
    items = [_instance(i) for i in range(n)]
    tallies = {}
    for item in items:
        if draw(st.booleans()):  # some tasks were never rolled out
            rollouts = draw(st.integers(0, k + 1))
            tallies[item.instance_id] = selection.Tally(draw(st.integers(0, rollouts)), rollouts)
    return items, tallies, k


@settings(max_examples=60, deadline=None)
@given(_tallied(), st.integers(0, 10), st.integers(0, 3), st.randoms(use_true_random=False))
def test_the_difficulty_filter_keeps_the_mixed_and_a_seeded_sample_of_the_never_solved(
    case, never: int, seed: int, shuffler
) -> None:
    items, tallies, k = case
    kept, removed, counts = selection.by_difficulty(items, tallies, k, never, seed)
    kept_ids = {i.instance_id for i in kept}
    assert len(kept) + len(removed) == len(items)
    assert not kept_ids & {r.instance_id for r in removed}
    for item in items:
        t = tallies.get(item.instance_id)
        if t is None or t.rollouts < k:
            assert item.instance_id not in kept_ids
        elif 0 < t.solved < t.rollouts:
            assert item.instance_id in kept_ids
        elif t.solved == t.rollouts:
            assert item.instance_id not in kept_ids
    assert counts["never_solved_kept"] == min(never, counts["never_solved"])
    shuffled = list(items)
    shuffler.shuffle(shuffled)
    again, _, _ = selection.by_difficulty(shuffled, tallies, k, never, seed)
    assert {i.instance_id for i in again} == kept_ids


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 40), st.integers(0, 5), st.data())
def test_the_split_is_a_seeded_partition(n: int, seed: int, data) -> None:
    items = [_instance(i) for i in range(n)]
    test = data.draw(st.integers(0, n) | st.floats(0, 0.99))
    train, held = selection.split(items, test, seed)
    assert sorted(i.instance_id for i in train + held) == sorted(i.instance_id for i in items)
    assert len(held) == (round(test * n) if test < 1 else test)
    assert selection.split(list(reversed(items)), test, seed)[1] == list(reversed(held))


def test_the_filters_name_their_reasons() -> None:
    item = _instance(1, problem_statement="x", FAIL_TO_PASS=["a", "b"], PASS_TO_PASS=["b"])
    assert filters.too_many_tests(2)(item) is None  # a test listed twice counts once
    assert filters.too_many_tests(1)(item) == "too many tests: 2 > 1"
    assert filters.missing_branch({"r": ["t1"]})(item) is None
    assert filters.missing_branch({"other": ["t1"]})(item).startswith(filters.MISSING_BRANCH)
    assert filters.empty_statement(_instance(2)) == filters.EMPTY_STATEMENT
    with pytest.raises(ValueError):
        filters.too_many_tests(0)


# -- tasks made from a real project (schema: 118 tests in ~0.4 s), then the filters


@pytest.mark.slow
def test_make_builds_validated_tasks_from_a_real_project_and_the_filters_run_over_them(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # ``make`` ran once for every test file that needs schema's tasks (swe_tasks.MAKE:
    # these arguments); its output copied here, where the next stages write
    out = swe_tasks.copy_made(tmp_path_factory, tmp_path / "pipe")
    make = [*swe_tasks.MAKE, "--out", out]
    report = json.loads((out / pipeline.MAKE / stages.REPORT).read_text())
    details = report["details"]["schema.0.7.8"]
    assert details["tests"] == details["passing_on_base"] > 100
    assert report["kept"] + sum(report["removed"].values()) == details["candidates"] == 8
    made = read_instances([out / pipeline.MAKE / stages.INSTANCES])
    assert made, report
    root = out / pipeline.MIRROR
    held = mirror.branches(root)["schema.0.7.8"]
    for item in made:
        assert item.FAIL_TO_PASS and item.PASS_TO_PASS
        assert not set(item.FAIL_TO_PASS) & set(item.PASS_TO_PASS)
        assert item.instance_id.startswith("schema.0.7.8.") and item.patch.startswith("diff --git")
        assert item.problem_statement == "" or item.FAIL_TO_PASS[0] in item.problem_statement
        if item.branch in held:  # the bug is on its branch: the checkout has the patch in it
            work = tmp_path / "work" / item.instance_id
            mirror.checkout(root, item.repo, item.branch, work)
            mirror.apply_diff(work, item.patch, reverse=True)  # the gold fix applies
    report_text = (out / pipeline.MAKE / stages.REPORT).read_text()
    assert _run(*make) == 0  # finished: skipped
    assert (out / pipeline.MAKE / stages.REPORT).read_text() == report_text
    assert _run("filter", "--out", out) == 0  # over make's records and mirror
    filtered = json.loads((out / pipeline.FILTER / stages.REPORT).read_text())
    # make leaves a share without a statement and a share without a branch: exactly those go
    empty = {i.instance_id for i in made if not i.problem_statement.strip()}
    missing = {i.instance_id for i in made if i.branch not in held} - empty
    assert filtered["kept"] == len(made) - len(empty) - len(missing)
    assert filtered["removed"].get(filters.EMPTY_STATEMENT, 0) == len(empty)
    assert filtered["removed"].get(filters.MISSING_BRANCH, 0) == len(missing)


def test_make_refuses_an_unknown_project(tmp_path: Path, capsys) -> None:
    assert _run("make", "--projects", "nope", "--out", tmp_path) == 2
    assert "no project nope; known: isodate" in capsys.readouterr().err


def _exported(rid: str, instance: str, rewards: list[float], attempt: int = 1) -> str:
    rollout = Rollout(
        rollout_id=rid,
        group_id="g",
        input={"instance_id": instance},
        mode="train",
        metadata={},
        max_attempts=2,
        timeout_s=None,
        status=Status.SUCCEEDED,
        attempt=attempt,
        version=1,
        created_at=0.0,
        updated_at=0.0,
    )
    events = [
        Event(
            rollout_id=rid,
            attempt=a,
            event_id=f"{rid}-{a}",
            sequence=a,
            type="reward",
            data={"value": r},
            time=0.0,
        )
        for a, r in enumerate(rewards, 1)
    ]
    return export_line(rollout, events)


def test_tallies_count_each_tasks_rewarded_rollouts_from_an_export(tmp_path: Path) -> None:
    lines = [
        _exported("a1", "task-a", [1.0]),
        _exported("a2", "task-a", [0.0]),
        _exported("a3", "task-a", []),  # no reward: not a result
        _exported("b1", "task-b", [1.0, 0.0], attempt=2),  # the current attempt counts
        _exported("b2", "task-b", [1.0]),
    ]
    path = tmp_path / "rollouts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert tally.tallies(path.read_text().splitlines()) == {"task-a": [1, 2], "task-b": [1, 2]}
    (tmp_path / "bad.jsonl").write_text('{"rollout": {}}\n')
    assert tally.main([str(tmp_path / "bad.jsonl")]) == 2
