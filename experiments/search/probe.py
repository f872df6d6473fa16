"""``python -m experiments.search.probe``: what a warm-up taught the tiny model, measured
greedily in-process against the real index, before any RL.

For training and validation questions: how often the model searches unprompted, and with
its first reply forced to start with ``<search>`` (then its answer with ``<answer>``):
how often the query is the question's name exactly, the result holds the gold answer,
and the answer is right given that it does. The copies are what RL cannot learn from a
reward it never sees, so they are checked here first (README: what the warm-ups taught).

    python -m experiments.search.probe --warmup '{"steps": 900}'
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from agl.backends.inference.models import load_model
from experiments.agentic.warmup import prompt_ids
from experiments.search.baselines import echo
from experiments.search.facts import train_inputs, val_inputs
from experiments.search.harness import STOPS, Hit, Message, Options, Question, play
from experiments.search.retriever import Index, load_corpus
from experiments.search.warmup import warm_up

TASK_OPTIONS: dict[str, Any] = {
    "kinds": {"capital": 1.0, "country": 1.0, "two_hop": 0.0},
    "topk": 1,
    "max_turns": 4,
    "history": "full",
    "reward": "em",
    "prompt": "short",
    "max_tokens": 32,
}


class Greedy:
    """The model as the harness's ``ask``: greedy, stopped at the protocol's stop strings;
    ``force`` starts the first reply with ``<search>`` and every later one with
    ``<answer>``."""

    def __init__(self, model: Any, tokenizer: Any, force: bool) -> None:
        self.model, self.tokenizer, self.force = model, tokenizer, force

    async def __call__(self, messages: list[Message], max_tokens: int) -> str:
        ids = prompt_ids(self.tokenizer, messages)
        prefix = ""
        if self.force:
            prefix = "<search>" if len(messages) == 1 else "<answer>"
            ids = ids + self.tokenizer.encode(prefix)
        with torch.no_grad():
            out = self.model.generate(
                torch.tensor([ids]),
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=self.tokenizer.pad_token_id,
            )
        text = prefix + self.tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
        for stop in STOPS:  # kept in the reply, as the harness asks the engines
            if stop in text:
                return text[: text.index(stop) + len(stop)]
        return text


def measure(
    questions: Sequence[Mapping[str, Any]], ask: Greedy, index: Index, options: Options
) -> dict[str, float]:
    async def retrieve(query: str, topk: int) -> list[Hit]:
        return index.search([query], topk)[0]

    counts: Counter[str] = Counter()
    for q in questions:
        episode = asyncio.run(play(Question.from_input(q), options, ask, retrieve))
        counts["reward"] += episode.reward
        if episode.searches:
            counts["searched"] += 1
            counts["exact_query"] += episode.searches[0] == echo(q["question"])
            hits = index.search([episode.searches[0]], options.topk)[0]
            found = any(q["answers"][0] in str(h["document"]["contents"]) for h in hits)
            counts["gold_found"] += found
            counts["right_when_found"] += found and episode.reward > 0
    n = len(questions)
    return {
        "reward": counts["reward"] / n,
        "searched": counts["searched"] / n,
        "exact_query": counts["exact_query"] / n,
        "gold_found": counts["gold_found"] / n,
        "right_when_found": counts["right_when_found"] / max(1, counts["gold_found"]),
    }


def probe_arguments(prog: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--warmup", default="{}", help="warm_up's options, as JSON")
    parser.add_argument("--seed", type=int, default=0, help="the tiny model's and the warm-up's")
    parser.add_argument("--n", type=int, default=100, help="questions of each side")
    parser.add_argument("--weights", type=Path, help="warmed weights: loaded if there, else saved")
    return parser.parse_args()


def warmed_model(
    args: argparse.Namespace,
    warm_up: Callable[..., Mapping[str, float]],
    options: Mapping[str, Any],
) -> tuple[Any, Any]:
    """The tiny model of ``args.seed`` warmed up with ``options`` and ``args.warmup`` (or
    its weights read from ``args.weights``, when there), in eval mode, and its tokenizer."""
    torch.set_num_threads(2)
    loaded = load_model("tiny", seed=args.seed)
    model, tokenizer = loaded.model, loaded.tokenizer
    if args.weights is not None and args.weights.exists():
        model.load_state_dict(torch.load(args.weights))
    else:
        chosen = {**options, "seed": args.seed, **json.loads(args.warmup)}
        print("warm-up:", json.dumps(warm_up(model, tokenizer, **chosen)), flush=True)
        if args.weights is not None:
            torch.save(model.state_dict(), args.weights)
    model.eval()
    return model, tokenizer


def main() -> None:
    args = probe_arguments("python -m experiments.search.probe")
    model, tokenizer = warmed_model(args, warm_up, TASK_OPTIONS)
    index = Index(load_corpus("geonames"))
    options = Options.from_input(TASK_OPTIONS)
    kinds = TASK_OPTIONS["kinds"]
    sides = {
        "train": train_inputs(10**6, args.n, seed=12345, kinds=kinds),
        "val": val_inputs(args.n, kinds=kinds),
    }
    for force in (False, True):
        ask = Greedy(model, tokenizer, force)
        for side, questions in sides.items():
            figures = measure(questions, ask, index, options)
            label = f"{side} {'forced' if force else 'free'}"
            print(f"{label:12s}", "  ".join(f"{k} {v:.2f}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
