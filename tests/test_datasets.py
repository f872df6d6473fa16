"""agl.core.run.datasets and the dataset form of a task: rows read from jsonl / json /
parquet, mapped by ``task.columns``, an epoch a permutation, one line naming a bad file."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

from agl.core.run.datasets import DatasetError, DatasetStream, map_columns, read_rows
from agl.core.run.tasks import Task, TaskConfig
from tests.train_runs import ROOT

ROWS = [{"q": f"q{i}", "meta": {"answer": i}} for i in range(5)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@given(
    size=st.integers(1, 30),
    n=st.integers(1, 12),
    steps=st.integers(1, 8),
    seed=st.integers(0, 3),
    shuffle=st.booleans(),
)
def test_every_epoch_is_a_permutation_and_a_step_depends_on_step_and_n_only(
    size: int, n: int, steps: int, seed: int, shuffle: bool
) -> None:
    rows = [{"i": i} for i in range(size)]
    stream = DatasetStream(rows, seed, shuffle)
    seen = [r["i"] for step in range(steps) for r in stream.batch(step, n)]
    assert len(seen) == steps * n
    for epoch in range(len(seen) // size):  # each full epoch: every row exactly once
        assert sorted(seen[epoch * size : (epoch + 1) * size]) == list(range(size))
    again = DatasetStream(rows, seed, shuffle)  # a resumed run: the same rows for a step
    assert [r["i"] for r in again.batch(steps - 1, n)] == seen[(steps - 1) * n :]
    if not shuffle:
        assert seen == [i % size for i in range(steps * n)]


def test_epochs_have_their_own_orders_and_a_seed_changes_them() -> None:
    rows = [{"i": i} for i in range(50)]
    first, second = ([r["i"] for r in DatasetStream(rows, 0).batch(e, 50)] for e in (0, 1))
    assert first != second and sorted(first) == sorted(second)
    assert [r["i"] for r in DatasetStream(rows, 1).batch(0, 50)] != first
    # The rows handed out are copies: a harness input changed in place changes no row.
    DatasetStream(rows, 0).batch(0, 1)[0]["i"] = -1
    assert min(r["i"] for r in rows) == 0


def test_a_fixed_subset_is_the_start_of_epoch_0() -> None:
    stream = DatasetStream([{"i": i} for i in range(10)], seed=3)
    assert stream.first(4) == stream.batch(0, 4)
    assert sorted(r["i"] for r in stream.first(99)) == list(range(10))


def test_jsonl_json_and_parquet_read_the_same_rows_in_file_order(tmp_path: Path) -> None:
    jsonl = write_jsonl(tmp_path / "a.jsonl", ROWS[:2])
    array = tmp_path / "b.json"
    array.write_text(json.dumps(ROWS[2:4]))
    parquet = tmp_path / "c.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS[4:]), parquet)
    assert read_rows([jsonl, array, parquet]) == ROWS


def test_columns_map_rows_to_inputs_and_read_into_nested_objects() -> None:
    mapped = map_columns(ROWS, {"prompt": "q", "answer": "meta.answer"}, "f.jsonl")
    assert mapped[3] == {"prompt": "q3", "answer": 3}
    assert map_columns(ROWS, {}, "f.jsonl") == ROWS


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("missing.jsonl", None, "missing.jsonl: no such file"),
        ("empty.jsonl", "\n\n", "empty.jsonl: the file has no rows"),
        ("bad.jsonl", '{"a": 1}\n{"a": \n', "bad.jsonl:2: not JSON"),
        ("list.jsonl", "[1, 2]\n", "list.jsonl: line 1 is not a JSON object"),
        ("dict.json", '{"a": 1}', "dict.json: a .json dataset is an array of objects"),
        ("rows.csv", "a,b\n", "rows.csv: unknown format '.csv'"),
        ("broken.parquet", "not parquet", "broken.parquet: not a readable parquet file"),
    ],
)
def test_a_bad_file_is_one_line_naming_it(
    tmp_path: Path, name: str, content: str | None, message: str
) -> None:
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(DatasetError) as info:
        read_rows([path])
    assert str(info.value).startswith(f"{tmp_path}/{message}")
    assert "\n" not in str(info.value)


def test_a_missing_column_names_the_file_the_row_and_the_key() -> None:
    with pytest.raises(DatasetError, match=r"f\.jsonl: row 0 has no column 'meta\.score' "):
        map_columns(ROWS, {"answer": "meta.score"}, "f.jsonl")


def dataset_task(tmp_path: Path, **fields: object) -> Task:
    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    config = TaskConfig(
        name="dataset",
        harness="experiments.qa.harness:run",
        train_files=str(train),
        columns={"prompt": "q", "answer": "meta.answer"},
        sampling={"max_tokens": 8},
        options={"max_turns": 2},
        **fields,  # type: ignore[arg-type]
    )
    return Task(config, ROOT, seed=0)


def test_a_dataset_task_feeds_mapped_rows_with_its_sampling_and_options(tmp_path: Path) -> None:
    task = dataset_task(tmp_path)
    inputs = task.train_inputs(0, 7)  # more than an epoch
    assert Counter(x["prompt"] for x in inputs[:5]) == Counter(r["q"] for r in ROWS)
    assert all(x["max_tokens"] == 8 and x["max_turns"] == 2 for x in inputs)
    assert set(inputs[0]) == {"prompt", "answer", "max_tokens", "max_turns"}
    # Without val_files, validation reads a fixed subset of the train files.
    assert task.val_inputs(3) == task.val_inputs(3) and len(task.val_inputs(99)) == 5


def test_epochs_bound_the_steps_a_run_may_take(tmp_path: Path) -> None:
    task = dataset_task(tmp_path, epochs=2)
    task.check_length(steps=5, per_step=2)  # 10 of 2 * 5 rows
    with pytest.raises(ValueError, match=r"task.epochs=2: 5 train rows give 5 steps"):
        task.check_length(steps=6, per_step=2)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, "give the data as train_inputs .* or as train_files"),
        ({"train_inputs": "m:f", "train_files": "x.jsonl"}, "one of the two"),
        ({"train_inputs": "m:f"}, "train_inputs needs val_inputs too"),
        ({"train_inputs": "m:f", "val_inputs": "m:g", "val_files": "v.jsonl"}, "need train_files"),
        ({"train_files": "x.jsonl", "epochs": 0}, "task.epochs=0"),
    ],
)
def test_a_task_names_its_data_one_way(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TaskConfig(name="t", harness="m:run", **fields)


def test_rows_that_are_not_json_data_are_refused_naming_the_file(tmp_path: Path) -> None:
    import datetime

    path = tmp_path / "dated.parquet"
    pq.write_table(pa.Table.from_pylist([{"q": "a", "when": datetime.date(2026, 1, 1)}]), path)
    with pytest.raises(DatasetError, match=r"dated\.parquet: row 0 is not JSON data"):
        read_rows([path])


def test_inputs_are_deep_copies_of_the_rows() -> None:
    rows = [{"prompt": [{"role": "user", "content": "hi"}]}]
    DatasetStream(rows, 0).batch(0, 1)[0]["prompt"][0]["content"] = "changed"
    assert rows[0]["prompt"][0]["content"] == "hi"


def test_the_qa_harness_scores_numbers_numeric_strings_and_strings() -> None:
    from experiments.qa.harness import is_correct, messages_of

    assert is_correct("3 + 4 = 7", 7) and not is_correct("7 or 8", 7)
    assert is_correct("The answer is 72.", "72")  # verl keeps ground truths as strings
    assert is_correct("  Paris ", "paris") and not is_correct("It is Paris", "Paris")
    assert messages_of("hi", "be brief") == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]
    with pytest.raises(ValueError, match="a string or a list of chat messages"):
        messages_of(3, None)
