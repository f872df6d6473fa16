"""``python -m agl.rollouts``: look into a gateway's rollouts — list, show, export, scan.

    python -m agl.rollouts ls --status succeeded --sort reward -r --limit 20
    python -m agl.rollouts show t3.1.4 --run runs/2026-11-30/10-00-00
    python -m agl.rollouts export --mode train -o rollouts.jsonl
    python -m agl.rollouts scan --pattern 'git log' --rules mypkg.rules:RULES
    python -m agl.rollouts scan --judge http://127.0.0.1:8000/v1 --judge-sample 0.1

The gateway is ``--gateway URL`` (default ``$AGL_GATEWAY_URL``, else
http://127.0.0.1:8000), the admin token ``$AGL_ADMIN_TOKEN`` or ``--token-file``.
``--run DIR`` (a run folder) lets ``show`` say how the calls became samples under the
run's merge strategy, in its tokenizer's words, and ``scan`` flag where that merge broke.
A problem is one line on stderr, exit 2.

What a rollout's numbers mean (``ls``, ``--sort``, ``--min-reward``): those of its
current attempt, the one the trainer reads: ``reward`` its last reward event, ``turns``
its model calls, ``tokens`` the response tokens they sampled, ``duration`` from its start
to its end (shown to now while it runs; sorted last until it ends). ``step`` is the
training step whose metrics the rollout is in: ``metadata.step`` (validation), else
``metadata.batch`` + 1 (sync training trains batch ``b`` at step ``b + 1``; async may
train it later). ``ls`` reads them from the gateway's store (``/api/summaries``), which
keeps them as events arrive and filters and sorts there; ``export`` and ``scan`` read
every event anyway and select with the same rules.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import IO

import httpx

from agl.core.client import AsyncGatewayClient, GatewayError
from agl.core.user_error import UserError
from agl.rollouts.export import cmd_export
from agl.rollouts.ls import SORT_KEYS, cmd_ls
from agl.rollouts.scan import cmd_scan
from agl.rollouts.show import cmd_show

Command = Callable[[AsyncGatewayClient, argparse.Namespace, IO[str]], Awaitable[None]]

DEFAULT_GATEWAY = "http://127.0.0.1:8000"


def count_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--gateway", default=os.environ.get("AGL_GATEWAY_URL", DEFAULT_GATEWAY))
    common.add_argument("--token-file", help="admin token file (default: $AGL_ADMIN_TOKEN)")
    select = argparse.ArgumentParser(add_help=False)
    select.add_argument("--status", action="append", default=[], help="e.g. failed,running")
    select.add_argument("--mode", choices=("train", "val"))
    select.add_argument("--group")
    select.add_argument(
        "--step", type=int, help="val rollouts of this step, train rollouts of batch STEP-1"
    )
    select.add_argument("--min-reward", type=float)
    select.add_argument("--max-reward", type=float)
    main = argparse.ArgumentParser(
        prog="python -m agl.rollouts", description=__doc__.split("\n")[0]
    )
    sub = main.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("ls", parents=[common, select], help="a table of rollouts")
    ls.add_argument("--sort", choices=SORT_KEYS, help="rollouts without the value come last")
    ls.add_argument(
        "-r", "--reverse", action="store_true", help="descending (newest first without --sort)"
    )
    ls.add_argument("--limit", type=count_arg, help="show the first N")
    show = sub.add_parser("show", parents=[common], help="one rollout, call by call")
    show.add_argument("rollout_id")
    show.add_argument("--run", help="the run folder: how the calls became samples")
    show.add_argument("--messages", type=int, default=2, help="last messages shown per call")
    show.add_argument("--full", action="store_true", help="do not shorten long texts")
    show.add_argument(
        "--log-lines", type=int, default=20, help="last lines shown of each agent log (--full: all)"
    )
    export = sub.add_parser("export", parents=[common, select], help="rollouts as JSON lines")
    export.add_argument("-o", "--output", required=True, help="FILE.jsonl, or - for stdout")
    scan = sub.add_parser("scan", parents=[common, select], help="flag suspicious rollouts")
    scan.add_argument("--pattern", action="append", default=[], help="regex (repeatable)")
    scan.add_argument("--run", help="the run folder: also flag where its merge breaks")
    scan.add_argument("--rules", action="append", default=[], help="module:RULES (repeatable)")
    scan.add_argument("--judge", help="an OpenAI-compatible base URL: a model reads the rollouts")
    scan.add_argument("--judge-model", default="policy", help="the judge's model name")
    scan.add_argument(
        "--judge-key", default=os.environ.get("AGL_JUDGE_API_KEY", "none"), help="its API key"
    )
    scan.add_argument(
        "--judge-sample", type=float, default=0.0, help="share of unflagged rollouts judged"
    )
    scan.add_argument("--judge-seed", type=int, default=0)
    scan.add_argument("--rubric", help="a file with the judge's instructions")
    return main


COMMANDS: dict[str, Command] = {
    "ls": cmd_ls,
    "show": cmd_show,
    "export": cmd_export,
    "scan": cmd_scan,
}


def admin_token(args: argparse.Namespace) -> str:
    if args.token_file:
        try:
            return Path(args.token_file).read_text().strip()
        except OSError as error:
            raise UserError(f"cannot read {args.token_file}: {error.strerror}") from None
    token = os.environ.get("AGL_ADMIN_TOKEN")
    if not token:
        raise UserError("no admin token: set AGL_ADMIN_TOKEN or pass --token-file")
    return token


async def run(args: argparse.Namespace) -> None:
    # Few retries: a CLI should say at once that the gateway is not there.
    async with AsyncGatewayClient(args.gateway, admin_token(args), retries=2) as client:
        await COMMANDS[args.command](client, args, sys.stdout)


def describe(error: GatewayError, args: argparse.Namespace) -> str:
    if error.status == 401:
        return f"the gateway at {args.gateway} refused the admin token ({error.message})"
    return f"gateway {args.gateway}: {error.status}: {error.message}"


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    logging.basicConfig(format="agl.rollouts: %(message)s", level=logging.WARNING)
    # The client's retries are no news: a gateway that stays away is one error line.
    logging.getLogger("agl.core.client").setLevel(logging.ERROR)
    try:
        asyncio.run(run(args))
    except UserError as error:
        fail(str(error))
    except GatewayError as error:
        fail(describe(error, args))
    except httpx.HTTPError as error:
        fail(f"cannot reach the gateway at {args.gateway}: {error or type(error).__name__}")
    except BrokenPipeError:  # ``| head``: the reader has what it wanted
        sys.stderr.close()
    except KeyboardInterrupt:
        raise SystemExit(130) from None


def fail(message: str) -> None:
    sys.stderr.write(f"agl.rollouts: {message}\n")
    raise SystemExit(2)


if __name__ == "__main__":
    main()
