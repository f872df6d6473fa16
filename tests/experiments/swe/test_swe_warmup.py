"""The coding agent's CPU-scale warm-up (experiments/swe/warmup.py, invented.py): invented
tasks whose simulated shell prints what the real one does, episodes played by
mini-swe-agent itself, and a short warm-up of the tiny model."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.agentic.warmup import prompt_ids
from experiments.guess.warmup import DropoutBPE
from experiments.search.warmup import episode_rows
from experiments.swe import cpu, invented, warmup

MODULES = ("textwrap", "shlex", "fnmatch", "posixpath", "heapq", "bisect", "calendar")


@pytest.fixture(scope="module")
def functions() -> tuple[invented.Pooled, ...]:
    return invented.pool(MODULES)


@pytest.fixture(scope="module")
def words() -> tuple[str, ...]:
    return invented.vocabulary(MODULES)


def _written(task: invented.InventedTask, root: Path) -> Path:
    for path, text in task.files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return root


def _bash(command: str, cwd: Path) -> tuple[int, str]:
    path = f"{Path(sys.executable).parent}:/usr/bin:/bin"
    done = subprocess.run(
        ["bash", "-c", command],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={"PATH": path, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    return done.returncode, done.stdout


def test_the_simulated_shell_prints_what_bash_grep_sed_and_pytest_do(
    functions: tuple[invented.Pooled, ...], words: tuple[str, ...], tmp_path: Path
) -> None:
    rng = random.Random(7)
    checked = 0
    while checked < 6:
        task = invented.invented_task(rng, functions, words)
        if not warmup.playable(task):
            continue
        for tested in (True, False):
            real = _written(task, tmp_path / f"{checked}-{tested}")
            shell = warmup.SimulatedShell(task)
            for command in warmup.plan(task, tested):
                assert shell.run(command) == _bash(command, real), command
                assert shell.files[task.module] == (real / task.module).read_text()
        checked += 1


def test_a_task_is_fresh_and_its_fix_is_among_the_first_tries(
    functions: tuple[invented.Pooled, ...], words: tuple[str, ...]
) -> None:
    rng = random.Random(3)
    tasks = [invented.invented_task(rng, functions, words) for _ in range(200)]
    assert len({t.function for t in tasks}) >= 190  # no name to remember
    assert len({(t.module, t.fix.function) for t in tasks}) >= 190
    for task in tasks:
        assert cpu.MIN_SHOWN <= len(task.shown) <= cpu.MAX_SHOWN
        assert cpu.one_edit_a_site(task.function, task.shown)  # line n is try n
        assert task.fix in cpu.tries(task.function, task.shown)[: cpu.MAX_TRIES]
        assert cpu.apply(task.fix, task.files[task.module]) == task.base
        assert task.statement.startswith("Since the last change to ")
        assert f"`{task.test}" in task.statement  # first, with its parameters if any
    # as real statements do, some list a test whose name runs on past the function's
    extended = [t for t in tasks if f"::test_{t.function}_" in t.statement]
    assert len(extended) >= 20


def test_episodes_are_mini_swe_agents_calls_one_row_each(
    functions: tuple[invented.Pooled, ...], words: tuple[str, ...]
) -> None:
    from agl.backends.inference.models import load_model

    tokenizer = load_model("tiny").tokenizer
    rng = random.Random(5)
    segment = DropoutBPE(tokenizer, 0.0, rng)
    for tested in (True, False, True, False):
        task = invented.invented_task(rng, functions, words)
        while not warmup.playable(task):
            task = invented.invented_task(rng, functions, words)
        commands = warmup.plan(task, tested)
        calls = warmup.episode_calls(task, commands)
        assert [reply for _, reply in calls] == [warmup.fenced(c) for c in commands]
        messages = calls[-1][0]
        assert messages[1]["content"].strip() == task.statement.strip()
        assert sum(m["role"] == "assistant" for m in messages) == len(commands) - 1
        ids = [(prompt_ids(tokenizer, m), reply) for m, reply in calls]
        rows = episode_rows(tokenizer, ids, segment, "all")
        assert len(rows) == 1  # each call extends the last: one sample an episode
        assert len(rows[0][0]) < 2048


def test_two_warm_up_steps_train_the_tiny_model(
    functions: tuple[invented.Pooled, ...], words: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from agl.backends.inference.models import load_model

    loaded = load_model("tiny")
    before = [p.detach().clone() for p in loaded.model.parameters()]
    monkeypatch.setattr(warmup, "pool", lambda: functions)
    monkeypatch.setattr(warmup, "vocabulary", lambda: words)
    metrics = warmup.warm_up(
        loaded.model, loaded.tokenizer, steps=2, tasks_per_step=2, copy_questions_per_step=2
    )
    assert metrics["steps"] == 2.0 and metrics["loss"] > 0
    after = list(loaded.model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_the_probe_rewards_a_fix_and_only_a_fix(
    functions: tuple[invented.Pooled, ...], words: tuple[str, ...]
) -> None:
    from experiments.swe import probe

    def replying(commands: list[str]) -> warmup.Reply:
        script = iter([*commands, "ls"])  # past the plan: a command it does not simulate
        return lambda messages: warmup.fenced(next(script))

    rng = random.Random(11)
    seen = {"fixed untested": 0, "missed untested": 0}
    while min(seen.values()) < 2:
        task = invented.invented_task(rng, functions, words)
        if not warmup.playable(task):
            continue
        tested = probe.episode(task, replying(warmup.plan(task, tested=True)))
        assert (tested["reward"], tested["tested"], tested["submitted"]) == (1.0, True, True)
        tries = len(warmup.plan(task, tested=True)) - 1
        assert tested["edits"] == tested["tries"] == tries
        assert all(tested[f"{part} right"] == tries for part in probe.PARTS)
        untested = probe.episode(task, replying(warmup.plan(task, tested=False)))
        first_is_fix = cpu.tries(task.function, task.shown)[0] == task.fix
        assert untested["reward"] == float(first_is_fix)
        assert not untested["tested"] and untested["submitted"]
        seen["fixed untested" if first_is_fix else "missed untested"] += 1
    fix = task.fix
    miscopied = cpu.try_command(
        cpu.Fix(fix.path, fix.function + "_x", fix.pattern, fix.replacement), task.test + "_x"
    )
    parts = probe.edit_parts(task, miscopied)
    assert parts == {"name": False, "path": True, "site": True, "test": False}
    wrong = probe.episode(task, replying(["cat /etc/passwd"] * 6))
    assert (wrong["reward"], wrong["read"], wrong["submitted"]) == (0.0, False, False)


def test_renaming_changes_every_pooled_name_but_the_kept_ones_and_nothing_else(
    functions: tuple[invented.Pooled, ...], words: tuple[str, ...]
) -> None:
    import builtins
    import io
    import keyword
    import tokenize

    def tokens(text: str) -> list[tuple[int, str]]:
        found = tokenize.generate_tokens(io.StringIO(text).readline)
        return [(t.type, t.string) for t in found]

    def kept(name: str) -> bool:
        dunder = name.startswith("__") and name.endswith("__")
        return keyword.iskeyword(name) or name in {"self", "os", "re", *dir(builtins)} or dunder

    rng = random.Random(13)
    for pooled in functions[:80]:
        mapping = invented.renaming(pooled.text, rng, words, {pooled.name: "fixed_name"})
        assert mapping is not None and mapping[pooled.name] == "fixed_name"
        new = invented.renamed(pooled.text, mapping)
        compile(new, "f.py", "exec")
        before, after = tokens(pooled.text), tokens(new)
        assert [t for t, _ in before] == [t for t, _ in after]  # the same code, renamed
        for (kind, old), (_, now) in zip(before, after, strict=True):
            if kind != tokenize.NAME:
                assert now == old
            elif old == pooled.name:  # fixed, whatever it is (fnmatch's filter)
                assert now == "fixed_name"
            elif kept(old) or len(old) <= 2:
                assert now == old
            else:
                assert now == mapping[old] != old
        assert len(set(mapping.values())) == len(mapping)  # two names stay two


def test_a_test_in_a_class_is_run_by_its_id(
    functions: tuple[invented.Pooled, ...], words: tuple[str, ...], tmp_path: Path
) -> None:
    rng = random.Random(17)
    task = invented.invented_task(rng, functions, words)
    while task.test.count("::") != 2 or not warmup.playable(task):
        task = invented.invented_task(rng, functions, words)
    assert f"`{task.test}" in task.statement
    real = _written(task, tmp_path)
    shell = warmup.SimulatedShell(task)
    for command in warmup.plan(task, tested=True):
        assert shell.run(command) == _bash(command, real), command
    assert shell.files[task.module] == task.base == (real / task.module).read_text()
