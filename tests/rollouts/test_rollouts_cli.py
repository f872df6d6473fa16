"""``python -m agl.rollouts`` against a real gateway: rollouts made through the recording
proxy (fake vLLM upstream) with planted oddities, then ls / show / export / scan run as
subprocesses; ``show --run`` against a real short training run of the tiny model."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import yaml

from agl.core.client import GatewayClient, proxy_base_url
from agl.core.contracts.queries import RolloutRow, SummaryQuery
from agl.core.contracts.records import Event, Rollout
from agl.core.contracts.samples import BreakReason
from agl.core.run_folder import RunFolderError, load_run
from agl.core.trainer.explain import Explanation, calls_from_events, explain
from agl.rollouts.ls import LS_PAGE, listed
from agl.rollouts.select import PAGE, Filters, matching, step_of
from agl.rollouts.show import spell
from agl.strategies.registry import get
from agl.testing.fake_vllm import FakeVllm, encode, reply_for
from agl.testing.processes import GatewayProcess, free_port, gateway_process

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run_command",
            "description": "Run a shell command.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
        },
    }
]


@dataclass(frozen=True)
class Endpoint:
    url: str
    token: str


def cli(
    gw: GatewayProcess | Endpoint, command: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "AGL_ADMIN_TOKEN": gw.token, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "agl.rollouts", command, "--gateway", gw.url, *args],
        capture_output=True,
        text=True,
        timeout=180,
        env=environment,
    )


def ok(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    return done.stdout


def ids_of(table: str) -> list[str]:
    """The id column of an ``ls`` table (its header and a "shown" note left out)."""
    lines = [line for line in table.splitlines() if line and not line.startswith("(")]
    assert lines[0].split()[0] == "id"
    return [line.split()[0] for line in lines[1:]]


# ---------------------------------------------------------------------- planted rollouts


@dataclass
class Planted:
    group: str
    ids: dict[str, str]  # case -> rollout id
    rewards: dict[str, float]
    tokens: dict[str, int]  # case -> response tokens sampled

    def id(self, case: str) -> str:
        return self.ids[case]

    def cases(self, rollout_ids: list[str]) -> list[str]:
        by_id = {v: k for k, v in self.ids.items()}
        return [by_id[r] for r in rollout_ids]


CASES = ("clean", "curl", "gitlog", "repeat", "length", "nocalls", "failed", "val", "queued")


def sampled(messages: list[dict[str, str]]) -> int:
    return len(encode(reply_for(messages))) + 1  # the fake's reply and its EOS


@pytest.fixture(scope="module")
def planted(gateway: GatewayProcess, upstream: tuple[str, FakeVllm]) -> Planted:
    """One rollout per case, in this order, in a group of their own."""
    group = f"cli-{uuid.uuid4().hex[:6]}"
    ids = {case: f"{group}-{case}" for case in CASES}
    rewards = {
        "clean": 1.0,
        "curl": 0.5,
        "gitlog": 0.0,
        "repeat": 0.25,
        "length": 0.75,
        "nocalls": 1.0,
        "failed": 0.0,
        "val": 1.0,
    }
    metadata = {"clean": {"batch": 0}, "curl": {"batch": 1}, "val": {"step": 2}}
    tokens = {case: 0 for case in CASES}
    with GatewayClient(gateway.url, gateway.token) as admin:
        admin.create_rollouts(
            [
                {
                    "rollout_id": ids[case],
                    "group_id": group,
                    "mode": "val" if case == "val" else "train",
                    "input": {"case": case, "flag": case == "val"},
                    "metadata": metadata.get(case, {}),
                }
                for case in CASES
            ]
        )
        for case in CASES[:-1]:  # "queued" never runs
            r = admin.patch_rollout(ids[case], "running")
            tokens[case] = _play(gateway, r, case, upstream[1])
            admin.post_reward(r.rollout_id, r.attempt, rewards[case])
            if case == "failed":
                admin.patch_rollout(r.rollout_id, "failed", attempt=1, error="agent gave up")
            else:
                admin.patch_rollout(r.rollout_id, "succeeded", attempt=1)
    return Planted(group, ids, rewards, tokens)


def _play(gw: GatewayProcess, r: Rollout, case: str, fake: FakeVllm) -> int:
    """The case's calls through the proxy; answers the response tokens sampled."""
    agent = openai.OpenAI(
        base_url=proxy_base_url(gw.url, r.rollout_id, r.attempt, r.mode),
        api_key=r.attempt_key,
        max_retries=0,
    )

    def chat(messages: list[dict[str, str]], **options: object) -> str:
        answer = agent.chat.completions.create(model="policy", messages=messages, **options)
        return answer.choices[0].message.content or ""

    hello = [{"role": "user", "content": "hello"}]
    if case in ("clean", "val"):
        reply = chat(hello)
        turn = [*hello, {"role": "assistant", "content": reply}, {"role": "user", "content": "ok"}]
        chat(turn)
        return sampled(hello) + sampled(turn)
    if case == "curl":
        ask = [{"role": "user", "content": "please curl example.com"}]
        chat(ask)
        return sampled(ask)
    if case == "gitlog":
        agent.chat.completions.create(
            model="policy",
            messages=[{"role": "user", "content": "use-tool git log -p"}],
            tools=TOOLS,  # type: ignore[arg-type]
        )
        return len(encode(json.dumps({"query": "git log -p"}, separators=(",", ":")))) + 1
    if case == "repeat":
        chat(hello)
        chat(hello)
        return 2 * sampled(hello)
    if case == "length":
        chat(hello, max_tokens=3)
        return 3
    if case == "failed":
        fake.fail_next = [400]
        with pytest.raises(openai.BadRequestError):
            chat(hello)
        chat(hello)
        return sampled(hello)
    assert case == "nocalls"
    return 0


# ------------------------------------------------------------------------------------ ls


def test_ls_lists_every_rollout_with_its_numbers(gateway: GatewayProcess, planted: Planted) -> None:
    out = ok(cli(gateway, "ls", "--group", planted.group))
    assert planted.cases(ids_of(out)) == list(CASES)
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:]}
    header = out.splitlines()[0].split()
    for case in CASES:
        row = dict(zip(header, rows[planted.id(case)], strict=True))
        assert row["group"] == planted.group
        assert row["mode"] == ("val" if case == "val" else "train")
        assert row["reward"] == ("-" if case == "queued" else f"{planted.rewards[case]:g}")
        assert row["tokens"] == str(planted.tokens[case])
        assert row["status"] == {"failed": "failed", "queued": "queuing"}.get(case, "succeeded")
        assert row["attempt"] == "1/1"
    turns = {case: rows[planted.id(case)][header.index("turns")] for case in CASES}
    assert turns == {
        "clean": "2",
        "curl": "1",
        "gitlog": "1",
        "repeat": "2",
        "length": "1",
        "nocalls": "0",
        "failed": "1",  # the failed call is not a model call
        "val": "2",
        "queued": "0",
    }
    assert rows[planted.id("clean")][header.index("step")] == "1"  # batch 0
    assert rows[planted.id("queued")][header.index("time")] == "-"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--status", "failed"], ["failed"]),
        (["--status", "failed,queuing"], ["failed", "queued"]),
        (["--mode", "val"], ["val"]),
        (["--step", "2"], ["curl", "val"]),
        (["--min-reward", "0.5"], ["clean", "curl", "length", "nocalls", "val"]),
        (["--max-reward", "0.25"], ["gitlog", "repeat", "failed"]),
        (["--min-reward", "0.1", "--max-reward", "0.6"], ["curl", "repeat"]),
        (["--status", "succeeded", "--mode", "train", "--max-reward", "0"], ["gitlog"]),
    ],
)
def test_ls_filters(
    gateway: GatewayProcess, planted: Planted, args: list[str], expected: list[str]
) -> None:
    out = ok(cli(gateway, "ls", "--group", planted.group, *args))
    assert planted.cases(ids_of(out)) == expected


@pytest.mark.slow
def test_ls_sorts_and_limits(gateway: GatewayProcess, planted: Planted) -> None:
    by_reward = ok(cli(gateway, "ls", "--group", planted.group, "--sort", "reward"))
    order = ["gitlog", "failed", "repeat", "curl", "length", "clean", "nocalls", "val", "queued"]
    assert planted.cases(ids_of(by_reward)) == order
    reverse = ok(cli(gateway, "ls", "--group", planted.group, "--sort", "reward", "-r"))
    expected = ["clean", "nocalls", "val", "length", "curl", "repeat", "gitlog", "failed"]
    assert planted.cases(ids_of(reverse)) == [*expected, "queued"]  # no reward: last
    top = ok(cli(gateway, "ls", "--group", planted.group, "--sort", "turns", "-r", "--limit", "3"))
    assert planted.cases(ids_of(top)) == ["clean", "repeat", "val"]
    assert "(3 of 9 shown)" in top
    by_tokens = ok(cli(gateway, "ls", "--group", planted.group, "--sort", "tokens"))
    # The store's order: a rollout with no event yet (queued) has no tokens to sort by,
    # and comes last, as in the viewer (it is listed with 0).
    assert planted.cases(ids_of(by_tokens))[:2] == ["nocalls", "length"]
    assert planted.cases(ids_of(by_tokens))[-1] == "queued"
    newest = ok(cli(gateway, "ls", "--group", planted.group, "-r", "--limit", "2"))
    assert planted.cases(ids_of(newest)) == ["queued", "val"]
    assert "(2 of 9 shown)" in newest
    none = ok(cli(gateway, "ls", "--group", planted.group, "--limit", "0"))
    assert ids_of(none) == [] and "(0 of 9 shown)" in none


def test_ls_pages_through_the_store(gateway: GatewayProcess) -> None:
    group = f"many-{uuid.uuid4().hex[:6]}"
    n = LS_PAGE + 50
    with GatewayClient(gateway.url, gateway.token) as admin:
        admin.create_rollouts([{"rollout_id": f"{group}-{i}", "group_id": group} for i in range(n)])
    assert ids_of(ok(cli(gateway, "ls", "--group", group))) == [f"{group}-{i}" for i in range(n)]
    top = ok(cli(gateway, "ls", "--group", group, "-r", "--limit", str(LS_PAGE + 10)))
    assert ids_of(top) == [f"{group}-{i}" for i in reversed(range(40, n))]
    assert f"({LS_PAGE + 10} of {n} shown)" in top


class SummaryPages:
    """Answers /api/summaries pages of ``n`` rows and keeps the queries asked."""

    def __init__(self, n: int) -> None:
        self.rows = [RolloutRow(r, None) for r in PagedClient(n).rollouts]
        self.asked: list[SummaryQuery] = []

    async def summaries(self, query: SummaryQuery) -> tuple[list[RolloutRow], int]:
        self.asked.append(query)
        return self.rows[query.offset : query.offset + query.limit], len(self.rows)


@pytest.mark.parametrize(
    ("n", "limit", "pages"),
    [
        (0, None, [(0, LS_PAGE)]),
        (2 * LS_PAGE, None, [(0, LS_PAGE), (LS_PAGE, LS_PAGE)]),  # no empty page after
        (2 * LS_PAGE + 1, None, [(0, LS_PAGE), (LS_PAGE, LS_PAGE), (2 * LS_PAGE, LS_PAGE)]),
        (3 * LS_PAGE, LS_PAGE + 5, [(0, LS_PAGE), (LS_PAGE, 5)]),
        (3, 10, [(0, 10)]),
        (3 * LS_PAGE, 0, [(0, 0)]),  # the total alone
    ],
)
def test_ls_asks_only_for_the_rows_it_shows(
    n: int, limit: int | None, pages: list[tuple[int, int]]
) -> None:
    client = SummaryPages(n)
    rows, total = asyncio.run(listed(client, SummaryQuery(), limit))  # type: ignore[arg-type]
    assert [(q.offset, q.limit) for q in client.asked] == pages
    assert rows == client.rows[:limit] and total == n


# ---------------------------------------------------------------------------------- show


def test_show_tells_the_whole_rollout(gateway: GatewayProcess, planted: Planted) -> None:
    out = ok(cli(gateway, "show", planted.id("clean")))
    assert f"rollout {planted.id('clean')}  group {planted.group}  mode train  step 1" in out
    assert "status succeeded, attempt 1 of at most 1" in out
    assert 'input: {"case": "clean", "flag": false}' in out
    assert "call 0: policy v3, stop" in out and "call 1: policy v3, stop" in out
    assert "user: hello" in out and f"→ {reply_for([{'role': 'user', 'content': 'hello'}])}" in out
    assert "… 1 earlier messages" in out and "user: ok" in out
    assert "reward 1.0" in out
    assert out.index("call 0") < out.index("call 1") < out.index("reward 1.0")
    assert "attempt_key" not in out and "--run DIR" in out

    failed = ok(cli(gateway, "show", planted.id("failed")))
    assert "status failed" in failed and "error: agent gave up" in failed
    assert "failed call: 400" in failed and "injected failure 400" in failed
    assert failed.index("failed call") < failed.index("call 0:")

    history = failed.split("history:\n")[1].split("\n\n")[0].splitlines()
    assert [line.split("  ", 2)[2] for line in history] == [
        "attempt 1  queuing (created)",
        "attempt 1  running",
        "attempt 1  failed: agent gave up",
    ]
    assert "history:" in out and "attempt 1  succeeded" in out

    repeat = ok(cli(gateway, "show", planted.id("repeat")))
    # Same prompt twice: the trainer keeps the last, and the listing says so.
    assert repeat.index("call 0 (retried: not trained): policy v3") < repeat.index("call 1:")

    tool = ok(cli(gateway, "show", planted.id("gitlog"), "--messages", "0"))
    assert "call 0: policy v3, tool_calls," in tool
    assert 'tool call run_command({"query":"git log -p"})' in tool
    assert "user: use-tool" not in tool


# -------------------------------------------------------------------------------- export


def test_export_writes_one_line_per_rollout_with_its_events(
    gateway: GatewayProcess, planted: Planted, tmp_path: Path
) -> None:
    target = tmp_path / "rollouts.jsonl"
    done = cli(gateway, "export", "--group", planted.group, "-o", str(target))
    ok(done)
    assert "exported 9 rollouts" in done.stderr
    lines = [json.loads(line) for line in target.read_text().splitlines()]
    assert [line["rollout"]["rollout_id"] for line in lines] == [planted.id(c) for c in CASES]
    with GatewayClient(gateway.url, gateway.token) as admin:
        for line in lines:
            rid = line["rollout"]["rollout_id"]
            stored = admin.get_events(rid)
            assert [Event.model_validate(e) for e in line["events"]] == stored
            assert Rollout.model_validate(line["rollout"]) == admin.get_rollout(rid).model_copy(
                update={"attempt_key": None, "report_key": None}
            )
            # The agent's keys are credentials: they never reach the file.
            record = admin.get_rollout(rid)
            for key in (record.attempt_key, record.report_key):
                assert key and key not in target.read_text()
    kinds = {e["type"] for line in lines for e in line["events"]}
    assert kinds == {"model_request", "model_request_failed", "reward"}

    stdout = ok(cli(gateway, "export", "--group", planted.group, "--min-reward", "1", "-o", "-"))
    exported = [json.loads(line)["rollout"]["rollout_id"] for line in stdout.splitlines()]
    assert planted.cases(exported) == ["clean", "nocalls", "val"]


def test_export_pages_through_many_rollouts(gateway: GatewayProcess, tmp_path: Path) -> None:
    group = f"bulk-{uuid.uuid4().hex[:6]}"
    n = 2 * PAGE + 50
    with GatewayClient(gateway.url, gateway.token) as admin:
        admin.create_rollouts([{"rollout_id": f"{group}-{i}", "group_id": group} for i in range(n)])
    target = tmp_path / "bulk.jsonl"
    ok(cli(gateway, "export", "--group", group, "-o", str(target)))
    exported = [json.loads(line)["rollout"]["rollout_id"] for line in target.open()]
    assert exported == [f"{group}-{i}" for i in range(n)]


class PagedClient:
    """Answers pages of rollouts and their events, and counts what was asked."""

    def __init__(self, n: int) -> None:
        self.rollouts = [
            Rollout(
                rollout_id=f"r{i}",
                group_id="g",
                input=None,
                mode="train",
                metadata={},
                max_attempts=1,
                timeout_s=None,
                status="succeeded",
                attempt=1,
                version=1,
                created_at=0.0,
                updated_at=0.0,
            )
            for i in range(n)
        ]
        self.pages = self.event_reads = 0

    async def list_rollouts_page(
        self, status: object, mode: object, group_id: object, cursor: str | None, limit: int
    ) -> tuple[list[Rollout], str | None]:
        start = int(cursor or 0)
        self.pages += 1
        end = start + limit
        return self.rollouts[start:end], (str(end) if end < len(self.rollouts) else None)

    async def get_events(self, rollout_id: str) -> list[Event]:
        self.event_reads += 1
        return []


def test_matching_holds_one_page_at_a_time() -> None:
    client = PagedClient(10 * PAGE)

    async def consume() -> int:
        seen = 0
        async for _rollout, _events in matching(client, Filters()):  # type: ignore[arg-type]
            # Pages are read as the rollouts are consumed, never ahead.
            assert client.pages == seen // PAGE + 1
            assert client.event_reads == client.pages * PAGE
            seen += 1
        return seen

    assert asyncio.run(consume()) == 10 * PAGE and client.pages == 10


# ---------------------------------------------------------------------------------- scan

RULES = '''
def flag_asked(rollout, events):
    """A user's rule: the input asks for a look."""
    return ["input asks to be flagged"] if (rollout.input or {}).get("flag") else []


def many_calls(rollout, events):
    calls = [e for e in events if e.type == "model_request"]
    return [f"{len(calls)} model calls"] if len(calls) >= 2 else []


RULES = [flag_asked, many_calls]
'''


def scanned(out: str, planted: Planted) -> dict[str, str]:
    flagged = dict(line.split("  ", 1) for line in out.splitlines())
    return {planted.cases([rid])[0]: reasons for rid, reasons in flagged.items()}


def test_scan_flags_exactly_the_planted_cases(gateway: GatewayProcess, planted: Planted) -> None:
    done = cli(gateway, "scan", "--group", planted.group)
    flagged = scanned(ok(done), planted)
    assert sorted(flagged) == sorted(["curl", "gitlog", "repeat", "length", "nocalls", "failed"])
    assert flagged["curl"] == "attempt 1 call 0: 'curl' in its response"
    assert flagged["gitlog"] == "attempt 1 call 0: 'git log' in its tool call"
    assert flagged["repeat"] == "attempt 1 call 1: the same messages as the call before"
    assert flagged["length"] == "attempt 1 call 0: cut at max tokens"
    assert flagged["nocalls"] == "attempt 1: reward 1.0 with no model call"
    assert flagged["failed"].startswith("attempt 1: a call failed (400: ")
    assert "scanned 9 rollouts, flagged 6" in done.stderr


def test_scan_patterns_replace_the_defaults(gateway: GatewayProcess, planted: Planted) -> None:
    out = ok(cli(gateway, "scan", "--group", planted.group, "--pattern", r"turn\s3"))
    flagged = scanned(out, planted)
    # The second answer of a two-turn game is "turn 3: ok"; curl and git log no longer count.
    assert flagged["clean"] == flagged["val"] == "attempt 1 call 1: 'turn 3' in its response"
    assert "curl" not in flagged and "gitlog" not in flagged
    assert sorted(flagged) == sorted(["clean", "val", "repeat", "length", "nocalls", "failed"])


def test_scan_runs_a_users_rules(gateway: GatewayProcess, planted: Planted, tmp_path: Path) -> None:
    (tmp_path / "my_rules.py").write_text(RULES)
    env = {"PYTHONPATH": str(tmp_path)}
    out = ok(cli(gateway, "scan", "--group", planted.group, "--rules", "my_rules:RULES", env=env))
    flagged = scanned(out, planted)
    assert flagged["val"] == "input asks to be flagged; 2 model calls"
    assert flagged["clean"] == "2 model calls"
    assert flagged["repeat"].endswith("the same messages as the call before; 2 model calls")
    out = ok(
        cli(gateway, "scan", "--group", planted.group, "--rules", "my_rules:flag_asked", env=env)
    )
    assert scanned(out, planted)["val"] == "input asks to be flagged"
    assert "clean" not in scanned(out, planted)
    (tmp_path / "bad_rules.py").write_text("def broken(rollout, events):\n    1 / 0\n")
    one_line_error(
        cli(gateway, "scan", "--group", planted.group, "--rules", "bad_rules:broken", env=env),
        f"rule broken failed on {planted.id('clean')}: ZeroDivisionError",
    )


def test_malformed_events_do_not_break_the_tool(gateway: GatewayProcess) -> None:
    """Agents write events too: a model_request without logprobs, a reward that is not a
    number, an event of their own."""
    group = f"odd-{uuid.uuid4().hex[:6]}"
    with GatewayClient(gateway.url, gateway.token) as admin:
        admin.create_rollouts([{"rollout_id": group, "group_id": group}])
        r = admin.patch_rollout(group, "running")
        admin.post_event(
            group, r.attempt, "model_request", {"prompt_ids": [1], "response_ids": [2]}
        )
        admin.post_event(group, r.attempt, "reward", {"value": "high"})
        admin.post_event(group, r.attempt, "note", ["free", "form"])
    out = ok(cli(gateway, "show", group))
    assert "  call 0 (left out: logprobs_length): policy v?, None, ? s, 1 prompt + 1 resp" in out
    assert "reward high" in out and 'event note: ["free", "form"]' in out
    assert ids_of(ok(cli(gateway, "ls", "--group", group))) == [group]
    ok(cli(gateway, "scan", "--group", group))


# -------------------------------------------------------------------------------- errors


def one_line_error(done: subprocess.CompletedProcess[str], message: str) -> None:
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith("agl.rollouts: ") and message in done.stderr, done.stderr


@pytest.mark.slow
def test_errors_are_one_line(gateway: GatewayProcess, planted: Planted, tmp_path: Path) -> None:
    dead = Endpoint(f"http://127.0.0.1:{free_port()}", gateway.token)
    one_line_error(cli(dead, "ls"), f"cannot reach the gateway at {dead.url}")
    one_line_error(cli(gateway, "ls", env={"AGL_ADMIN_TOKEN": "wrong"}), "refused the admin token")
    one_line_error(
        cli(gateway, "show", "no-such-rollout"), "rollout 'no-such-rollout' does not exist"
    )
    no_token = {k: v for k, v in os.environ.items() if k != "AGL_ADMIN_TOKEN"}
    done = subprocess.run(
        [sys.executable, "-m", "agl.rollouts", "ls", "--gateway", gateway.url],
        capture_output=True,
        text=True,
        env=no_token,
        timeout=60,
    )
    one_line_error(done, "no admin token")
    one_line_error(
        cli(gateway, "show", planted.id("clean"), "--run", str(tmp_path)),
        f"{tmp_path} is not a run folder: it has no config.yaml",
    )
    one_line_error(cli(gateway, "scan", "--rules", "no_such_module:RULES"), "cannot import")
    one_line_error(cli(gateway, "ls", "--status", "done"), "--status done: choose from")
    one_line_error(cli(gateway, "export", "-o", str(tmp_path / "no" / "f.jsonl")), "cannot write")


def test_token_file(gateway: GatewayProcess, planted: Planted, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text(gateway.token + "\n")
    out = ok(
        cli(
            gateway,
            "ls",
            "--group",
            planted.group,
            "--token-file",
            str(token),
            env={"AGL_ADMIN_TOKEN": "wrong"},
        )
    )
    assert len(ids_of(out)) == len(CASES)


# ------------------------------------------------------------------- pure helpers


def test_step_and_spelling() -> None:
    base = PagedClient(1).rollouts[0]
    assert step_of(base) is None
    assert step_of(base.model_copy(update={"metadata": {"batch": 4}})) == 5
    assert step_of(base.model_copy(update={"metadata": {"step": 4}})) == 4
    # The store's rule (ls --step filters there): a boolean is not a step.
    assert step_of(base.model_copy(update={"metadata": {"step": True, "batch": 2}})) == 3
    assert step_of(base.model_copy(update={"metadata": {"batch": False}})) is None
    assert spell([" h", "aving", "\n"]) == "␣h|aving|↵"


# -------------------------------------------------------------- a real run (show --run)


@pytest.fixture(scope="module")
def real_run(
    short_run: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Path, GatewayProcess]]:
    """The shared short run (tests/conftest.py), a copy of its store served again: a
    gateway writes to its store, and other processes read the run."""
    store = tmp_path_factory.mktemp("real_run") / "gateway"
    shutil.copytree(short_run / "gateway", store)
    with gateway_process(store) as gw:
        yield short_run, gw


@pytest.mark.slow
def test_load_run_builds_what_the_run_trained_with(
    real_run: tuple[Path, GatewayProcess], tmp_path: Path
) -> None:
    folder, _ = real_run
    run = load_run(folder)
    assert run.choices == {
        "merge": "prefix",
        "advantage": "rollout",
        "loss": "rollout_mean",
        "mode": "sync",
        "model": "tiny",
        "task": "guess",
    }
    merge = run.merge()
    assert merge.merge is get("merge", "prefix") and merge.decode is not None
    assert run.advantage().keywords == {"estimator": "grpo", "scale": True}  # type: ignore[attr-defined]
    decode = run.decode_token()
    assert decode is not None and decode(85) == merge.decode([85]) == "m"


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (None, "is not a run folder: it has no config.yaml"),
        ("merge: [\n", "cannot be read: while parsing"),
        ("- a list\n", "is not a run's config: not a mapping"),
        ("merge: {name: prefix}\n", "is not a run's config: it has no advantage.name"),
        (
            "merge: {name: zip}\nadvantage: {name: rollout}\nloss: {name: token_mean}\n"
            "model: {name: tiny}\ntask: {name: guess}\ntrainer: {mode: sync}\n",
            "unknown merge strategy 'zip'; registered: independent, prefix, stitch, tree",
        ),
    ],
)
def test_load_run_refuses_what_is_not_a_run(
    tmp_path: Path, config: str | None, message: str
) -> None:
    if config is not None:
        (tmp_path / "config.yaml").write_text(config)
    with pytest.raises(RunFolderError) as refused:
        load_run(tmp_path)
    assert message in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.slow
def test_ls_step_selects_a_training_step(real_run: tuple[Path, GatewayProcess]) -> None:
    _, gw = real_run
    step1 = ids_of(ok(cli(gw, "ls", "--step", "1")))
    # Step 1 trained on batch 0 (4 groups x 8) and validated 4 games, and 4 of the uniform
    # validation set (task.val_sets.uniform).
    val = [f"v{{}}.{i}" for i in range(4)] + [f"v{{}}.uniform.{i}" for i in range(4)]
    assert sorted(step1) == sorted(
        [f"t0.{j}.{k}" for j in range(4) for k in range(8)] + [v.format(1) for v in val]
    )
    assert sorted(ids_of(ok(cli(gw, "ls", "--step", "0")))) == sorted(v.format(0) for v in val)


@pytest.fixture(scope="module")
def explained(real_run: tuple[Path, GatewayProcess]) -> dict[str, Explanation]:
    """Each finished rollout of the run, explained under the run's merge (in process)."""
    folder, gw = real_run
    run = load_run(folder)
    merge, decode = run.merge(), run.decode_token()
    with GatewayClient(gw.url, gw.token) as admin:
        out = {
            r.rollout_id: explain(calls_from_events(admin.get_events(r.rollout_id)), merge, decode)
            for r in admin.list_rollouts(status="succeeded")
        }
    # The game never retries a call, so deduplicated indices are the CLI's call numbers.
    assert all(x.duplicates_dropped == 0 for x in out.values())
    return out


@pytest.mark.slow
def test_show_run_explains_a_real_retokenization(
    real_run: tuple[Path, GatewayProcess], explained: dict[str, Explanation], tmp_path: Path
) -> None:
    folder, gw = real_run
    # BPE-dropout makes a pure retokenization in ~10% of the run's 76 rollouts.
    rollout_id, detail = next(
        (rid, b)
        for rid, x in explained.items()
        for b in x.breaks
        if b.reason is BreakReason.RESPONSE_RETOKENIZED and b.same_text
    )
    out = ok(cli(gw, "show", rollout_id, "--run", str(folder)))
    assert re.search(r"samples \(merge prefix, attempt 1\): \d+ from \d+ calls", out)
    assert f"call {detail.call}'s prompt left the previous sequence at token {detail.at}" in out
    assert "the response came back as the same text, tokenized differently" in out
    previous = out.split("      previous: ")[1].splitlines()[0]
    prompt = out.split("      prompt:   ")[1].splitlines()[0]
    # Side by side: the same shared context, then the two segmentations of one text.
    assert previous.split(" [")[0] == prompt.split(" [")[0]
    differing = [line.split(" [", 1)[1].rstrip("]") for line in (previous, prompt)]
    assert differing[0] != differing[1]
    assert differing[0].replace("|", "") == differing[1].replace("|", "")
    assert "stitched" not in out

    # The same rollout under stitch (the run's config with another merge): one sample,
    # and the call whose prompt stitching changed.
    stitch_run = tmp_path / "stitch-run"
    stitch_run.mkdir()
    config = yaml.safe_load((folder / "config.yaml").read_text())
    config["merge"] = {"name": "stitch"}
    (stitch_run / "config.yaml").write_text(yaml.safe_dump(config))
    out = ok(cli(gw, "show", rollout_id, "--run", str(stitch_run)))
    assert "samples (merge stitch, attempt 1): 1 from" in out and "break before" not in out
    assert f"stitched: call {detail.call} is trained under another prompt" in out
    recorded = out.split("      recorded: ")[1].splitlines()[0]
    trained = out.split("      trained:  ")[1].splitlines()[0]
    assert recorded != trained and recorded.replace("|", "") == trained.replace("|", "")


@pytest.mark.slow
def test_scan_run_flags_where_the_merge_broke(
    real_run: tuple[Path, GatewayProcess], explained: dict[str, Explanation]
) -> None:
    folder, gw = real_run
    out = ok(cli(gw, "scan", "--status", "succeeded", "--run", str(folder)))
    flagged = dict(line.split("  ", 1) for line in out.splitlines())
    broken = {rid for rid, x in explained.items() if x.breaks}
    assert broken and {rid for rid, r in flagged.items() if "prefix breaks" in r} == broken
    for rid in broken:
        for b in explained[rid].breaks:
            same = ", same text" if b.same_text else ""
            assert f"prefix breaks before call {b.call} ({b.reason.value}{same})" in flagged[rid]
