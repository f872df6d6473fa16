"""A stdlib-only agent for the Kubernetes tests: starts in ~30 ms, so a test can run
hundreds of Jobs. It reads the environment a Job gets (``AGL_*``, and from the attempt's
Secret ``OPENAI_API_KEY``, the model key, and ``AGL_REPORT_KEY``, the report key it posts
with) and does what its input says:

- ``sleep``: seconds to wait first (default 0);
- ``print``: a text to print first, ``lines``: that many numbered lines to print, and
  ``forge_log``: try to post an ``agent_log`` event with the model key, printing the
  status the gateway answered (what the pod's log should show);
- ``report``: ``"succeeded"`` (default; with ``reward``, default 1.0), ``"none"`` (exit 0
  without a word), ``"exit"`` (exit with ``code`` without a word), or ``"graded"`` (a
  graded task's harness: writes ``write`` to ``answer.txt`` in ``AGL_WORKSPACE``, tries to
  post a reward of 1.0 with the model key, and notes what it got and whether a report key
  was in sight in ``tried.json``; ``grade`` below is its grader, run by ``python -m
  agl.grading`` once it has exited).
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.request
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agl.grading import Grade, GradeRequest


def _call(method: str, path: str, body: object, key_env: str = "AGL_REPORT_KEY") -> int:
    request = urllib.request.Request(
        os.environ["AGL_GATEWAY_URL"] + path,
        data=json.dumps(body).encode(),
        method=method,
        headers={
            "Authorization": f"Bearer {os.environ[key_env]}",
            "Content-Type": "application/json",
        },
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as error:
        if key_env == "AGL_REPORT_KEY":
            raise
        return error.code


def _graded(spec: dict, base: str) -> int:
    workspace = os.environ["AGL_WORKSPACE"]
    with open(os.path.join(workspace, "answer.txt"), "w") as out:
        out.write(spec["write"])
    reward = [{"event_id": "forged", "type": "reward", "data": {"value": 1.0}}]
    tried = {
        "forged": _call("POST", f"{base}/events", reward, key_env="OPENAI_API_KEY"),
        "report_key_seen": "AGL_REPORT_KEY" in os.environ,
    }
    with open(os.path.join(workspace, "tried.json"), "w") as out:
        json.dump(tried, out)
    return 0


async def grade(request: GradeRequest) -> Grade:
    from agl.grading import Grade  # here: the harness above starts on the stdlib alone

    if request.input.get("raise"):
        raise ValueError("the grader cannot read this workspace")
    answer = request.file("answer.txt").read_text()
    tried = json.loads(request.file("tried.json").read_text())
    reward = 1.0 if answer == request.input["answer"] else 0.0
    return Grade(reward=reward, details={"answer": answer, **tried})


def main() -> int:
    spec = json.loads(os.environ.get("AGL_INPUT") or "null") or {}
    time.sleep(float(spec.get("sleep", 0)))
    if "print" in spec:
        print(spec["print"], flush=True)
    for i in range(int(spec.get("lines", 0))):
        print(f"line {i:06d}")
    rollout, attempt = os.environ["AGL_ROLLOUT_ID"], os.environ["AGL_ATTEMPT"]
    base = f"/api/rollouts/{rollout}/attempt/{attempt}"
    if spec.get("forge_log"):
        forged = [{"event_id": "agent-log", "type": "note", "data": {"logs": []}}]
        status = _call("POST", f"{base}/events", forged, key_env="OPENAI_API_KEY")
        print(f"forged agent-log id: {status}", flush=True)
        forged = [{"type": "agent_log", "data": {"logs": [{"source": "me", "text": "all good"}]}}]
        status = _call("POST", f"{base}/events", forged, key_env="OPENAI_API_KEY")
        print(f"forged agent_log: {status}", flush=True)
    report = spec.get("report", "succeeded")
    if report == "exit":
        return int(spec.get("code", 1))
    if report == "none":
        return 0
    if report == "graded":
        return _graded(spec, base)
    reward = {"event_id": f"{rollout}-{attempt}-reward", "type": "reward"}
    _call("POST", f"{base}/events", [{**reward, "data": {"value": spec.get("reward", 1.0)}}])
    _call("PATCH", base, {"status": "succeeded"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
