"""Run a study's (setting, seed) pairs, one ``python -m agl.train`` after the other.

Each run goes to ``OUT/<setting>/seed-<seed>/`` (its run folder: config, metrics, logs,
the gateway's store). A run that finished leaves ``study-run.json`` there with its
command and wall time, and a study started again skips it: a study can be stopped and
resumed, and extended by more seeds. A run that did not finish is started afresh (its
folder emptied first). Runs go one at a time: each one already uses every core.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from agl.study.spec import Study

log = logging.getLogger(__name__)

DONE_FILE = "study-run.json"


@dataclass(frozen=True)
class RunResult:
    setting: str
    seed: int
    folder: Path
    status: str  # done | skipped | failed
    seconds: float


def run_folder(out: Path, setting: str, seed: int) -> Path:
    return out / setting / f"seed-{seed}"


def train_command(
    study: Study, setting: str, seed: int, folder: Path, extra: Sequence[str]
) -> list[str]:
    """The ``python -m agl.train`` command line of one run: the study's overrides, the
    setting's, then ``extra`` (later ones win in Hydra), then what the study owns."""
    config = ["--config-name", study.config_name] if study.config_name else []
    return [
        sys.executable,
        "-m",
        "agl.train",
        *config,
        *study.overrides,
        *study.settings[setting],
        *extra,
        f"seed={seed}",
        f"hydra.run.dir={folder}",
        f"logging.wandb_group={study.name}",
        "logging.progress=false",
    ]


def is_done(folder: Path) -> bool:
    return (folder / DONE_FILE).is_file()


def run_study(
    study: Study,
    out: Path,
    extra: Sequence[str] = (),
    only: Sequence[str] | None = None,
    on_run: Callable[[int, int, RunResult], None] | None = None,
) -> list[RunResult]:
    """Run every (setting, seed) of ``study`` not yet done under ``out`` (``only``: these
    settings); answers each run's result in order. A failed run is reported and the
    study goes on (its log is ``train.log`` / ``stderr.log`` in its folder)."""
    pairs = [(s, seed) for s, seed in study.runs() if only is None or s in only]
    results = []
    for number, (setting, seed) in enumerate(pairs, start=1):
        folder = run_folder(out, setting, seed)
        if is_done(folder):
            result = RunResult(setting, seed, folder, "skipped", 0.0)
        else:
            result = _run_one(study, setting, seed, folder, extra)
        results.append(result)
        if on_run is not None:
            on_run(number, len(pairs), result)
    return results


def _run_one(
    study: Study, setting: str, seed: int, folder: Path, extra: Sequence[str]
) -> RunResult:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    command = train_command(study, setting, seed, folder, extra)
    started = time.monotonic()
    with (folder / "stderr.log").open("wb") as stderr:
        code = subprocess.call(command, stdout=subprocess.DEVNULL, stderr=stderr)
    seconds = time.monotonic() - started
    if code != 0:
        log.warning(
            "%s seed %d failed (exit %d): see %s", setting, seed, code, folder / "stderr.log"
        )
        return RunResult(setting, seed, folder, "failed", seconds)
    record = {"setting": setting, "seed": seed, "command": command[1:], "seconds": seconds}
    (folder / DONE_FILE).write_text(json.dumps(record, indent=1) + "\n")
    return RunResult(setting, seed, folder, "done", seconds)
