"""The search task's warm-up: the format and the copies, not the strategy.

It stands in for pretraining. The harness itself plays questions about places invented
for each question (``experiments.search.invented``) against a scripted player, and the
model learns each episode's whole text (``loss="all"``: the prompts, the results and the
replies, as a pretrained model has read text like it) or the replies only
(``loss="replies"``).

The scripted player searches or answers at once, at the first call:
- searching, it makes every search the question needs (its name, then for a two-hop
  question the country the result names) and answers with what the results say;
- otherwise it answers at once with a guess: the answer to another question of the step
  (an invented name, right only by chance).

Every question of a step is played searching, so both copies (the name into the query,
the answer out of the results) are trained on all of them; the direct answers are extra
first calls, as many as make the first call search with probability ``search_share``.

The names are new in every question, so no memory of them helps and the only way to the
loss's floor is to copy: the tiny model remembered any fixed set of names it was warmed
on (real or invented) and never learned to copy a held-out one, and an induction phase
of random strings did not carry over (README). Replies are canonically tokenized
(``dropout`` 0): the answer is then a copy of tokens the prompt holds.

So the warmed model knows how to search, read and answer, knows no real place, and
searches only some of the time: learning to search before every answer is left to RL.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from experiments.agentic.warmup import encode_reply, prompt_ids
from experiments.guess.warmup import Batch, DropoutBPE, at_once, masked_batch, trained
from experiments.search.baselines import echo
from experiments.search.harness import Hit, Message, Options, Question, play
from experiments.search.invented import Invented, invented_question
from experiments.search.retriever import Index, Searchable, load_corpus

# Measured on 2 CPU cores (README): with these the copies on held-out real questions,
# forced, are right ~0.9 of the time after ~5 min.
STEPS = 900
QUESTIONS_PER_STEP = 32
LR = 3e-3
DROPOUT = 0.0  # canonical replies: see the docstring
SEARCH_SHARE = 0.5
LOSSES = ("all", "replies")


class InventedIndex:
    """The step's invented passages, each found first by its exact name, then the real
    index's hits for the query (only when ``topk`` asks for more than one)."""

    def __init__(self, places: Mapping[str, str], real: Index | None) -> None:
        self.places = places
        self.real = real
        self.rows = [{"id": f"invented-{name}", "contents": c} for name, c in places.items()]

    def search(self, queries: Sequence[str], topk: int) -> list[list[Hit]]:
        out = []
        for query in queries:
            hits: list[Hit] = []
            if query in self.places:
                document = {"id": f"invented-{query}", "contents": self.places[query]}
                hits.append({"document": document, "score": math.inf})
            if self.real is not None and topk > len(hits):
                hits += self.real.search([query], topk - len(hits))[0]
            out.append(hits[:topk])
        return out


def plan(q: dict[str, Any], search: bool, guess: str) -> list[str]:
    """The scripted replies to question ``q``."""
    if not search:
        return [f"<answer> {guess} </answer>"]
    name = echo(q["question"])
    if q["kind"] == "two_hop":
        return [
            f"<search> {name} </search>",
            f"<search> {q['via']} </search>",
            f"<answer> {q['answers'][0]} </answer>",
        ]
    return [f"<search> {name} </search>", f"<answer> {q['answers'][0]} </answer>"]


def calls_of(
    q: dict[str, Any], replies: list[str], options: Options, index: Searchable
) -> list[tuple[list[Message], str]]:
    """Every call the harness makes for ``q`` when the model answers ``replies``."""
    script = iter(replies)
    calls: list[tuple[list[Message], str]] = []

    async def ask(messages: list[Message], max_tokens: int) -> str:
        reply = next(script)
        calls.append((messages, reply))
        return reply

    async def retrieve(query: str, topk: int) -> list[Hit]:
        return index.search([query], topk)[0]

    at_once(play(Question.from_input(q), options, ask, retrieve), "a scripted search")
    return calls


def episode_rows(
    tokenizer: Any, calls: Sequence[tuple[list[int], str]], segment: DropoutBPE, loss: str
) -> list[tuple[list[int], list[int]]]:
    """An episode's calls (prompt ids as the server renders them, the reply's text) as
    training rows of ids and a 0/1 loss mask: a call whose prompt extends the row so far
    continues it (``history=full``: one row an episode), any other starts a row of its
    own. The mask covers every token, or with ``loss="replies"`` the replies and their
    end-of-turn tokens."""
    rows: list[tuple[list[int], list[int]]] = []
    for prompt, reply in calls:
        answer = encode_reply(tokenizer, reply, segment)
        if rows and prompt[: len(rows[-1][0])] == rows[-1][0]:
            ids, mask = rows.pop()
            prompt, context_mask = prompt[len(ids) :], mask
        else:
            ids, context_mask = [], []
        context = [1 if loss == "all" else 0] * len(prompt)
        rows.append((ids + prompt + answer, context_mask + context + [1] * len(answer)))
    return rows


def step_episodes(
    rng: random.Random, questions_per_step: int, search_share: float, kinds: Any
) -> list[tuple[Invented, str | None]]:
    """One step's episodes, each a question about invented places and the guess to answer
    it with at once (None: search): every question searched, then the direct answers,
    as many as make the first call search with probability ``search_share``; a guess is
    the answer to another question of the step."""
    made = [invented_question(rng, kinds) for _ in range(questions_per_step)]
    episodes: list[tuple[Invented, str | None]] = [(place, None) for place in made]
    for _ in range(round(questions_per_step * (1.0 - search_share) / search_share)):
        place, other = rng.sample(made, 2)
        episodes.append((place, other.question["answers"][0]))
    return episodes


def check_options(steps: int, questions_per_step: int, search_share: float, loss: str) -> None:
    if steps < 1 or questions_per_step < 1 or not 0.0 < search_share <= 1.0:
        raise ValueError("warm_up needs steps, questions_per_step >= 1, search_share in (0, 1]")
    if loss not in LOSSES:
        raise ValueError(f"warm_up's loss {loss!r}: choose one of {LOSSES}")


def batches(
    tokenizer: Any,
    harness: Options,
    *,
    seed: int,
    questions_per_step: int = QUESTIONS_PER_STEP,
    search_share: float = SEARCH_SHARE,
    loss: str = "all",
    dropout: float = DROPOUT,
    kinds: dict[str, float] | None = None,
) -> Callable[[], Batch]:
    """The warm-up's batches: one a call, each a step's episodes as rows."""
    real = Index(load_corpus("geonames")) if harness.topk > 1 else None
    rng = random.Random(f"search-warmup:{seed}")
    segment = DropoutBPE(tokenizer, dropout, random.Random(f"search-warmup-dropout:{seed}"))

    def batch() -> Batch:
        rows = []
        for place, guess in step_episodes(rng, questions_per_step, search_share, kinds):
            q = place.question
            replies = plan(q, guess is None, guess or "")
            index = InventedIndex(place.passages(), real)
            calls = [(prompt_ids(tokenizer, m), r) for m, r in calls_of(q, replies, harness, index)]
            rows += episode_rows(tokenizer, calls, segment, loss)
        return masked_batch(tokenizer, rows)

    return batch


def copy_batches(
    tokenizer: Any, seed: int, questions_per_step: int, loss: str, kinds: Any = None
) -> Callable[[], Batch]:
    """These episodes, every one searched, as another agent's warm-up's copy practice:
    short rows that teach copying a name in and an answer out, as a pretrained model has
    read text of every layout (experiments.general.warmup, experiments.swe.warmup)."""
    search = Options(topk=1, prompt="short", max_tokens=32)
    return batches(
        tokenizer,
        search,
        seed=seed,
        questions_per_step=questions_per_step,
        search_share=1.0,
        loss=loss,
        kinds=kinds,
    )


def warm_up(
    model: torch.nn.Module,
    tokenizer: Any,
    *,
    steps: int = STEPS,
    questions_per_step: int = QUESTIONS_PER_STEP,
    lr: float = LR,
    seed: int = 0,
    dropout: float = DROPOUT,
    search_share: float = SEARCH_SHARE,
    loss: str = "all",
    kinds: dict[str, float] | None = None,
    **options: Any,
) -> dict[str, float]:
    """Train ``model`` in place (the module's docstring); ``options`` are the harness's
    (``Options``) and whatever else the task passes. Answers the losses and seconds."""
    check_options(steps, questions_per_step, search_share, loss)
    start = time.perf_counter()
    batch = batches(
        tokenizer,
        Options.from_input(options),
        seed=seed,
        questions_per_step=questions_per_step,
        search_share=search_share,
        loss=loss,
        dropout=dropout,
        kinds=kinds,
    )
    return trained(model, [batch], steps, lr, start)
