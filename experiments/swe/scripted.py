"""The warm-up's two scripted paths played on real CPU-scale tasks, in the real jail,
graded by the real grader: what reading and testing can earn, and what reading alone
does (``experiments.swe.warmup``'s player, with the real shell instead of the simulated).

- **read, try, test**: the read, then, until the test passes (the command submits) or
  ``MAX_TRIES`` ran, ``cpu.try_command`` of the first candidate edit of the last output
  (a failed try prints the sites left), as the warm-up teaches;
- **read, edit, submit**: the read, then the first candidate edit, submitted untested.

No model is involved: this is the ceiling of the taught skill executed perfectly, and the
value of skipping the test, on the tasks' own code. It also checks the warm-up's
simulated read against the real one on every task (``simulated_read`` over the bugged
module, the real ``grep`` over the whole checkout).

``python -m experiments.swe.scripted --tasks FILE --mirror DIR [--out FILE.json]``
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from agl.core.user_error import UserError
from agl.sandbox.uids import give, lease
from experiments.swe import cpu, mirror
from experiments.swe.environment import SandboxEnvironment
from experiments.swe.grader import grade_checkout, grading_row
from experiments.swe.instances import Instance, read_instances
from experiments.swe.invented import simulated_read

PATHS = ("read, try, test", "read, edit, submit")


def first_test(instance: Instance) -> str:
    return cpu.test_function(instance.FAIL_TO_PASS[0])


def play(instance: Instance, root: Path, path: str) -> dict[str, Any]:
    """One path on one task: its reward, commands and whether the simulated read
    matched the real one."""
    function = str(instance.extra["bug"]).split(":")[1].partition(".")[0]
    row = grading_row(instance, root)
    with tempfile.TemporaryDirectory(prefix="agl-swe-scripted-") as scratch:
        checkout = Path(scratch) / "repo"
        mirror.checkout(root, instance.repo, instance.instance_id, checkout)
        module = instance.patch.split(" b/", 1)[1].split("\n", 1)[0]
        simulated = simulated_read(module, (checkout / module).read_text(), function)
        with lease() as uid:
            give(checkout, uid)
            shell = SandboxEnvironment(cwd=str(checkout), uid=uid, timeout=30)
            commands = [cpu.read_command(function)]
            read = shell.execute({"command": commands[0]})["output"]
            candidates = cpu.tries(function, cpu.parse_shown(read))
            submitted, output, tried = False, read, []
            if path == PATHS[1]:
                commands.append(cpu.submit_command(candidates[0]))
                submitted, _ = _run(shell, commands[-1])
            else:
                while len(tried) < cpu.MAX_TRIES and not submitted:
                    left = cpu.tries(function, cpu.parse_shown(output))
                    if not left:
                        break
                    tried.append(left[0])
                    commands.append(cpu.try_command(left[0], first_test(instance)))
                    submitted, output = _run(shell, commands[-1])
        grade = grade_checkout(row, checkout, [])
    return {
        "reward": grade.reward,
        "commands": len(commands),
        "submitted": submitted,
        "read_matches_simulation": read == simulated,
        # what a failed try printed led to the read's next candidate, every time
        "tries_follow_the_read": tried == candidates[: len(tried)],
    }


def _run(shell: SandboxEnvironment, command: str) -> tuple[bool, str]:
    """Runs ``command``; whether it submitted, and its output."""
    from minisweagent.exceptions import Submitted

    try:
        return False, str(shell.execute({"command": command})["output"])
    except Submitted:
        return True, ""


def evaluate(
    instances: Sequence[Instance], root: Path, workers: int = 2
) -> dict[str, list[dict[str, Any]]]:
    jobs = [(p, i) for p in PATHS for i in instances]
    with ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(lambda job: play(job[1], root, job[0]), jobs))
    n = len(instances)
    return {p: results[k * n : (k + 1) * n] for k, p in enumerate(PATHS)}


def table(results: dict[str, list[dict[str, Any]]]) -> str:
    lines = [
        "| path | reward | fixed | commands a rollout | read as simulated | tries in order |",
        "|---|---|---|---|---|---|",
    ]
    for path, rows in results.items():
        n = len(rows)
        fixed = sum(r["reward"] == 1.0 for r in rows)
        commands = sum(r["commands"] for r in rows) / n
        same = sum(r["read_matches_simulation"] for r in rows)
        ordered = sum(r["tries_follow_the_read"] for r in rows)
        lines.append(
            f"| {path} | {fixed / n:.3f} | {fixed} of {n} | {commands:.2f} | {same} of {n} "
            f"| {ordered} of {n} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.swe.scripted")
    parser.add_argument("--tasks", type=Path, required=True, help="CPU-scale tasks (jsonl)")
    parser.add_argument("--mirror", type=Path, required=True, help="the pipeline's mirror")
    parser.add_argument("--out", type=Path, help="each path's results, as json")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    try:
        instances = read_instances([args.tasks])
        if not instances or any("fix" not in i.extra for i in instances):
            raise UserError(f"{args.tasks}: no CPU-scale tasks (make them with --cpu)")
        results = evaluate(instances, args.mirror.resolve(), args.workers)
    except UserError as error:
        sys.stderr.write(f"experiments.swe.scripted: {error}\n")
        return 2
    sys.stdout.write(table(results))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
