"""What a sandbox costs a command: ``true`` as a plain child process, in the host view
(a confined local agent's: the machine's tree read-only, a uid of its own) and in the
coding task's jail (a root of only what is bound, pytest's Python, limits, capped
output), alternated in one run so the machine's load weighs on all alike.

Prints seconds per command (median of ``--rounds``) and each sandbox's ratio to the plain
child; the load average beside them.

    python -m bench.sandbox --rounds 30
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from agl.sandbox.launch import run, unavailable
from agl.sandbox.spec import Spec
from agl.sandbox.uids import give, lease
from experiments.swe.sandbox import OUTPUT_LIMIT, tool_jail


def _timed(command: Callable[[], object]) -> float:
    start = time.perf_counter()
    command()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.sandbox")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    if (reason := unavailable()) is not None:
        raise SystemExit(f"bench.sandbox: no sandbox here: {reason}")
    with tempfile.TemporaryDirectory() as scratch, lease() as uid:
        workspace = Path(scratch) / "ws"
        workspace.mkdir()
        give(workspace, uid)
        env = {"PATH": "/usr/bin:/bin"}
        host = Spec(view="host", argv=("true",), cwd="/", env=env, uid=uid, gid=uid)
        jail = tool_jail(workspace).spec(["true"], uid, OUTPUT_LIMIT)
        ways: dict[str, Callable[[], object]] = {
            "plain child": lambda: subprocess.run(["true"], check=True),
            "host view": lambda: run(host, 60),
            "coding task's jail": lambda: run(jail, 60),
        }
        for way in ways.values():  # warm caches once
            way()
        seconds: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(args.rounds):
            for name, way in ways.items():
                seconds[name].append(_timed(way))
    plain = statistics.median(seconds["plain child"])
    print(f"load average {os.getloadavg()[0]:.2f}, {args.rounds} rounds")
    for name, values in seconds.items():
        median = statistics.median(values)
        print(f"{name:20s} {median * 1000:8.1f} ms   x{median / plain:6.1f}")


if __name__ == "__main__":
    main()
