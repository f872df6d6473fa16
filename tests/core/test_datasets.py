"""agl.core.datasets and the dataset form of a task: rows read from jsonl / json /
parquet, mapped by ``task.columns``, an epoch a permutation, one line naming a bad file;
hostile files (deep, expanding, too many rows, too long) refused before the run starts."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agl.core.datasets import (
    DatasetError,
    DatasetLimits,
    DatasetStream,
    map_columns,
    read_rows,
)
from agl.core.run.tasks import Task, TaskConfig
from tests.helpers.train_runs import ROOT

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
        ("comma.json", '[{"a": 1} {"a": 2}]', "comma.json: not JSON (',' or ']' expected"),
        ("open.json", '[{"a": 1},', "open.json: item 1: not JSON (Expecting value"),
        ("tail.json", '[{"a": 1}] []', "tail.json: not JSON (extra data after the array)"),
        ("nan.jsonl", '{"a": NaN}\n', "nan.jsonl: line 1: NaN and infinite numbers are not JSON"),
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


# ---------------------------------------------------------------- hostile files (issue 43, M8)
# Each file below goes through the loader as agl.train calls it (a Task over a TaskConfig,
# built before the run starts); a bad one is refused there, in one line naming it and the
# row to blame.


def load(train: Path | list[Path], **fields: object) -> Task:
    files = [str(p) for p in train] if isinstance(train, list) else str(train)
    config = TaskConfig(
        name="dataset",
        harness="experiments.qa.harness:run",
        train_files=files,
        **fields,  # type: ignore[arg-type]
    )
    return Task(config, ROOT, seed=0)


def refusal(train: Path | list[Path], **fields: object) -> str:
    """The one line that refuses ``train`` (its last file, when several, is to blame)."""
    with pytest.raises(DatasetError) as info:
        load(train, **fields)
    message = str(info.value)
    blamed = train[-1] if isinstance(train, list) else train
    assert message.startswith(f"{blamed}: ") and "\n" not in message
    return message


def nested(depth: int, kind: str = "list") -> object:
    value: object = 1
    for _ in range(depth):
        value = [value] if kind == "list" else {"a": value}
    return value


def deep_text(lists: int) -> str:
    """A row: an object, and ``lists`` lists nested in it."""
    return '{"q": ' + "[" * lists + "]" * lists + "}"


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [  # json recurses once a level: a RecursionError traceback, past a thousand or so
        ("deep.jsonl", '{"q": 1}\n' + deep_text(100_000), "line 2: JSON nested deeper than 64"),
        ("deep.json", f'[{{"q": 1}}, {deep_text(100_000)}]', "item 1: JSON nested deeper than 64"),
        # Parsed, then refused mid-run, when submitted: a pydantic error naming no file.
        ("65.jsonl", deep_text(64), "line 1: JSON nested deeper than 64 levels (at q.0.0."),
        ("65.json", f"[{deep_text(64)}]", "item 0: JSON nested deeper than 64 levels (at q.0."),
    ],
)
def test_deep_json_rows_are_refused_naming_the_row(
    tmp_path: Path, name: str, content: str, message: str
) -> None:
    path = tmp_path / name
    path.write_text(content)
    assert message in refusal(path)


def test_deep_parquet_rows_are_refused_naming_the_row(tmp_path: Path) -> None:
    path = tmp_path / "deep.parquet"  # structs: pyarrow refuses a schema past 100 levels
    pq.write_table(pa.Table.from_pylist([{"q": nested(70, "struct")}]), path)
    assert "row 0: JSON nested deeper than 64 levels (at q.a.a." in refusal(path)


def test_a_row_as_deep_as_the_gateway_stores_is_read_and_submitted(tmp_path: Path) -> None:
    from agl.core.contracts.records import RolloutSpec

    path = tmp_path / "64.jsonl"
    path.write_text(deep_text(63) + "\n")
    (data,) = load(path).train_inputs(0, 1)
    spec = RolloutSpec(rollout_id="r", input=data)  # as the trainer submits it
    assert spec.input == json.loads(deep_text(63))


def test_a_line_separator_inside_a_string_is_text(tmp_path: Path) -> None:
    row = {"q": "one\u2028two\u2029three\x85four", "meta": {"answer": 1}}
    path = tmp_path / "separators.jsonl"
    path.write_text(json.dumps(row, ensure_ascii=False) + "\r\n" + json.dumps(row) + "\n")
    assert read_rows([path]) == [row, row]
    assert load(path, shuffle=False).train_inputs(0, 1)[0]["q"] == row["q"]


SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(st.characters(exclude_categories=("Cs",)) | st.sampled_from("\u2028\u2029\x85\n"))
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=12,
)


@pytest.mark.slow
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(st.dictionaries(st.text(max_size=6), VALUES), min_size=1, max_size=4))
def test_rows_that_are_fine_read_as_they_were_written(tmp_path: Path, rows: list[dict]) -> None:
    lines = tmp_path / "rows.jsonl"
    lines.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    array = tmp_path / "rows.json"
    array.write_text(json.dumps(rows, ensure_ascii=False, indent=1))
    assert read_rows([lines]) == rows
    assert read_rows([array]) == rows


def refusal_and_peak(path: Path) -> tuple[str | None, int]:
    """What loading ``path`` raised (None: nothing), and the peak memory of the process
    that loaded it, a fresh one: only this load counts. The high-water mark of its own
    memory (``VmHWM``): ``ru_maxrss`` carries over the forking parent's across exec."""
    script = (
        "import json, re, sys\n"
        "from pathlib import Path\n"
        "from agl.core.datasets import DatasetError\n"
        "from agl.core.run.tasks import Task, TaskConfig\n"
        "config = TaskConfig(name='t', harness='m:run', train_files=sys.argv[1])\n"
        "try:\n"
        "    Task(config, Path.cwd())\n"
        "    message = None\n"
        "except DatasetError as error:\n"
        "    message = str(error)\n"
        "status = open('/proc/self/status').read()\n"
        "peak = int(re.search(r'VmHWM:\\s+(\\d+) kB', status).group(1))\n"
        "print(json.dumps([message, peak]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(path)], capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    message, peak_kib = json.loads(done.stdout)
    return message, peak_kib * 1024


def bomb(path: Path, rows: int, text: str) -> Path:
    """``rows`` rows of ``text``, stored once; read as usual, each row a copy."""
    strings = pa.DictionaryArray.from_arrays(pa.array([0] * rows, pa.int32()), pa.array([text]))
    pq.write_table(pa.table({"q": strings}), path, compression="zstd", store_schema=False)
    return path


def test_a_parquet_bomb_is_refused_before_it_is_expanded(tmp_path: Path) -> None:
    path = bomb(tmp_path / "bomb.parquet", 4096, "x" * (1 << 18))  # 1 GiB decoded
    assert path.stat().st_size < 16 << 10
    message, peak = refusal_and_peak(path)
    assert message == (
        f"{path}: the rows up to row 2047 decode to 536887296 bytes, "
        "more than task.dataset_limits.max_file_bytes=536870912"
    )
    assert peak < 512 << 20  # not even the rows up to the one it was refused at were decoded


def list_of_references(count: int, text: str) -> pa.Array:
    """One row: a list of ``count`` references to ``text``, stored once."""
    indices = pa.array([0] * count, pa.int32())
    return pa.ListArray.from_arrays([0, count], pa.DictionaryArray.from_arrays(indices, [text]))


@pytest.mark.parametrize(
    ("column", "limits", "message"),
    [
        (  # 1 GB in one row
            list_of_references(1_000_000, "y" * 1024),
            {},
            "row 0 decodes to 1032000008 bytes, more than task.dataset_limits.max_row_bytes=",
        ),
        (  # nulls in a few bytes: refused from the footer, before any row group is read
            pa.array([[None] * 2_000_000], pa.list_(pa.int64())),
            {"max_file_bytes": 8 << 20},
            "its footer says it holds 16000000 bytes decoded, "
            "more than task.dataset_limits.max_file_bytes=8388608",
        ),
    ],
)
def test_parquet_values_that_expand_are_refused_from_their_compact_form(
    tmp_path: Path, column: pa.Array, limits: dict, message: str
) -> None:
    path = tmp_path / "expands.parquet"
    pq.write_table(pa.table({"q": column}), path, compression="zstd")
    assert path.stat().st_size < 64 << 10
    assert message in refusal(path, dataset_limits=limits)


def test_rows_past_the_row_limit_are_refused_where_they_pass_it(tmp_path: Path) -> None:
    first = tmp_path / "a.jsonl"
    first.write_text("{}\n" * 600)
    second = tmp_path / "b.jsonl"  # the files together; reading stops at the limit
    second.write_text("{}\n" * 401 + "not json\n")
    assert refusal([first, second], dataset_limits={"max_rows": 1000}) == (
        f"{second}: line 401: more rows than task.dataset_limits.max_rows=1000"
    )
    rows = tmp_path / "rows.parquet"  # from the footer, before the rows are read
    pq.write_table(pa.table({"q": pa.nulls(DatasetLimits().max_rows + 1)}), rows)
    assert (
        refusal(rows) == f"{rows}: row 1000000: more rows than task.dataset_limits.max_rows=1000000"
    )


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        (
            "long.jsonl",
            '{"q": 1}\n{"q": "%s"}\n',
            "line 2 is longer than task.dataset_limits.max_row_bytes=64",
        ),
        (
            "long.json",
            '[{"q": 1}, {"q": "%s"}]',
            "item 1 is longer than task.dataset_limits.max_row_bytes=64",
        ),
        (
            "big.jsonl",
            '{"q": "%s"}\n' * 4,
            " bytes, more than task.dataset_limits.max_file_bytes=256",
        ),
    ],
)
def test_a_file_or_a_row_past_its_size_is_refused(
    tmp_path: Path, name: str, content: str, message: str
) -> None:
    path = tmp_path / name
    path.write_text(content.replace("%s", "z" * 60))
    limits = {"max_row_bytes": 64, "max_file_bytes": 256}
    assert message in refusal(path, dataset_limits=limits)
    assert load(path).train_rows == content.count('"q"')  # within the defaults


def test_a_parquet_row_is_named_across_row_groups(tmp_path: Path) -> None:
    path = tmp_path / "groups.parquet"
    pq.write_table(pa.table({"q": ["a", "b", "c", "z" * 100, "e"]}), path, row_group_size=2)
    assert refusal(path, dataset_limits={"max_row_bytes": 64}) == (
        f"{path}: row 3 decodes to 108 bytes, more than task.dataset_limits.max_row_bytes=64"
    )


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        ({"max_depth": 9}, "task.dataset_limits has no max_depth (it has max_file_bytes, "),
        ({"max_rows": 0}, "task.dataset_limits.max_rows=0: a positive whole number"),
    ],
)
def test_dataset_limits_are_named_and_positive(tmp_path: Path, limits: dict, message: str) -> None:
    path = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    with pytest.raises(ValueError, match=re.escape(message)):
        load(path, dataset_limits=limits)
    assert load(path, dataset_limits={"max_rows": 5}).train_rows == 5


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "overrides", "message"),
    [
        ("deep.jsonl", [], "line 2: JSON nested deeper than 64 levels"),
        (  # a limit is set on the command line
            "bomb.parquet",
            ["+task.dataset_limits.max_file_bytes=1000000"],
            "the rows up to row 3 decode to 1048608 bytes, "
            "more than task.dataset_limits.max_file_bytes=1000000",
        ),
    ],
)
def test_the_cli_refuses_a_bad_file_in_one_line(
    tmp_path: Path, name: str, overrides: list[str], message: str
) -> None:
    path = tmp_path / name
    if name.endswith(".parquet"):
        bomb(path, 64, "x" * (1 << 18))
    else:
        path.write_text('{"q": 1}\n' + deep_text(100_000) + "\n")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "agl.train",
            "task=dataset",
            f"task.train_files={path}",
            *overrides,
            "logging.wandb=false",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip() == f"agl.train: {path}: {message}"
