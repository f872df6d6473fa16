"""A search agent that speaks Search-R1's protocol through the proxy: the model reasons,
searches with ``<search> query </search>``, reads the results the harness puts back as
``<information> ... </information>``, and ends with ``<answer> ... </answer>``; reward:
exact match (or token F1) of the answer against the gold answers (``answers.py``).

One model call per turn, up to ``max_turns``. Search-R1 appends the results to one growing
generation; through a chat proxy each turn is an assistant message (the model's search)
and a user message (the results), so every call's prompt holds the earlier ones. The
stop strings ``</search>`` and ``</answer>`` end a call. The harness asks for the text
with its stop string (``AS_SAMPLED``) and puts it into the history unchanged, so every
later prompt extends the tokens sampled before it, unless the template's text tokenizes
otherwise (retokenisation, which stitch mends). Special tokens stay skipped: a reply that
ended on the end-of-turn token does not hold it, and the chat template writes it after
the reply, as sampled (kept in the text, it would appear twice). The price is the rare
reply with a special token inside it (0.2% of rollouts for the warmed tiny model): its
text leaves the token out, and the next prompt breaks there. A reply with no closed tag
(a stop string with no opening one, a bare ``<search>`` ended by end-of-turn) is a
format error as written: it gets Search-R1's "invalid action" message and costs its
turn; no tag is added.

``history`` is how the harness shows the conversation to the next call, as real harnesses
rewrite their own context:

- ``full``: every message as it was (each call extends the one before);
- ``short``: results older than the last search shortened to their titles;
- ``window``: the question and the last ``window`` turns only.

``short`` and ``window`` rewrite an earlier prompt, so the next call no longer extends
the sequence before it: the merge metrics show it (README).

Input keys: ``question``, ``answers`` (a list of strings, or one string), and the knobs of
``Options`` (``topk``, ``max_turns``, ``history``, ``window``, ``reward``, ``prompt``,
``temperature``, ``top_p``, ``max_tokens``), and ``retriever_url`` (the run's retriever,
``task.services``).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import httpx
import openai

from agl.agent.harness import Attempt, AttemptFailed, BadInput, Outcome, run_command, run_episode
from experiments.search.answers import REWARDS, exact_match, f1_score, reward_of

SEARCH_END = "</search>"
ANSWER_END = "</answer>"
STOPS = (SEARCH_END, ANSWER_END)
_SEARCH = re.compile(r"<search>(.*?)</search>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)

# The CPU-scale prompt: short, for a model of 2 layers and a 2k context.
SHORT_PROMPT = (
    "Search with <search> query </search>, answer with <answer> answer </answer>.\n"
    "Question: {question}"
)
# Search-R1's instruction (its make_prefix), for models that follow instructions.
SEARCH_R1_PROMPT = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> "
    "first every time you get new information. After reasoning, if you find you lack some "
    "knowledge, you can call a search engine by <search> query </search> and it will "
    "return the top searched results between <information> and </information>. You can "
    "search as many times as your want. If you find no further external knowledge needed, "
    "you can directly provide the answer inside <answer> and </answer>, without detailed "
    "illustrations. For example, <answer> Beijing </answer>. Question: {question}\n"
)
PROMPTS = {"short": SHORT_PROMPT, "search_r1": SEARCH_R1_PROMPT}
INVALID = (
    "My previous action is invalid. If I want to search, I should put the query between "
    "<search> and </search>. If I want to give the final answer, I should put the answer "
    "between <answer> and </answer>. Let me try again."
)
HISTORIES = ("full", "short", "window")
# The text with the stop string it ended on (vLLM's default cuts it); the proxy records
# this rule with each call and the trainer checks the ids under it.
AS_SAMPLED = {"include_stop_str_in_output": True}

Message = dict[str, Any]
Hit = dict[str, Any]
# (messages, max_tokens) -> the reply's text as sampled, its stop string included
Ask = Callable[[list[Message], int], Awaitable[str]]
Retrieve = Callable[[str, int], Awaitable[list[Hit]]]


class SearchInputError(BadInput):
    pass


@dataclass(frozen=True)
class Options:
    topk: int = 3
    max_turns: int = 4
    history: str = "full"
    window: int = 1
    reward: str = "em"
    prompt: str = "search_r1"
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 500

    def __post_init__(self) -> None:
        if self.history not in HISTORIES:
            raise SearchInputError(f"history {self.history!r}: choose one of {HISTORIES}")
        if self.reward not in REWARDS:
            raise SearchInputError(f"reward {self.reward!r}: choose one of {sorted(REWARDS)}")
        if self.prompt not in PROMPTS:
            raise SearchInputError(f"prompt {self.prompt!r}: choose one of {sorted(PROMPTS)}")
        if self.topk < 1 or self.max_turns < 1 or self.window < 1 or self.max_tokens < 1:
            raise SearchInputError("topk, max_turns, window and max_tokens are at least 1")

    @classmethod
    def from_input(cls, data: Mapping[str, Any]) -> Options:
        names = {f.name: f.type for f in fields(cls)}
        kinds = {"int": int, "float": float, "str": str}
        try:
            return cls(**{k: kinds[str(names[k])](data[k]) for k in names if k in data})
        except (TypeError, ValueError) as error:
            if isinstance(error, SearchInputError):
                raise
            raise SearchInputError(str(error)) from None


@dataclass(frozen=True)
class Question:
    text: str
    answers: tuple[str, ...]

    @classmethod
    def from_input(cls, data: Mapping[str, Any]) -> Question:
        text, answers = data.get("question"), data.get("answers")
        if isinstance(answers, str):
            answers = [answers]
        if not isinstance(text, str) or not text.strip():
            raise SearchInputError("an input needs a 'question' string")
        if not isinstance(answers, Sequence) or not answers:
            raise SearchInputError("an input needs 'answers': a string or a list of them")
        return cls(text.strip(), tuple(str(a) for a in answers))


def read_action(text: str) -> tuple[str, str] | None:
    """``("search", query)`` or ``("answer", answer)``: the first closed tag; None when
    the reply has neither (Search-R1 reads the action the generation stopped on)."""
    found = [
        (m.start(), kind, m.group(1).strip())
        for kind, pattern in (("search", _SEARCH), ("answer", _ANSWER))
        if (m := pattern.search(text))
    ]
    if not found:
        return None
    _, kind, content = min(found)
    return kind, content


def title_and_text(contents: str) -> tuple[str, str]:
    title, _, text = contents.partition("\n")
    return title, text


def information(hits: Sequence[Hit]) -> str:
    """Search-R1's layout of the results: ``Doc i(Title: t) text`` a line."""
    lines = []
    for i, hit in enumerate(hits, 1):
        title, text = title_and_text(str(hit["document"]["contents"]))
        lines.append(f"Doc {i}(Title: {title}) {text}")
    return "<information>" + "\n".join(lines) + "</information>"


def shortened(hits: Sequence[Hit]) -> str:
    titles = "; ".join(title_and_text(str(h["document"]["contents"]))[0] for h in hits)
    return f"<information>Titles: {titles}</information>"


@dataclass
class Turn:
    reply: str
    observation: str | None = None  # the user message after it (results, invalid)
    hits: list[Hit] = field(default_factory=list)


def context(opening: Message, turns: Sequence[Turn], options: Options) -> list[Message]:
    """What the next call sees of the conversation, under ``options.history``."""
    shown = list(turns)
    if options.history == "window":
        shown = shown[-options.window :]
    messages = [opening]
    last_search = max((i for i, t in enumerate(shown) if t.hits), default=-1)
    for i, turn in enumerate(shown):
        messages.append({"role": "assistant", "content": turn.reply})
        observation = turn.observation
        if options.history == "short" and turn.hits and i < last_search:
            observation = shortened(turn.hits)
        if observation is not None:
            messages.append({"role": "user", "content": observation})
    return messages


@dataclass
class Episode:
    answer: str | None
    searches: list[str]
    turns: int
    invalid: int
    reward: float
    metrics: dict[str, float]


async def play(question: Question, options: Options, ask: Ask, retrieve: Retrieve) -> Episode:
    """One rollout: turns until an answer or ``max_turns``."""
    opening = {"role": "user", "content": PROMPTS[options.prompt].format(question=question.text)}
    turns: list[Turn] = []
    searches: list[str] = []
    answer: str | None = None
    invalid = 0
    for _ in range(options.max_turns):
        reply = await ask(context(opening, turns, options), options.max_tokens)
        action = read_action(reply)
        if action is None:
            invalid += 1
            turns.append(Turn(reply, INVALID))
        elif action[0] == "answer":
            answer = action[1]
            turns.append(Turn(reply))
            break
        else:
            searches.append(action[1])
            hits = await retrieve(action[1], options.topk)
            turns.append(Turn(reply, information(hits), hits))
    reward = reward_of(options.reward, answer, question.answers)
    golds = question.answers
    metrics = {
        "searches": float(len(searches)),
        "searched": float(bool(searches)),
        "answered": float(answer is not None),
        "invalid_turns": float(invalid),
        "turns": float(len(turns)),
        "exact_match": exact_match(answer, golds) if answer is not None else 0.0,
        "f1": f1_score(answer, golds) if answer is not None else 0.0,
    }
    return Episode(answer, searches, len(turns), invalid, reward, metrics)


# --------------------------------------------------------------------------- the agent


def openai_ask(client: openai.AsyncOpenAI, model: str, options: Options) -> Ask:
    async def ask(messages: list[Message], max_tokens: int) -> str:
        completion = await client.chat.completions.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            temperature=options.temperature,
            top_p=options.top_p,
            max_tokens=max_tokens,
            stop=list(STOPS),
            extra_body=AS_SAMPLED,
        )
        return completion.choices[0].message.content or ""

    return ask


def http_retrieve(http: httpx.AsyncClient, url: str) -> Retrieve:
    async def retrieve(query: str, topk: int) -> list[Hit]:
        response = await http.post(
            f"{url.rstrip('/')}/retrieve", json={"queries": [query], "topk": topk}
        )
        response.raise_for_status()
        return list(response.json()["result"][0])

    return retrieve


async def run(env: Mapping[str, str]) -> None:
    """Answer the rollout's question through the proxy and report the reward."""
    await run_episode(env, _episode)


async def _episode(attempt: Attempt) -> Outcome:
    data = attempt.agent.input
    question = Question.from_input(data)
    options = Options.from_input(data)
    url = data.get("retriever_url")
    if not isinstance(url, str) or not url:
        raise SearchInputError("no retriever_url: start the task's retriever (task.services)")
    ask = openai_ask(attempt.client, attempt.model, options)
    try:
        episode = await play(question, options, ask, http_retrieve(attempt.http, url))
    except httpx.HTTPError as error:
        raise AttemptFailed(f"retriever at {url}: {error}") from error
    return Outcome(episode.reward, episode.metrics)


def main() -> None:
    """``python -m experiments.search.harness``: one attempt, from ``os.environ``."""
    run_command(run, "experiments.search.harness")


if __name__ == "__main__":
    main()
