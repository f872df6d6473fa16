"""``ls``: a table of rollouts, one row each, from the store's summaries
(``/api/summaries``): the store keeps each rollout's numbers as its events arrive and
filters, sorts and pages there, so that listing needs no event."""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from typing import IO

from agl.core.client import AsyncGatewayClient
from agl.core.contracts.queries import RolloutRow, SortKey, SummaryQuery
from agl.rollouts.select import filters, step_of

LS_PAGE = 1000  # rows per /api/summaries call: the gateway's most
SORT_KEYS = tuple(k.value for k in SortKey if k is not SortKey.CREATED)  # the default order
HEADER = ["id", "group", "mode", "step", "status", "attempt", "reward", "turns", "tokens", "time"]


def row(item: RolloutRow, now: float) -> list[str]:
    """A table row: the store's numbers of the current attempt (none yet: no reward, no
    calls, no tokens) and the time from its start to its end, or to ``now``."""
    r, summary = item.rollout, item.summary
    step = step_of(r)
    reward = None if summary is None else summary.reward
    ended = r.ended_at or now
    return [
        r.rollout_id,
        r.group_id,
        r.mode,
        "-" if step is None else str(step),
        r.status.value,
        f"{r.attempt}/{r.max_attempts}",
        "-" if reward is None else f"{reward:g}",
        "0" if summary is None else str(summary.calls),
        "0" if summary is None else str(summary.tokens),
        "-" if r.started_at is None else f"{ended - r.started_at:.1f}s",
    ]


def table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def summary_query(args: argparse.Namespace) -> SummaryQuery:
    """What ``ls`` asks the store for: the filters, and the sort (creation order without
    ``--sort``; rollouts without the value last either way, ties in creation order)."""
    f = filters(args)
    return SummaryQuery(
        statuses=frozenset(f.statuses),
        mode=f.mode,
        group_id=f.group,
        step=f.step,
        min_reward=f.min_reward,
        max_reward=f.max_reward,
        sort=SortKey(args.sort or SortKey.CREATED),
        descending=args.reverse,
    )


async def listed(
    client: AsyncGatewayClient, query: SummaryQuery, limit: int | None
) -> tuple[list[RolloutRow], int]:
    """The first ``limit`` rows (all of them without one), a page at a time, and how many
    match in all."""
    rows: list[RolloutRow] = []
    while True:
        size = LS_PAGE if limit is None else min(LS_PAGE, limit - len(rows))
        page, total = await client.summaries(replace(query, offset=len(rows), limit=size))
        rows += page
        if len(page) < size or len(rows) >= (total if limit is None else min(total, limit)):
            return rows, total


async def cmd_ls(client: AsyncGatewayClient, args: argparse.Namespace, out: IO[str]) -> None:
    rows, total = await listed(client, summary_query(args), args.limit)
    now = time.time()
    print(table([HEADER, *(row(r, now) for r in rows)]), file=out)
    if args.limit is not None and total > args.limit:
        print(f"({args.limit} of {total} shown)", file=out)
