"""What ``python -m agl.rollouts`` prints of a model's text holds no control character
(issue 43, L2): ``show`` and ``scan`` run as subprocesses against a real gateway on a
rollout whose recorded calls, error and agent log carry terminal escapes, and their
output bytes hold each one escaped, never raw."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from agl.core.client import GatewayClient
from agl.core.contracts.execution import AGENT_LOG_EVENT
from agl.core.contracts.records import EventIn
from agl.testing.processes import GatewayProcess
from tests.helpers.controller import new_group

# Clear the screen, set the window title, rewrite the line, C1 CSI, reorder (RLO), ring,
# erase a character, a line separator, DEL, and an invisible tag character.
ATTACK = "\x1b[2J\x1b[H\x1b]0;owned\x07\rreward 1.0 \x9b31m\u202eflesh\x08\u2028\x7f\U000e0041"
ESCAPED = r"\x1b[2J\x1b[H\x1b]0;owned\x07\rreward 1.0 \x9b31m\u202eflesh\x08\u2028\x7f\U000e0041"


def planted(gateway: GatewayProcess) -> tuple[str, str]:
    """A failed rollout with the attack in every place show prints a model's text: its
    group and id."""
    group = new_group()
    rid = f"{group}-escapes"
    tool = {
        "id": "c1",
        "type": "function",
        "function": {"name": "run", "arguments": f'{{"cmd": "tool{ATTACK}"}}'},
    }
    call = {
        "messages": [
            {"role": "user", "content": f"task{ATTACK}"},
            {"role": "assistant", "content": "ls"},
            {"role": "tool", "content": f"shown{ATTACK}"},
        ],
        "response": f"answer{ATTACK}",
        "tool_calls": [tool],
        "finish_reason": "tool_calls",
    }
    log = {"source": "pod p, container agent", "text": f"log{ATTACK}\nlast", "note": ""}
    with GatewayClient(gateway.url, gateway.token) as admin:
        admin.create_rollouts([{"rollout_id": rid, "group_id": group, "input": {}}])
        admin.patch_rollout(rid, "running")
        admin.post_events(
            rid,
            1,
            [
                EventIn(
                    type="model_request_failed", data={"status": 500, "error": f"failed{ATTACK}"}
                ),
                EventIn(type="model_request", data=call),
                EventIn(type="note", data={"text": f"note{ATTACK}"}),
                EventIn(type=AGENT_LOG_EVENT, data={"logs": [log]}),
            ],
        )
        admin.patch_rollout(rid, "failed", attempt=1, error=f"error{ATTACK}")
    return group, rid


def run(gateway: GatewayProcess, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "agl.rollouts", args[0], "--gateway", gateway.url, *args[1:]],
        capture_output=True,
        timeout=180,
        env={**os.environ, "AGL_ADMIN_TOKEN": gateway.token},
    )
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout.decode("utf-8")


def raw(text: str) -> list[str]:
    """The characters of ``text`` a terminal would act on or hide: all but line breaks
    that are not printable."""
    return sorted({c for c in text if c != "\n" and not c.isprintable()})


@pytest.mark.slow
def test_show_prints_control_characters_escaped(gateway: GatewayProcess) -> None:
    _, rid = planted(gateway)
    for args in ((), ("--full",), ("--messages", "5", "--full")):
        out = run(gateway, "show", rid, *args)
        assert raw(out) == [], args
        for where in ("shown", "answer", "tool", "failed", "error"):
            assert where + ESCAPED in out, (where, args)
        assert ("task" + ESCAPED in out) == ("--messages" in args)
        # A log is read a line at a time (a CR or U+2028 ends one); the rest is escaped.
        assert "log" + ESCAPED.split("\\r")[0] in out
        assert "note\\u001b[2J" in out  # an event show prints as JSON: JSON's escapes


def test_scan_quotes_a_failed_calls_error_escaped(gateway: GatewayProcess) -> None:
    group, rid = planted(gateway)
    out = run(gateway, "scan", "--group", group)
    assert raw(out) == []
    [line] = [line for line in out.splitlines() if line.startswith(rid)]
    assert f"a call failed (500: failed{ESCAPED})" in line
