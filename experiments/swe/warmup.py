"""The coding agent's warm-up at CPU scale: the format, the read and the edits, not the
strategy.

As the search and general agents' (``experiments.search.warmup``, whose reasons hold
here), it stands in for pretraining: mini-swe-agent itself (its ``DefaultAgent``, its
action regex, its templates from ``mini_cpu.yaml``) plays invented tasks
(``experiments.swe.invented``: standard-library code, invented names, fresh every time)
against a scripted model, in a simulated shell that runs exactly the command forms of
``experiments.swe.cpu`` in memory (checked against the real jail by the tests), and the
model learns each episode's text (``loss="all"``) or its replies only.

The scripted player reads (``cpu.read_command``), then either

- **tests** (share ``test_share``): tries the read's candidate edits in order
  (``cpu.tries``), each with ``cpu.try_command`` (the edit, the failing test, and on a
  pass the submission, else the backup put back and the sites left printed, so that
  each try copies the first site of the observation before it), until one passes; or
- **submits untested**: the first candidate edit and the submission at once
  (``cpu.submit_command``), right only when the first candidate is the bug.

The two part at the ``sed``'s first option (``-i.orig`` or ``-i``). So the warmed model
can read, copy the function's name, the path and the site into a ``sed``, and run a
test, and tests only some of the time: learning to test before submitting is left to RL, on
real projects' bugs it has never seen.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import yaml
from minisweagent.agents import get_agent
from minisweagent.environments.local import LocalEnvironment

from experiments.agentic.warmup import prompt_ids
from experiments.guess.warmup import Batch, DropoutBPE, masked_batch, trained
from experiments.search.warmup import check_options, copy_batches, episode_rows
from experiments.swe import cpu
from experiments.swe.invented import (
    InventedTask,
    invented_task,
    pool,
    simulated_read,
    vocabulary,
)
from experiments.swe.model import ProxyTextbasedModel

CONFIG = Path(__file__).with_name("mini_cpu.yaml")
# conf/task/swe_cpu.yaml's; 900 steps of 8 tasks and 16 copy rows taught the format but
# not the copies (README: the probe).
STEPS = 1500
TASKS_PER_STEP = 16
LR = 3e-3
TEST_SHARE = 0.5
COPY_QUESTIONS_PER_STEP = 32  # the search agent's short copy episodes (general's reason)
TRY = re.compile(
    "^"
    + cpu.EDIT_FORM.format(backup=re.escape(cpu.BACKUP))
    + rf" && python -m pytest -q \./(?P<test>\S+) >/dev/null && echo {cpu.SUBMIT}"
    + rf" \|\| \{{ mv \./(?P<kept>\S+){re.escape(cpu.BACKUP)} \./(?P<restored>\S+);"
    + rf" sed -i 2d {re.escape(cpu.SITES_FILE)}; cat {re.escape(cpu.SITES_FILE)}; \}}$"
)
_EDIT_SUBMIT = re.compile("^" + cpu.EDIT_FORM.format(backup="") + rf" && echo {cpu.SUBMIT}$")


def fenced(command: str) -> str:
    """A reply as mini-swe-agent's action regex reads it."""
    return f"```mswea_bash_command\n{command}\n```"


def plan(task: InventedTask, tested: bool) -> list[str]:
    """The scripted player's commands for ``task`` (the module's docstring)."""
    read = cpu.read_command(task.function)
    candidates = cpu.tries(task.function, task.shown)
    if not tested:
        return [read, cpu.submit_command(candidates[0])]
    upto = candidates.index(task.fix) + 1
    return [read, *(cpu.try_command(f, task.test) for f in candidates[:upto])]


class SimulatedShell:
    """The jail as the scripted player uses it, in memory: the read (kept as
    ``cpu.SITES_FILE``), the tried edit (the test passes exactly when it is the task's and
    the module is the unbugged one; a failure prints the kept read less its second line)
    and the untested edit. Any other command, a try before a read among them, is refused:
    the simulation covers only what it was checked on."""

    def __init__(self, task: InventedTask) -> None:
        self.task = task
        self.files = dict(task.files)
        self.sites: list[str] | None = None  # cpu.SITES_FILE's lines, once a read wrote it

    def _read(self, function: str) -> str:
        path = self.task.module
        output = simulated_read(path, self.files[path], function)
        self.sites = output.splitlines(keepends=True)
        return output

    def _left(self) -> str:
        """``sed -i 2d`` of the kept read, then its ``cat``."""
        if self.sites is None:
            raise ValueError(f"a try before a read ({cpu.SITES_FILE} absent) is not simulated")
        del self.sites[1:2]
        return "".join(self.sites)

    def _edit(self, found: re.Match[str]) -> None:
        fix = cpu.edit_of(found)
        if fix is None or fix.path not in self.files:
            raise ValueError(f"the edit {found[0]!r} is not simulated")
        self.files[fix.path] = cpu.apply(fix, self.files[fix.path])

    def run(self, command: str) -> tuple[int, str]:
        if command == cpu.read_command(self.task.function):
            return 0, self._read(self.task.function)
        if found := TRY.match(command):
            if not found["path"] == found["kept"] == found["restored"]:
                raise ValueError(f"the try {command!r} is not simulated")
            backup = self.files.get(found["path"])
            self._edit(found)
            right = found["test"] == self.task.test
            if right and self.files[self.task.module] == self.task.base:
                return 0, f"{cpu.SUBMIT}\n"
            self.files[found["path"]] = str(backup)
            return 0, self._left()
        if found := _EDIT_SUBMIT.match(command):
            self._edit(found)
            return 0, f"{cpu.SUBMIT}\n"
        raise ValueError(f"the scripted player ran {command!r}, which is not simulated")


class ScriptEnded(Exception):
    pass


def playable(task: InventedTask) -> bool:
    """Whether the tested plan submits at its last command and not before (an edit that
    an earlier candidate's repeats, or that a later line's site would also undo, is not
    a lesson in the forms)."""
    shell = SimulatedShell(task)
    outputs = [shell.run(command)[1] for command in plan(task, tested=True)]
    return [o == f"{cpu.SUBMIT}\n" for o in outputs] == [False] * (len(outputs) - 1) + [True]


Call = tuple[list[dict[str, str]], str]  # the messages sent and the reply
Reply = Callable[[list[dict[str, str]]], str]  # the model: the messages to its reply


@dataclass
class Played:
    """What mini-swe-agent did on a task: its calls, the commands it ran, how it ended
    (``exit_status``: ``Submitted``, ``LimitsExceeded``, ...) and its messages."""

    calls: list[Call]
    commands: list[str]
    result: dict[str, Any]
    messages: list[dict[str, Any]]


def play(task: InventedTask, reply: Reply, shell: SimulatedShell) -> Played:
    """mini-swe-agent on ``task`` as ``mini_cpu.yaml`` configures it (its agent, action
    regex and templates), the model being ``reply`` and its shell ``shell``. A
    ``ScriptEnded`` from ``reply`` ends the run at once (no retry)."""
    calls: list[Call] = []
    commands: list[str] = []

    class Model(ProxyTextbasedModel):
        abort_exceptions: ClassVar = [*ProxyTextbasedModel.abort_exceptions, ScriptEnded]

        def _query(self, messages: list[dict[str, str]], **kwargs: Any) -> dict[str, Any]:
            text = reply(messages)
            calls.append(([dict(m) for m in messages], text))
            message = {"role": "assistant", "content": text}
            return {"choices": [{"message": message, "finish_reason": "stop"}]}

    class Simulated(LocalEnvironment):
        def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict:
            commands.append(action.get("command", ""))
            code, output = shell.run(commands[-1])
            result = {"output": output, "returncode": code, "exception_info": ""}
            self._check_finished(result)
            return result

    config: dict[str, Any] = yaml.safe_load(CONFIG.read_text())
    model_config = dict(config["model"])
    # never called: Model answers in process
    model_config["model_kwargs"] = {**model_config["model_kwargs"], "api_base": "http://local"}
    agent = get_agent(Model(**model_config), Simulated(), config["agent"], default_type="default")
    result = agent.run(task.statement)
    return Played(calls, commands, result, agent.messages)


def episode_calls(task: InventedTask, commands: list[str]) -> list[Call]:
    """Every call mini-swe-agent makes for ``task`` when the model answers ``commands``:
    the messages it sends (as the proxy gets them) and the reply."""
    script = iter(fenced(c) for c in commands)

    def scripted(messages: list[dict[str, str]]) -> str:
        text = next(script, None)
        if text is None:
            raise ScriptEnded(f"the agent went on after the script's end: {task.function}")
        return text

    played = play(task, scripted, SimulatedShell(task))
    if played.result.get("exit_status") != "Submitted":
        raise ValueError(f"a scripted episode ended {played.result.get('exit_status')!r}")
    return played.calls


def warm_up(
    model: torch.nn.Module,
    tokenizer: Any,
    *,
    steps: int = STEPS,
    tasks_per_step: int = TASKS_PER_STEP,
    lr: float = LR,
    seed: int = 0,
    test_share: float = TEST_SHARE,
    loss: str = "all",
    copy_questions_per_step: int = COPY_QUESTIONS_PER_STEP,
    **options: Any,
) -> dict[str, float]:
    """Train ``model`` in place (the module's docstring); ``options`` are the task's
    (unused here). Answers the losses and seconds."""
    check_options(steps, tasks_per_step, test_share, loss)
    start = time.perf_counter()
    functions, words = pool(), vocabulary()
    rng = random.Random(f"swe-warmup:{seed}")
    segment = DropoutBPE(tokenizer, 0.0, rng)  # canonical: p = 0 draws nothing

    def batch() -> Batch:
        rows = []
        for _ in range(tasks_per_step):
            task = invented_task(rng, functions, words)
            while not playable(task):
                task = invented_task(rng, functions, words)
            calls = episode_calls(task, plan(task, rng.random() < test_share))
            ids = [(prompt_ids(tokenizer, messages), reply) for messages, reply in calls]
            rows += episode_rows(tokenizer, ids, segment, loss)
        return masked_batch(tokenizer, rows)

    parts = [batch]
    if copy_questions_per_step:
        parts.append(copy_batches(tokenizer, seed, copy_questions_per_step, loss))
    return trained(model, parts, steps, lr, start)
