"""The general agent's warm-up: the format and the copies, not the strategy.

As the search agent's (``experiments.search.warmup``, whose reasons hold here): the
harness itself plays questions about places invented for each question against a
scripted player, and the model learns each episode's whole text (``loss="all"``) or the
replies only. The sandbox is simulated (``SimulatedComputer``): ``grep -Fw`` over the
real tables with the episode's invented rows among their matches, and the files written
in memory, so a step costs no process.

The tables it greps hold no held-out country's row nor its cities' (``warmup_tables``):
an invented name can match a real line as a word, and the model learns what the grep
prints, so over the whole tables it would read the rows validation questions are
answered by.

The scripted player, at the first call, either reads the tables or answers at once:

- reading, it greps the table the question needs for the name it asks about (then, for
  a two-hop question, ``countries.tsv`` for the country found), writes the answer the
  matching line gives to ``output/answer.txt`` and submits;
- otherwise it writes a guess (the answer to another question of the step) and submits.

Every question of a step is played reading, and the guesses are extra episodes, as many
as make the first call read with probability ``search_share``. The warmed model can use
the computer and copy what it finds, knows no real place, and reads the tables only some
of the time: learning to read before answering is left to RL.
"""

from __future__ import annotations

import json
import random
import shlex
import time
from collections.abc import Sequence
from typing import Any

import torch

from agl.backends.inference.server.tools import parse_tool_calls
from experiments.general.harness import (
    ANSWER_FILE,
    BASH,
    EDITOR,
    SUBMIT,
    Message,
    Options,
    Reply,
    play,
)
from experiments.general.sandbox import INPUT, CommandResult
from experiments.general.tables import CITIES, COUNTRIES, city_line, country_line, grep_words
from experiments.general.tables import table_lines as real_tables
from experiments.guess.warmup import Batch, DropoutBPE, at_once, masked_batch, trained
from experiments.search.baselines import echo
from experiments.search.facts import World, world
from experiments.search.harness import Question
from experiments.search.invented import Invented
from experiments.search.warmup import check_options, copy_batches, episode_rows, step_episodes

# Measured on 2 CPU cores (README).
STEPS = 900
QUESTIONS_PER_STEP = 8
LR = 3e-3
SEARCH_SHARE = 0.5
# Each step also learns this many of the search agent's warm-up episodes (every one
# searched): rows of ~130 tokens that teach the same copies as this task's of ~550 (a
# tools prompt is long in the tiny model's BPE), as a pretrained model has read text of
# every layout. 0: none.
COPY_QUESTIONS_PER_STEP = 32


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """A tool call as the model writes it: the chat template's own layout, so the next
    prompt renders it back token for token."""
    body = json.dumps(arguments, ensure_ascii=False)
    return f'<tool_call>\n{{"name": "{name}", "arguments": {body}}}\n</tool_call>'


def quoted(text: str) -> str:
    """``text`` in single quotes for the shell, always (one layout to learn, spaces or
    not)."""
    return "'" + text.replace("'", "'\"'\"'") + "'"


def answer_call(answer: str, tools: Sequence[str]) -> str:
    """Writing ``answer`` to the answer file: with the editor when it is offered, else
    with ``echo``."""
    if EDITOR in tools:
        arguments = {"command": "create", "path": ANSWER_FILE, "file_text": answer}
        return tool_call_text(EDITOR, arguments)
    return tool_call_text(BASH, {"command": f"echo {quoted(answer)} > {ANSWER_FILE}"})


def grep_call(name: str, table: str) -> str:
    return tool_call_text(BASH, {"command": f"grep -Fw {quoted(name)} {INPUT}/{table}"})


def plan(q: dict[str, Any], search: bool, guess: str, tools: Sequence[str]) -> list[str]:
    """The scripted replies to question ``q``."""
    submit = tool_call_text(SUBMIT, {})
    if not search:
        return [answer_call(guess, tools), submit]
    name = echo(q["question"])
    greps = [grep_call(name, COUNTRIES if q["kind"] == "capital" else CITIES)]
    if q["kind"] == "two_hop":
        greps.append(grep_call(q["via"], COUNTRIES))
    return [*greps, answer_call(q["answers"][0], tools), submit]


class SimulatedComputer:
    """The sandbox as the scripted player uses it: ``grep -Fw NAME input/TABLE`` over the
    real table's lines and ``extra`` lines (the invented places', each put at a random
    place among the matches), ``echo TEXT > FILE``, and files kept in memory."""

    def __init__(
        self, tables: dict[str, list[str]], extra: dict[str, list[str]], rng: random.Random
    ) -> None:
        self.tables, self.extra, self.rng = tables, extra, rng
        self.files: dict[str, str] = {}

    async def run(self, command: str, timeout: float) -> CommandResult:
        argv = shlex.split(command)
        if len(argv) == 4 and argv[:2] == ["grep", "-Fw"]:
            table = argv[3].removeprefix(f"{INPUT}/")
            found = grep_words(self.tables[table], argv[2])
            for line in grep_words(self.extra.get(table, []), argv[2]):
                found.insert(self.rng.randint(0, len(found)), line)
            output = "".join(f"{line}\n" for line in found)
            return CommandResult(0 if found else 1, output, False, False)
        if len(argv) == 4 and argv[0] == "echo" and argv[2] == ">":
            self.files[argv[3]] = argv[1] + "\n"
            return CommandResult(0, "", False, False)
        raise ValueError(f"the scripted player ran {command!r}, which is not simulated")

    async def read(self, path: str, limit: int = 1 << 16) -> str:
        if path not in self.files:
            raise FileNotFoundError(path)
        return self.files[path][:limit]

    async def write(self, path: str, text: str) -> None:
        self.files[path] = text


def invented_rows(place: Invented) -> dict[str, list[str]]:
    """The table lines of a question's invented places."""
    cities = [city_line(place.city)] if place.city else []
    return {COUNTRIES: [country_line(place.country)], CITIES: cities}


def episode_calls(
    tokenizer: Any,
    q: dict[str, Any],
    replies: list[str],
    options: Options,
    computer: SimulatedComputer,
) -> list[tuple[list[int], str]]:
    """Every call the harness makes for ``q`` when the model answers ``replies``: the
    prompt's ids as the server renders them (with the tools) and the reply's text."""
    script = iter(replies)
    calls: list[tuple[list[int], str]] = []

    async def ask(messages: list[Message], tools: list[dict[str, Any]]) -> Reply:
        reply = next(script)
        text = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False
        )
        calls.append((tokenizer.encode(text, add_special_tokens=False), reply))
        parsed = parse_tool_calls(reply)
        assert parsed is not None, reply
        return Reply(parsed[0], parsed[1], "stop")

    at_once(play(Question.from_input(q), options, ask, computer), "a scripted episode")
    return calls


def warmup_tables(places: World) -> dict[str, list[str]]:
    """The tables the warm-up's simulated computer greps: the real ones without the
    held-out countries' rows and their cities' (``World.held_out``), in the real order.
    An invented name can match a real line as a word ("Athi" in "Athi River"), and the
    model learns every line a grep prints: over the whole tables the warm-up showed the
    answering rows of validation questions. Here no transcript shows a row that any
    validation question (of any size or kind) is answered by."""
    kept = tuple(c for c in places.countries if not places.held_out(c))
    cities = tuple(c for c in places.cities if not places.held_out(c.country))
    return real_tables(World(kept, cities))


def scripted_episode(
    tokenizer: Any,
    place: Invented,
    guess: str | None,
    tables: dict[str, list[str]],
    options: Options,
    rng: random.Random,
) -> list[tuple[list[int], str]]:
    """One warm-up episode's calls: ``place``'s question read (``guess`` None) or
    answered at once with ``guess``, over ``tables`` and the place's invented rows."""
    replies = plan(place.question, guess is None, guess or "", options.tools)
    computer = SimulatedComputer(tables, invented_rows(place), rng)
    return episode_calls(tokenizer, place.question, replies, options, computer)


def warm_up(
    model: torch.nn.Module,
    tokenizer: Any,
    *,
    steps: int = STEPS,
    questions_per_step: int = QUESTIONS_PER_STEP,
    lr: float = LR,
    seed: int = 0,
    search_share: float = SEARCH_SHARE,
    loss: str = "all",
    copy_questions_per_step: int = COPY_QUESTIONS_PER_STEP,
    kinds: dict[str, float] | None = None,
    **options: Any,
) -> dict[str, float]:
    """Train ``model`` in place (the module's docstring); ``options`` are the harness's
    (``Options``) and whatever else the task passes. Answers the losses and seconds."""
    check_options(steps, questions_per_step, search_share, loss)
    harness = Options.from_input(options)
    start = time.perf_counter()
    tables = warmup_tables(world())
    rng = random.Random(f"general-warmup:{seed}")
    segment = DropoutBPE(tokenizer, 0.0, rng)  # canonical: p = 0 draws nothing

    def batch() -> Batch:
        rows = []
        for place, guess in step_episodes(rng, questions_per_step, search_share, kinds):
            calls = scripted_episode(tokenizer, place, guess, tables, harness, rng)
            rows += episode_rows(tokenizer, calls, segment, loss)
        return masked_batch(tokenizer, rows)

    parts = [batch]
    if copy_questions_per_step:
        parts.append(copy_batches(tokenizer, seed, copy_questions_per_step, loss, kinds))
    return trained(model, parts, steps, lr, start)
