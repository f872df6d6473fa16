"""A graded task's command harness and its grader, for tests/grading/test_grading.py (issue 18).

The reward is whether ``answer.txt`` in the attempt's workspace holds the input's
``answer``; the grader (``grade``) reads it on the controller's side once the harness has
exited. The harness asks the model once through its proxy, as any agent does, then plays
its input's ``role``:

- ``honest``: writes the answer, says so on the test's board (``<sync>/honest.wrote``,
  tests/helpers/board.py: a confined agent can write nothing another one reads), waits for the
  hostile agent to be done (``<sync>/hostile.done``), and reports a reward of 0.5 itself
  (which a graded attempt does not post);
- ``hostile``: waits for the honest answer, then tries what a model's tools could: read
  the run's folder (the store, the admin token), list the workspaces, overwrite the
  honest agent's answer, post a reward of 1.0 and end its attempt as succeeded with its
  model key, report through ``AgentContext.finish``, and last make its own ``answer.txt``
  a link to the honest answer, which the grader (outside the confinement) could read.

Each agent prints one JSON line: what each try got.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import httpx
import openai

from agl.agent import ENV_WORKSPACE, AgentContext
from agl.grading import Grade, GradeRequest
from tests.helpers.board import put, wait_for


def _try(action: Any) -> str:
    try:
        return str(action())
    except OSError as error:
        return type(error).__name__


def _hostile(agent: AgentContext, workspace: Path, spec: dict[str, Any]) -> dict[str, str]:
    run_dir = workspace.parent.parent
    victim = workspace.parent / f"{spec['victim']}.{agent.attempt}" / "answer.txt"
    attempt_url = f"{agent.gateway_url}/api/rollouts/{agent.rollout_id}/attempt/{agent.attempt}"
    headers = {"Authorization": f"Bearer {agent.api_key}"}
    with httpx.Client(headers=headers) as http:
        reward = http.post(
            f"{attempt_url}/events", json=[{"type": "reward", "data": {"value": 1.0}}]
        )
        status = http.patch(attempt_url, json={"status": "succeeded"})
    tried = {
        "list_run_dir": _try(lambda: sorted(os.listdir(run_dir))),
        "read_store": _try(lambda: len(Path(spec["store"]).read_bytes())),
        "list_workspaces": _try(lambda: sorted(os.listdir(workspace.parent))),
        "overwrite_victim": _try(lambda: victim.write_text("wrong")),
        "post_reward": str(reward.status_code),
        "patch_status": str(status.status_code),
    }
    asyncio.run(agent.finish(reward=1.0))
    (workspace / "answer.txt").symlink_to(victim)
    return tried


def main() -> None:
    agent = AgentContext.from_env(os.environ)
    spec = agent.input
    workspace = Path(os.environ[ENV_WORKSPACE])
    sync = spec["sync"]
    client = openai.OpenAI(base_url=agent.base_url, api_key=agent.api_key, max_retries=0)
    client.chat.completions.create(
        model=agent.model or "policy", messages=[{"role": "user", "content": "go"}]
    )
    report: dict[str, Any] = {"cwd": os.getcwd(), "workspace": str(workspace)}
    if spec["role"] == "honest":
        (workspace / "answer.txt").write_text(spec["answer"])
        put(f"{sync}/honest.wrote")
        wait_for(f"{sync}/hostile.done")
        asyncio.run(agent.finish(reward=0.5))
    else:
        wait_for(f"{sync}/honest.wrote")
        report |= _hostile(agent, workspace, spec)
        put(f"{sync}/hostile.done")
    print(json.dumps(report), flush=True)


async def grade(request: GradeRequest) -> Grade:
    answer = request.file("answer.txt").read_text()  # a link out of it raises
    return Grade(
        reward=1.0 if answer == request.input["answer"] else 0.0,
        metrics={"answer_chars": float(len(answer))},
        details={"answer": answer},
    )


if __name__ == "__main__":
    main()
