"""The search task's warm-up: the format, not the strategy.

As in ``experiments.agentic.warmup``: an induction phase (the tiny model learns to copy,
which it cannot learn from transcripts alone: ``../shared/NOTES.md``), then calls made by
the harness itself against a scripted player, each a training row (the prompt as the
server renders it, the loss on the reply and its end-of-turn token).

The scripted player searches or answers at once, at the first call:
- searching, it makes every search the question needs (its name, then for a two-hop
  question the country the result names) and answers with what the results say;
- otherwise it answers at once with a guess: the answer to another training question, of
  any kind (a country or a capital, right only by chance).

Every question of a step is played searching, so both copies (the name into the query,
the answer out of the results) are trained on all of them; the direct answers are extra
first calls, as many as make the first call search with probability ``search_share``.
Half the searched questions (``invented_share``) are about invented places with their
own passages (``experiments.search.invented``): names no memory holds, so the copies are
learned as copies.
Replies are canonically tokenized by default (``dropout`` 0): the answer is a copy of
tokens the prompt holds, and BPE-dropout would make it a copy of other tokens, which the
tiny model did not learn (README).

So the warmed model knows how to search, read and answer, and searches only some of the
time: learning to search before every answer is left to RL. Training questions only
(validation's held-out countries are never seen).
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import Any

import torch

from experiments.agentic.warmup import encode_reply, prompt_ids, rows_batch
from experiments.guess.warmup import (
    INDUCTION_BATCH,
    INDUCTION_LR,
    DropoutBPE,
    ordinary_tokens,
    train_steps,
)
from experiments.search.baselines import echo
from experiments.search.facts import draw_from, train_inputs
from experiments.search.harness import Hit, Message, Options, Question, play
from experiments.search.invented import invented_passages, invented_world
from experiments.search.retriever import Index, load_corpus

STEPS = 600
QUESTIONS_PER_STEP = 16
LR = 5e-3
DROPOUT = 0.0  # canonical replies: see the docstring
INDUCTION_STEPS = 300
SEARCH_SHARE = 0.5
INVENTED_SHARE = 0.5  # of the searched questions: about invented places (invented.py)


_IGNORE = -100  # the label HF's loss skips


def induction_batch(
    rng: random.Random, tokens: Sequence[int], size: int, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``size`` rows of a random string (3-12 tokens) at a random place, random tokens
    after it, then the string again, the labels on the repeat (its first token
    excepted). The string's length and the gap vary, so no fixed offset predicts the
    repeat: only looking back for the current token and copying the one after it does.
    (``experiments.guess.warmup``'s strings of 16 tokens twice can be learned as "copy
    from 16 back", and the copy of a name then fails: README.)"""
    rows = []
    for _ in range(size):
        string = [rng.choice(tokens) for _ in range(rng.randint(3, 12))]
        before = [rng.choice(tokens) for _ in range(rng.randint(0, 8))]
        gap = [rng.choice(tokens) for _ in range(rng.randint(1, 16))]
        rows.append((before + string + gap, string))
    width = max(len(head) + len(string) for head, string in rows)
    ids = torch.full((size, width), pad_id, dtype=torch.long)
    attention = torch.zeros((size, width), dtype=torch.long)
    labels = torch.full((size, width), _IGNORE, dtype=torch.long)
    for row, (head, string) in enumerate(rows):
        full = head + string
        ids[row, : len(full)] = torch.tensor(full)
        attention[row, : len(full)] = 1
        labels[row, len(head) + 1 : len(full)] = torch.tensor(string[1:])
    return ids, attention, labels


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
    q: dict[str, Any], replies: list[str], options: Options, index: Index
) -> list[tuple[list[Message], str]]:
    """Every call the harness makes for ``q`` when the model answers ``replies``."""
    script = iter(replies)
    calls: list[tuple[list[Message], str]] = []

    async def ask(messages: list[Message], max_tokens: int) -> tuple[str, str | None]:
        reply = next(script)
        calls.append((messages, reply))
        return reply, "length"  # the reply is whole: nothing to put back

    async def retrieve(query: str, topk: int) -> list[Hit]:
        return index.search([query], topk)[0]

    coroutine = play(Question.from_input(q), options, ask, retrieve)
    try:
        coroutine.send(None)
    except StopIteration:
        return calls
    coroutine.close()
    raise RuntimeError("a scripted search waited on something")


def warm_up(
    model: torch.nn.Module,
    tokenizer: Any,
    *,
    steps: int = STEPS,
    questions_per_step: int = QUESTIONS_PER_STEP,
    lr: float = LR,
    seed: int = 0,
    dropout: float = DROPOUT,
    induction_steps: int = INDUCTION_STEPS,
    search_share: float = SEARCH_SHARE,
    invented_share: float = INVENTED_SHARE,
    kinds: dict[str, float] | None = None,
    **options: Any,
) -> dict[str, float]:
    """Train ``model`` in place (the module's docstring); ``options`` are the harness's
    (``Options``) and whatever else the task passes. Answers the losses and seconds."""
    if steps < 1 or questions_per_step < 1 or not 0.0 < search_share <= 1.0:
        raise ValueError("warm_up needs steps, questions_per_step >= 1, search_share in (0, 1]")
    if not 0.0 <= invented_share <= 1.0:
        raise ValueError("warm_up needs invented_share in [0, 1]")
    harness = Options.from_input(options)
    start = time.perf_counter()
    copies = random.Random(f"search-warmup-induction:{seed}")
    tokens = ordinary_tokens(tokenizer)

    def copying() -> tuple[torch.Tensor, ...]:
        return induction_batch(copies, tokens, INDUCTION_BATCH, tokenizer.pad_token_id)

    induction = train_steps(model, [copying], induction_steps, INDUCTION_LR)
    metrics = {"induction_loss": sum(induction[-10:]) / max(1, len(induction[-10:]))}
    index = Index(load_corpus("geonames") + invented_passages())
    invented = invented_world()
    invented_cities: dict[str, list[Any]] = {c.iso: [] for c in invented.countries}
    for city in invented.cities:
        invented_cities[city.country.iso].append(city)
    made = random.Random(f"search-warmup-invented:{seed}")
    n_invented = round(questions_per_step * invented_share)
    segment = DropoutBPE(tokenizer, dropout, random.Random(f"search-warmup-dropout:{seed}"))
    step = 0

    # Each question's whole search is a row set (every step trains both copies on all of
    # them), and the direct answers come as extra first calls, as many as make the first
    # call's choice ``search_share`` to search.
    guesses_per_step = round(questions_per_step * (1.0 - search_share) / search_share)

    def batch() -> tuple[torch.Tensor, ...]:
        nonlocal step
        step += 1
        n = questions_per_step + guesses_per_step
        questions = train_inputs(step, n + guesses_per_step, seed=-1 - seed, kinds=kinds)
        searched, guessed, others = (
            questions[:questions_per_step],
            questions[questions_per_step:n],
            questions[n:],
        )
        searched = searched[n_invented:] + draw_from(
            made, n_invented, list(invented.countries), invented_cities, kinds
        )
        scripts = [(q, plan(q, True, "")) for q in searched]
        scripts += [
            (q, plan(q, False, other["answers"][0]))
            for q, other in zip(guessed, others, strict=True)
        ]
        rows = [
            (prompt_ids(tokenizer, messages), encode_reply(tokenizer, reply, segment))
            for q, replies in scripts
            for messages, reply in calls_of(q, replies, harness, index)
        ]
        return rows_batch(tokenizer, rows)

    losses = train_steps(model, [batch, copying], steps, lr)
    tail = losses[-10:]
    return {
        **metrics,
        "loss": sum(tail) / len(tail),
        "first_loss": losses[0],
        "seconds": time.perf_counter() - start,
        "steps": float(steps),
    }
