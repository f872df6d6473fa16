"""``python -m agl.agent MODULE:FUNCTION``: one attempt of a Python harness, run from this
process's environment, as an agent container (a Kubernetes Job) runs it. Exits 0 when
the harness returned, 1 with one line on stderr when it raised, 2 on bad usage."""

from __future__ import annotations

import asyncio
import os
import sys

from agl.agent import ENV_REPORT_KEY, undumpable
from agl.backends.execution.worker import load_harness, run_attempt


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.stderr.write("usage: python -m agl.agent MODULE:FUNCTION\n")
        raise SystemExit(2)
    try:
        harness = load_harness(args[0])
    except ValueError as error:
        sys.stderr.write(f"agl.agent: {error}\n")
        raise SystemExit(2) from None
    undumpable()
    report_key = os.environ.pop(ENV_REPORT_KEY, "")  # gone from what the harness starts
    env = dict(os.environ)
    failure = asyncio.run(run_attempt(harness, env, timeout_s=None, report_key=report_key))
    if failure is not None:
        sys.stderr.write(f"agl.agent: {failure}\n")
        raise SystemExit(1)


if __name__ == "__main__":
    main()
