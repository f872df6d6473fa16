"""``export``: the selected rollouts, each with all its events, as JSON lines (a file, or
stdout), the agent's keys left out."""

from __future__ import annotations

import argparse
import json
import sys
from typing import IO

from agl.core.client import AsyncGatewayClient
from agl.core.contracts.records import Event, Rollout
from agl.core.user_error import UserError
from agl.rollouts.select import filters, matching


def export_line(rollout: Rollout, events: list[Event]) -> str:
    # The attempt key is a credential of the agent: it stays out of files.
    record = rollout.model_dump(mode="json", exclude={"attempt_key", "report_key"})
    return json.dumps({"rollout": record, "events": [e.model_dump(mode="json") for e in events]})


async def cmd_export(client: AsyncGatewayClient, args: argparse.Namespace, out: IO[str]) -> None:
    try:
        target = sys.stdout if args.output == "-" else open(args.output, "w")  # noqa: SIM115
    except OSError as error:
        raise UserError(f"cannot write {args.output}: {error.strerror}") from None
    written = 0
    try:
        async for rollout, events in matching(client, filters(args)):
            target.write(export_line(rollout, events) + "\n")
            written += 1
    finally:
        if target is not sys.stdout:
            target.close()
    print(f"exported {written} rollouts to {args.output}", file=sys.stderr)
