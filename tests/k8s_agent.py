"""A stdlib-only agent for the Kubernetes tests: starts in ~30 ms, so a test can run
hundreds of Jobs. It reads the environment a Job gets (``AGL_*``, and from the attempt's
Secret ``OPENAI_API_KEY``, the model key, and ``AGL_REPORT_KEY``, the report key it posts
with) and does what its input says:

- ``sleep``: seconds to wait first (default 0);
- ``report``: ``"succeeded"`` (default; with ``reward``, default 1.0), ``"none"`` (exit 0
  without a word), or ``"exit"`` (exit with ``code`` without a word).
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request


def _call(method: str, path: str, body: object) -> None:
    request = urllib.request.Request(
        os.environ["AGL_GATEWAY_URL"] + path,
        data=json.dumps(body).encode(),
        method=method,
        headers={
            "Authorization": f"Bearer {os.environ['AGL_REPORT_KEY']}",
            "Content-Type": "application/json",
        },
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        response.read()


def main() -> int:
    spec = json.loads(os.environ.get("AGL_INPUT") or "null") or {}
    time.sleep(float(spec.get("sleep", 0)))
    report = spec.get("report", "succeeded")
    if report == "exit":
        return int(spec.get("code", 1))
    if report == "none":
        return 0
    rollout, attempt = os.environ["AGL_ROLLOUT_ID"], os.environ["AGL_ATTEMPT"]
    base = f"/api/rollouts/{rollout}/attempt/{attempt}"
    reward = {"event_id": f"{rollout}-{attempt}-reward", "type": "reward"}
    _call("POST", f"{base}/events", [{**reward, "data": {"value": spec.get("reward", 1.0)}}])
    _call("PATCH", base, {"status": "succeeded"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
