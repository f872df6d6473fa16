"""``python -m experiments.swe.probe``: what a pinned warm-up taught the tiny model, on the
real CPU-scale tasks, in seconds and before any RL.

mini-swe-agent (its agent and ``mini_cpu.yaml``) runs each task with the model in
process (HF ``generate``, greedy or sampled) and the warm-up's simulated shell over the
task's real bugged module (``simulated_read`` matches the real read on every task:
``python -m experiments.swe.scripted``). A command outside the taught forms gets rc 127
and no output, where the real shell would print an error; the reward is whether the
module is the unbugged one when the agent stops (the task's first test passes exactly
then, for these one-line bugs). It is a probe, not the measure: the run's step-0
validation is, through the gateway, the jail and the grader.

Per task it reports the reward, whether the agent tested (a try command), its calls and
format errors; the reward of the rollouts that tested and of those that did not; and how
often each part an edit copies was right (``edit_parts``: the function's name, the path,
the site, a try's test), which says where the copies fail.
``--invented N`` probes N fresh invented tasks instead: what the warm-up taught on its
own distribution (a gap to the real tasks is a transfer problem, none a learning one).
``--temperature`` and ``--top-p`` set the sampled rollouts' (what a run's
``task.sampling`` would be; the trainer scores the same transformed distribution).

    python -m experiments.swe.probe --seed 0 --tasks data/swe_cpu/3-split/test.jsonl \\
        --mirror data/swe_cpu/mirror --samples 4
"""

from __future__ import annotations

import argparse
import random
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from agl.backends.inference.models import load_model
from experiments.agentic.warmup import prompt_ids
from experiments.swe import cpu, mirror
from experiments.swe.instances import Instance, read_instances
from experiments.swe.invented import (
    InventedTask,
    invented_task,
    pool,
    simulated_read,
    vocabulary,
)
from experiments.swe.warmup import TRY, Reply, SimulatedShell, play, playable

_READ = re.compile(r"^\{ grep -rl 'def\.(\w+)\(' \.; ")
_ANY_EDIT = re.compile("^" + cpu.EDIT_FORM.format(backup=f"(?:{re.escape(cpu.BACKUP)})?"))
PARTS = ("name", "path", "site", "test")  # what an edit copies (``edit_parts``)
MAX_TOKENS = 400  # conf/task/swe_cpu.yaml's sampling.max_tokens


def real_task(instance: Instance, root: Path) -> InventedTask:
    """A real CPU-scale task in the form the simulated shell plays."""
    path = instance.patch.split(" b/", 1)[1].split("\n", 1)[0]
    function = str(instance.extra["bug"]).split(":")[1].partition(".")[0]
    with tempfile.TemporaryDirectory(prefix="agl-swe-probe-") as scratch:
        checkout = Path(scratch) / "repo"
        mirror.checkout(root, instance.repo, instance.instance_id, checkout)
        bugged = (checkout / path).read_text()
    base = (mirror.repo_folder(root, instance.repo) / mirror.BASE / path).read_text()
    fix = cpu.parse_edit(str(instance.extra["fix"]))
    assert fix is not None, instance.extra["fix"]
    shown = cpu.parse_shown(simulated_read(path, bugged, function))
    return InventedTask(
        files={path: bugged},
        module=path,
        base=base,
        function=function,
        test=cpu.test_function(instance.FAIL_TO_PASS[0]),
        statement=instance.problem_statement,
        fix=fix,
        shown=tuple(shown),
    )


class ProbeShell(SimulatedShell):
    """The simulated shell, lenient: any function's read, and rc 127 for what it does
    not simulate (an edit of a file that is not there, say)."""

    def run(self, command: str) -> tuple[int, str]:
        if found := _READ.match(command):
            if command != cpu.read_command(found[1]):
                return 127, ""
            return 0, self._read(found[1])  # tee's status
        try:
            return super().run(command)
        except (ValueError, IndexError):
            return 127, ""


def sampler(model: Any, tokenizer: Any, temperature: float, top_p: float = 1.0) -> Reply:
    """The model as mini-swe-agent's ``reply``: HF ``generate``, greedy at 0."""
    sampling: dict[str, Any] = (
        {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": top_p}
        if temperature > 0
        else {"do_sample": False}
    )

    def generated(messages: list[dict[str, str]]) -> str:
        ids = prompt_ids(tokenizer, messages)
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=MAX_TOKENS,
                pad_token_id=tokenizer.pad_token_id,
                **sampling,
            )
        text = tokenizer.decode(out[0, len(ids) :], skip_special_tokens=False)
        return str(text.split(tokenizer.eos_token)[0])

    return generated


def edit_parts(task: InventedTask, command: str) -> dict[str, bool] | None:
    """Which parts of an edit (tried or not) are right: the function's name in its range,
    the path, the site (one of the read's candidate edits, ``cpu.tries``) and, for a try,
    the test it runs; None when ``command`` is no edit. Where a policy's edits go wrong."""
    found = _ANY_EDIT.match(command)
    if found is None:
        return None
    candidates = {(f.pattern, f.replacement) for f in cpu.tries(task.function, task.shown)}
    site = (found["pattern"], found["replacement"])
    parts = {
        "name": found["function"] == task.function,
        "path": found["path"] == task.module,
        "site": found["end"] == found["pattern"] and site in candidates,
    }
    if tried := TRY.match(command):
        parts["test"] = tried["test"] == task.test
    return parts


def episode(task: InventedTask, reply: Reply) -> dict[str, Any]:
    """One rollout of ``task`` by ``reply`` through mini-swe-agent in the probe's shell."""
    shell = ProbeShell(task)
    played = play(task, reply, shell)
    errors = sum(
        m.get("role") == "user" and str(m.get("content", "")).startswith("Format error")
        for m in played.messages
    )
    edits = [p for p in (edit_parts(task, c) for c in played.commands) if p is not None]
    return {
        "reward": float(shell.files[task.module] == task.base),
        "tested": any(TRY.match(c) for c in played.commands),
        "read": any(c == cpu.read_command(task.function) for c in played.commands),
        "calls": len(played.calls),
        "format_errors": errors,
        "submitted": played.result.get("exit_status") == "Submitted",
        "edits": len(edits),
        "tries": sum("test" in e for e in edits),
        **{f"{part} right": sum(bool(e.get(part)) for e in edits) for part in PARTS},
    }


def invented_tasks(n: int, seed: int) -> list[InventedTask]:
    """``n`` fresh invented tasks of the warm-up's kind (playable), none of its own draws:
    what the warm-up taught, on its own distribution."""
    rng = random.Random(f"swe-probe:{seed}")
    functions, words = pool(), vocabulary()
    tasks = []
    while len(tasks) < n:
        task = invented_task(rng, functions, words)
        if playable(task):
            tasks.append(task)
    return tasks


def summary(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Means over rollouts; a part's share right over all edits (the test's: over tries)."""
    n = len(rows)
    tested = [r for r in rows if r["tested"]]
    untested = [r for r in rows if not r["tested"]]
    out = {key: sum(float(r[key]) for r in rows) / n for key in rows[0]}
    for part in PARTS:
        over = sum(r["tries" if part == "test" else "edits"] for r in rows)
        out[f"{part} right"] = sum(r[f"{part} right"] for r in rows) / over if over else 0.0
    out["reward if tested"] = sum(r["reward"] for r in tested) / len(tested) if tested else 0.0
    out["reward if not"] = sum(r["reward"] for r in untested) / len(untested) if untested else 0.0
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.swe.probe")
    parser.add_argument("--seed", type=int, default=0, help="the pinned warm-up's seed")
    parser.add_argument("--pins", type=Path, default=Path("experiments/swe/warmups"))
    parser.add_argument("--tasks", type=Path, default=Path("data/swe_cpu/3-split/test.jsonl"))
    parser.add_argument("--mirror", type=Path, default=Path("data/swe_cpu/mirror"))
    parser.add_argument("--samples", type=int, default=4, help="sampled rollouts a task")
    parser.add_argument("--temperature", type=float, default=1.0, help="the sampled rollouts'")
    parser.add_argument("--top-p", type=float, default=1.0, help="the sampled rollouts'")
    parser.add_argument(
        "--invented", type=int, default=0, help="N fresh invented tasks instead of --tasks"
    )
    args = parser.parse_args(argv)
    loaded = load_model("tiny")
    weights = torch.load(args.pins / f"seed-{args.seed}.pt", map_location="cpu")
    loaded.model.load_state_dict(weights)
    loaded.model.eval()
    torch.manual_seed(args.seed)
    tasks = (
        invented_tasks(args.invented, args.seed)
        if args.invented
        else [real_task(i, args.mirror.resolve()) for i in read_instances([args.tasks])]
    )
    sampled = f"T = {args.temperature:g}" + (f", top-p {args.top_p:g}" if args.top_p < 1 else "")
    for label, temperature, k in (("greedy", 0.0, 1), (sampled, args.temperature, args.samples)):
        reply = sampler(loaded.model, loaded.tokenizer, temperature, args.top_p)
        rows = [episode(task, reply) for task in tasks for _ in range(k)]
        figures = summary(rows)
        print(f"{label:14s}", "  ".join(f"{key} {value:.2f}" for key, value in figures.items()))


if __name__ == "__main__":
    main()
