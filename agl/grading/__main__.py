"""``python -m agl.grading MODULE:FUNCTION``: grade one attempt from this process's
environment, as a Kubernetes Job's grader container does once the harness, its init
container, has exited 0 (agl/backends/execution/k8s/manifests.py).

It reads the attempt (``AGL_GATEWAY_URL``, ``AGL_ROLLOUT_ID``, ``AGL_ATTEMPT``,
``AGL_INPUT``), the workspace the harness left (``AGL_WORKSPACE``), the report key
(``AGL_REPORT_KEY``: only this container holds it) and the grader's time
(``AGL_GRADE_TIMEOUT_S``, none when unset), runs the grader and posts its verdict. A
grader that raises or runs out of time fails the attempt as the agent's failure
(``grader raised: ...``), posted from here, as the local executor's is.

Exits 0 once the attempt's end is posted; 1 with one line on stderr when it cannot be
(the Job fails, and the executor reports that); 2 on bad usage.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from dataclasses import replace
from pathlib import Path

from agl.agent import ENV_REPORT_KEY, ENV_WORKSPACE, AgentContext, AgentEnvError, undumpable
from agl.backends.execution.worker import one_line
from agl.core.contracts.execution import (
    ENV_API_KEY,
    ENV_ATTEMPT,
    ENV_GATEWAY,
    ENV_INPUT,
    ENV_ROLLOUT,
)
from agl.grading import GradeNotPosted, grade_attempt, load_grader

ENV_GRADE_TIMEOUT = "AGL_GRADE_TIMEOUT_S"
REQUIRED = (ENV_GATEWAY, ENV_ROLLOUT, ENV_ATTEMPT, ENV_INPUT, ENV_REPORT_KEY, ENV_WORKSPACE)


def context_from(env: dict[str, str]) -> tuple[AgentContext, Path, float | None]:
    """The attempt this container grades, its workspace and the grader's time;
    AgentEnvError (one line) when the environment lacks or garbles one."""
    missing = [name for name in REQUIRED if not env.get(name)]
    if missing:
        raise AgentEnvError(f"the grader's environment lacks {', '.join(missing)}")
    timeout = env.get(ENV_GRADE_TIMEOUT)
    try:
        timeout_s = float(timeout) if timeout else None
    except ValueError:
        raise AgentEnvError(f"{ENV_GRADE_TIMEOUT}={timeout!r} is not a number") from None
    # The harness's variables with the report key (from_env reads AGL_REPORT_KEY), less
    # the model key the grader has no use for; it reports, so it is not "graded".
    agent = AgentContext.from_env({**env, ENV_API_KEY: ""})
    return replace(agent, graded=False), Path(env[ENV_WORKSPACE]), timeout_s


async def _grade(spec: str, env: dict[str, str]) -> None:
    grader = load_grader(spec)
    context, workspace, timeout_s = context_from(env)
    error = await grade_attempt(grader, context, workspace, timeout_s)
    if error is not None:
        await context.finish(error=error)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.stderr.write("usage: python -m agl.grading MODULE:FUNCTION\n")
        raise SystemExit(2)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    undumpable()
    try:
        asyncio.run(_grade(args[0], dict(os.environ)))
    except (ValueError, GradeNotPosted) as error:  # AgentEnvError is a ValueError
        sys.stderr.write(f"agl.grading: {error}\n")
        raise SystemExit(2 if isinstance(error, ValueError) else 1) from None
    except Exception as error:  # the gateway refused the failure, or is gone
        sys.stderr.write(f"agl.grading: cannot report the attempt's end: {one_line(error)}\n")
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
