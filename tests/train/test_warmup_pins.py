"""Pinned warm-ups (agl/core/run/warmup_pins.py): made once, read back as made, refused
for another model, warm-up or options, read across a source change with a warning."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from agl.core.run.tasks import Task, TaskConfig
from agl.core.run.warmup_pins import WarmupPin

OPTIONS = {"seed": 3, "steps": 5, "weights": (1, 2)}
calls: list[dict[str, Any]] = []


def _warm(model: torch.nn.Module, tokenizer: Any, **options: Any) -> dict[str, float]:
    """A warm-up that moves every weight by a seed-dependent amount."""
    calls.append(options)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(options["seed"] + 0.5)
    return {"loss": 0.25}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


def _pin(folder: Path, **changes: Any) -> WarmupPin:
    options = {**OPTIONS, **changes.pop("options", {})}
    return WarmupPin.of(folder, changes.get("model", "tiny:0"), "w:warm", options)


def _make(model: torch.nn.Module, options: dict[str, Any] = OPTIONS) -> Any:
    return lambda: _warm(model, None, **options)


def test_a_missing_pin_is_made_and_then_read_back_as_made(tmp_path: Path) -> None:
    calls.clear()
    first = _model()
    assert _pin(tmp_path).load_or_make(first, _make(first), b"v1") == {"loss": 0.25}
    record = json.loads((tmp_path / "seed-3.json").read_text())
    assert record["model"] == "tiny:0" and record["options"]["weights"] == [1, 2]
    assert record["metrics"] == {"loss": 0.25} and not list(tmp_path.glob("*.partial"))
    second = _model()
    assert _pin(tmp_path).load_or_make(second, _make(second), b"v1") == {"pinned": 1.0}
    assert len(calls) == 1
    for a, b in zip(first.parameters(), second.parameters(), strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(second.weight, _model().weight)


@pytest.mark.parametrize(
    ("changes", "named"),
    [({"model": "smollm2:0"}, "model"), ({"options": {"steps": 6}}, "options")],
)
def test_a_pin_is_refused_for_another_model_or_other_options(
    tmp_path: Path, changes: dict[str, Any], named: str
) -> None:
    model = _model()
    _pin(tmp_path).load_or_make(model, _make(model), b"v1")
    with pytest.raises(ValueError, match=f"pinned for {named}"):
        _pin(tmp_path, **changes).load_or_make(model, _make(model), b"v1")


def test_a_pin_made_by_other_code_is_read_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = _model()
    _pin(tmp_path).load_or_make(model, _make(model), b"v1")
    with caplog.at_level(logging.WARNING, "agl.core.run.warmup_pins"):
        assert _pin(tmp_path).load_or_make(_model(), _make(model), b"v2") == {"pinned": 1.0}
    assert "source has changed" in caplog.text


def test_weights_without_their_record_are_refused(tmp_path: Path) -> None:
    model = _model()
    _pin(tmp_path).load_or_make(model, _make(model), b"v1")
    (tmp_path / "seed-3.json").unlink()
    with pytest.raises(ValueError, match=r"no seed-3\.json beside it"):
        _pin(tmp_path).load_or_make(model, _make(model), b"v1")


def test_a_seed_that_is_not_an_integer_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not an integer"):
        WarmupPin.of(tmp_path, "tiny:0", "w:warm", {"seed": "0"})


def test_a_task_reads_its_pins_from_a_folder_under_its_root(tmp_path: Path) -> None:
    calls.clear()
    config = TaskConfig(
        name="t",
        harness="tests.train.test_warmup_pins:_warm",
        train_inputs="tests.train.test_warmup_pins:_warm",
        val_inputs="tests.train.test_warmup_pins:_warm",
        warmup="tests.train.test_warmup_pins:_warm",
        warmup_pins="pins",
        warmup_options={"steps": 5},
    )
    task = Task(config, tmp_path, seed=1)
    # The cache is not used under pins: a pinned seed is read from the pin alone.
    cache = tmp_path / "cache"
    assert task.warm_up(_model(), None, cache_dir=cache, model_key="m") == {"loss": 0.25}
    assert task.warm_up(_model(), None, cache_dir=cache, model_key="m") == {"pinned": 1.0}
    assert calls == [{"steps": 5, "seed": 1}]
    assert (tmp_path / "pins" / "seed-1.pt").is_file() and not cache.exists()
