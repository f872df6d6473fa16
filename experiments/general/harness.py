"""A general agent in LLM-in-Sandbox's style: the model gets a computer (a sandbox with
the task's files and a shell, no network) and OpenAI tools to use it, and leaves its
answer in a file; the reward checks that file.

Tools (the names and arguments of LLM-in-Sandbox's, ``task.options.tools`` picks which
are offered):

- ``execute_bash(command)``: a bash command in the workspace; its output (at most
  ``output_chars`` of it) and a non-zero exit code come back;
- ``str_replace_editor(command, path, file_text?, old_str?, new_str?)``: ``view`` a file,
  ``create`` one, or ``str_replace`` a unique string in one;
- ``submit()``: the attempt is over.

The workspace holds ``input/`` (the task's files, read-only) and ``output/``; the answer
is ``output/answer.txt``, read when the model submits or runs out of turns, and scored
by exact match (or token F1) after SQuAD's normalisation, as the search agent is. A reply
with no tool call is told to call one and costs its turn.

The **condenser** (``condense_chars``): when the tool outputs the model would see add up
to more characters than this, every one but the last is replaced by a line saying how
many lines were elided, and stays so (LLM-in-Sandbox's and OpenHands' context
condensing, the paper's context summaries). It rewrites a prompt the model has seen: the
merge metrics show it.

Input keys: ``question``, ``answers`` (a string or a list of them), the input files
(``files``: name -> text, or ``context``: one text, as ``input/document.txt``; neither:
the GeoNames tables, ``experiments.general.tables``), the knobs of ``Options`` and
``workspaces`` (where the attempts' workspaces go).

The model's tools reach only its sandbox (``experiments.general.sandbox``): its own
namespaces, no network, no key, nothing of the run but its workspace; the harness reads
the answer through the sandbox too, so a link in ``output/`` leads nowhere the agent
could not go itself. Runs as a worker entry point (``run(env)``), as ``python -m
experiments.general.harness``, or as a Kubernetes Job's ``python -m agl.agent``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import tempfile
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol

import openai

from agl.agent.harness import Attempt, AttemptFailed, Outcome, run_command, run_episode
from experiments.general.sandbox import (
    INPUT,
    OUTPUT,
    CommandResult,
    Sandbox,
    SandboxError,
    make_workspace,
)
from experiments.general.tables import CITIES, COUNTRIES, write_tables
from experiments.search.answers import REWARDS, exact_match, f1_score, reward_of
from experiments.search.harness import Question, SearchInputError
from experiments.swe.sandbox import ROOT, SandboxUnavailable

ANSWER_FILE = f"{OUTPUT}/answer.txt"
ANSWER_CHARS = 1000  # of the answer file read for the reward
MAX_INPUT_CHARS = 16 << 20  # of a record's own input files
CONTEXT_FILE = "document.txt"  # a record's context, in input/

BASH, EDITOR, SUBMIT = "execute_bash", "str_replace_editor", "submit"
TOOL_SPECS: dict[str, dict[str, Any]] = {
    BASH: {
        "description": "Run a bash command in the workspace; its output comes back.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
    },
    EDITOR: {
        "description": "View a file, create one, or replace a unique string in one.",
        "parameters": {
            "type": "object",
            "properties": {
                "command": {"type": "string", "enum": ["view", "create", "str_replace"]},
                "path": {"type": "string"},
                "file_text": {"type": "string"},
                "old_str": {"type": "string"},
                "new_str": {"type": "string"},
            },
            "required": ["command", "path"],
        },
    },
    SUBMIT: {
        "description": "Finish: the answer is in output/answer.txt.",
        "parameters": {"type": "object", "properties": {}},
    },
}

# The CPU-scale prompt: short, for a model of 2 layers and a 2k context.
SHORT_PROMPT = (
    f"Answer from the tables in {INPUT}/: {COUNTRIES} (country, capital, continent) and "
    f"{CITIES} (city, country). Write the answer to {ANSWER_FILE}, then submit.\n"
    "Question: {question}"
)
# LLM-in-Sandbox's layout of a task, for models that follow instructions.
SANDBOX_PROMPT = (
    "You are working in a sandbox: a computer with a bash shell and no network. The task's "
    f"files are in {INPUT}/ in your working directory: {{files}}. Use execute_bash to run "
    "commands (search a large file rather than reading it whole), str_replace_editor to "
    f"view and create files, and write the final answer alone, in plain text, to "
    f"{ANSWER_FILE}. Then call submit.\n\nQuestion: {{question}}"
)
FILE_NOTES = {
    COUNTRIES: "tab-separated: country, capital, continent",
    CITIES: "tab-separated: city, country",
}
PROMPTS = {"short": SHORT_PROMPT, "sandbox": SANDBOX_PROMPT}
NO_TOOL = f"Call a tool: {BASH}, {EDITOR} or {SUBMIT}."

Message = dict[str, Any]


@dataclass(frozen=True)
class Reply:
    """What the model answered: its text and its tool calls as the server parsed them
    (OpenAI's ``{"id", "type", "function": {"name", "arguments"}}``)."""

    content: str | None
    tool_calls: list[dict[str, Any]]
    finish_reason: str | None = None


# (messages, tools) -> the model's reply
Ask = Callable[[list[Message], list[dict[str, Any]]], Awaitable[Reply]]


class Computer(Protocol):
    """What the agent's tools act on: ``Sandbox``, or the warm-up's simulation."""

    async def run(self, command: str, timeout: float) -> CommandResult: ...

    async def read(self, path: str, limit: int = ...) -> str: ...

    async def write(self, path: str, text: str) -> None: ...


@dataclass(frozen=True)
class Options:
    tools: tuple[str, ...] = (BASH, EDITOR, SUBMIT)
    max_turns: int = 8
    command_timeout_s: float = 10.0
    output_chars: int = 600  # of a command's output, or a viewed file, shown to the model
    condense_chars: int = 0  # elide older tool outputs past this many characters (0: never)
    prompt: str = "sandbox"
    reward: str = "em"
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 512
    workspaces: str = ""  # where the attempts' workspaces go; "": the system's temp folder

    def __post_init__(self) -> None:
        unknown = [t for t in self.tools if t not in TOOL_SPECS]
        if unknown or SUBMIT not in self.tools or len(set(self.tools)) != len(self.tools):
            raise SearchInputError(
                f"tools {list(self.tools)}: distinct names of {list(TOOL_SPECS)}, with {SUBMIT}"
            )
        if self.reward not in REWARDS:
            raise SearchInputError(f"reward {self.reward!r}: choose one of {sorted(REWARDS)}")
        if self.prompt not in PROMPTS:
            raise SearchInputError(f"prompt {self.prompt!r}: choose one of {sorted(PROMPTS)}")
        if min(self.max_turns, self.output_chars, self.max_tokens) < 1 or self.condense_chars < 0:
            raise SearchInputError(
                "max_turns, output_chars and max_tokens are at least 1, condense_chars >= 0"
            )
        if self.command_timeout_s <= 0:
            raise SearchInputError("command_timeout_s must be positive")

    @classmethod
    def from_input(cls, data: Mapping[str, Any]) -> Options:
        values: dict[str, Any] = {}
        try:
            for f in fields(cls):
                if f.name not in data:
                    continue
                value = data[f.name]
                if f.name == "tools":
                    if isinstance(value, str) or not isinstance(value, Sequence):
                        raise SearchInputError("tools must be a list of tool names")
                    values["tools"] = tuple(str(v) for v in value)
                else:
                    kind = {"int": int, "float": float, "str": str}[str(f.type)]
                    values[f.name] = kind(value)
            return cls(**values)
        except (TypeError, ValueError) as error:
            if isinstance(error, SearchInputError):
                raise
            raise SearchInputError(str(error)) from None

    def tool_schemas(self) -> list[dict[str, Any]]:
        return [{"type": "function", "function": {"name": n, **TOOL_SPECS[n]}} for n in self.tools]


# ------------------------------------------------------------------------- the tools


def shown(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, saying how many more there were."""
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n[... {len(text) - limit} more characters]"


def command_text(result: CommandResult, limit: int) -> str:
    """A command's result as the model sees it."""
    text = shown(result.output, limit)
    if result.truncated:
        text += "\n[output cut]"
    if result.timed_out:
        text += "\n[timed out]"
    elif result.exit != 0:
        text += f"\n[exit code {result.exit}]"
    return text.strip("\n") or "[no output]"


async def use_tool(
    name: str, arguments: Mapping[str, Any], computer: Computer, options: Options
) -> str:
    """What one tool call does and says; a bad call says what is wrong (the agent's
    error, shown to it, as a shell would)."""
    if name not in options.tools:
        return f"Unknown tool {name!r}; the tools are {', '.join(options.tools)}."
    if name == BASH:
        command = arguments.get("command")
        if not isinstance(command, str) or not command.strip():
            return f"{BASH} needs a command."
        result = await computer.run(command, options.command_timeout_s)
        return command_text(result, options.output_chars)
    if name == EDITOR:
        return await _edit(arguments, computer, options)
    return "Submitted."


async def _edit(arguments: Mapping[str, Any], computer: Computer, options: Options) -> str:
    command, path = arguments.get("command"), arguments.get("path")
    if not isinstance(path, str) or not path:
        return f"{EDITOR} needs a path."
    try:
        if command == "view":
            return shown(await computer.read(path), options.output_chars) or "[empty file]"
        if command == "create":
            text = arguments.get("file_text")
            if not isinstance(text, str):
                return f"{EDITOR} create needs file_text."
            await computer.write(path, text)
            return f"Created {path}."
        if command == "str_replace":
            old, new = arguments.get("old_str"), arguments.get("new_str", "")
            if not isinstance(old, str) or not old or not isinstance(new, str):
                return f"{EDITOR} str_replace needs old_str (and new_str)."
            text = await computer.read(path)
            if text.count(old) != 1:
                return f"old_str occurs {text.count(old)} times in {path}, not once."
            await computer.write(path, text.replace(old, new))
            return f"Edited {path}."
    except OSError as error:
        return f"{EDITOR}: {error}"
    return f"{EDITOR}'s command is view, create or str_replace, not {command!r}."


# ------------------------------------------------------------------------ the loop


@dataclass
class History:
    """The conversation as it was, and what the condenser has elided of it."""

    messages: list[Message]
    elided: set[int] = field(default_factory=set)

    def shown(self, budget: int) -> list[Message]:
        """The messages the next call sees: past ``budget`` characters of tool output
        (0: no budget), every tool output but the last is elided, for good."""
        tools = [i for i, m in enumerate(self.messages) if m["role"] == "tool"]
        live = [i for i in tools if i not in self.elided]
        if budget and sum(len(self.messages[i]["content"]) for i in live) > budget:
            self.elided.update(live[:-1])
        return [
            {**m, "content": f"[{m['content'].count(chr(10)) + 1} lines of output elided]"}
            if i in self.elided
            else m
            for i, m in enumerate(self.messages)
        ]


@dataclass
class Episode:
    answer: str | None
    reward: float
    metrics: dict[str, float]


def _arguments(call: Mapping[str, Any]) -> tuple[str, dict[str, Any] | None]:
    function = call.get("function") or {}
    try:
        arguments = json.loads(function.get("arguments") or "{}")
    except ValueError:
        arguments = None
    return str(function.get("name")), arguments if isinstance(arguments, dict) else None


def opening(question: Question, files: Sequence[str], options: Options) -> Message:
    """The task as the model first sees it: the question and the input files' names."""
    names = ", ".join(f"{n} ({FILE_NOTES[n]})" if n in FILE_NOTES else n for n in files)
    text = PROMPTS[options.prompt].format(question=question.text, files=names)
    return {"role": "user", "content": text}


async def play(
    question: Question,
    options: Options,
    ask: Ask,
    computer: Computer,
    files: Sequence[str] = (CITIES, COUNTRIES),  # in input/, sorted as the harness lists them
) -> Episode:
    """One attempt: turns until ``submit`` or ``max_turns``, then the answer file read and
    scored. ``files`` are the names in ``input/``."""
    history = History([opening(question, files, options)])
    tools = options.tool_schemas()
    counts = {"commands": 0, "input_commands": 0, "edits": 0, "invalid_turns": 0}
    submitted = False
    turns = 0
    while turns < options.max_turns and not submitted:
        turns += 1
        reply = await ask(history.shown(options.condense_chars), tools)
        history.messages.append(
            {"role": "assistant", "content": reply.content, "tool_calls": reply.tool_calls}
            if reply.tool_calls
            else {"role": "assistant", "content": reply.content or ""}
        )
        if not reply.tool_calls:
            counts["invalid_turns"] += 1
            history.messages.append({"role": "user", "content": NO_TOOL})
            continue
        for call in reply.tool_calls:
            name, arguments = _arguments(call)
            if arguments is None:
                result = f"The arguments of {name} are not a JSON object."
            else:
                result = await use_tool(name, arguments, computer, options)
                counts["commands"] += name == BASH
                counts["input_commands"] += name == BASH and INPUT in str(arguments.get("command"))
                counts["edits"] += name == EDITOR
                submitted = submitted or name == SUBMIT
            history.messages.append(
                {"role": "tool", "tool_call_id": call.get("id", ""), "content": result}
            )
    try:
        answer: str | None = (await computer.read(ANSWER_FILE, ANSWER_CHARS)).strip()
    except OSError:
        answer = None
    reward = reward_of(options.reward, answer, question.answers)
    metrics = {
        **{k: float(v) for k, v in counts.items()},
        "turns": float(turns),
        "submitted": float(submitted),
        "answered": float(answer is not None),
        "read_input": float(counts["input_commands"] > 0),
        "elided": float(len(history.elided)),
        "exact_match": exact_match(answer, question.answers) if answer is not None else 0.0,
        "f1": f1_score(answer, question.answers) if answer is not None else 0.0,
    }
    return Episode(answer, reward, metrics)


# --------------------------------------------------------------------------- the agent


def openai_ask(client: openai.AsyncOpenAI, model: str, options: Options) -> Ask:
    async def ask(messages: list[Message], tools: list[dict[str, Any]]) -> Reply:
        completion = await client.chat.completions.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            tools=tools,  # type: ignore[arg-type]
            temperature=options.temperature,
            top_p=options.top_p,
            max_tokens=options.max_tokens,
        )
        choice = completion.choices[0]
        calls = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": call.function.arguments},
            }
            for call in choice.message.tool_calls or []
            if call.type == "function"
        ]
        return Reply(choice.message.content, calls, choice.finish_reason)

    return ask


def workspaces_root(options: Options) -> Path:
    return Path(options.workspaces or Path(tempfile.gettempdir()) / "agl-general").resolve()


@functools.cache
def tables_in(root: Path) -> dict[str, Path]:
    return write_tables(root / ".tables")


def hidden_from_sandbox(root: Path) -> tuple[Path, ...]:
    """Sealed where they would be, so that a reach for them is refused and shows in the
    audit (none of it is in the jail): every other attempt's workspace and the tables'
    folder, and this checkout (its run folders hold past rollouts' answers)."""
    return (root, ROOT)


async def run(env: Mapping[str, str]) -> None:
    """Answer the rollout's question in a sandbox of its own and report the reward."""
    await run_episode(env, _episode)


def input_files(data: Mapping[str, Any]) -> dict[str, str] | None:
    """The record's own input files, checked: ``files`` (name -> text), or ``context`` (a
    text, as ``document.txt``: Instruction Pre-Training's context, question, answer);
    None: the tables."""
    files = data.get("files")
    if files is None and "context" in data:
        files = {CONTEXT_FILE: data["context"]}
    if files is None:
        return None
    if not isinstance(files, Mapping) or not files:
        raise SearchInputError("'files' must map file names to their text")
    for name, text in files.items():
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise SearchInputError(f"an input file's name, not a path: {name!r}")
        if not isinstance(text, str):
            raise SearchInputError(f"input file {name!r}: its text must be a string")
    if sum(len(text) for text in files.values()) > MAX_INPUT_CHARS:
        raise SearchInputError(f"the input files hold more than {MAX_INPUT_CHARS} characters")
    return dict(files)


async def _episode(attempt: Attempt) -> Outcome:
    agent = attempt.agent
    question = Question.from_input(agent.input)
    options = Options.from_input(agent.input)
    texts = input_files(agent.input)
    ask = openai_ask(attempt.client, attempt.model, options)
    root = workspaces_root(options)
    name = f"{agent.rollout_id}.{agent.attempt}.{uuid.uuid4().hex[:8]}"
    try:
        files: Mapping[str, Path | str] = texts if texts is not None else tables_in(root)
        workspace = await asyncio.to_thread(make_workspace, root, name, files)
        async with await Sandbox.open(workspace, hidden_from_sandbox(root)) as sandbox:
            episode = await play(question, options, ask, sandbox, sorted(files))
    except (SandboxError, SandboxUnavailable, OSError) as error:
        raise AttemptFailed(f"sandbox: {error}") from error
    return Outcome(episode.reward, episode.metrics)


def main() -> None:
    """``python -m experiments.general.harness``: one attempt, from ``os.environ``."""
    run_command(run, "experiments.general.harness")


if __name__ == "__main__":
    main()
