"""``python -m experiments.search.structure``: what each history option makes of the
search harness's calls, under each merge, with no model and no sampling noise.

The warm-up's scripted player searches every question of the task's kinds through the
real harness and index (``warmup.calls_of``); each call becomes a ``ModelCall`` with the
prompt ids the server would render and the reply's ids (canonical, or BPE-dropout
segmentations with ``--dropout``, as a sampling model writes them). The trainer's dedup
and merges then turn them into samples (``experiments.agentic.structure.structure``).

- ``full``: every call extends the one before; only a reply the template renders back in
  other tokens (BPE-dropout) breaks the prefix, and stitch mends that break.
- ``short`` rewrites older results to their titles and ``window`` drops older turns:
  both rewrite a prompt the model has already seen, so prefix and stitch split there,
  and only tree keeps one sample.
"""

from __future__ import annotations

import argparse
import random

from agl.core.contracts.samples import ModelCall
from experiments.agentic.structure import COLUMNS, merge_rows, text_table, tiny_tokenizer
from experiments.agentic.warmup import encode_reply, prompt_ids
from experiments.guess.warmup import DropoutBPE
from experiments.search.facts import train_inputs
from experiments.search.harness import HISTORIES, Options
from experiments.search.retriever import Index, load_corpus
from experiments.search.warmup import calls_of, plan

KINDS = {"capital": 1.0, "country": 1.0, "two_hop": 1.0}


def rollouts(
    history: str, n: int, seed: int, dropout: float, index: Index, topk: int = 1
) -> list[list[ModelCall]]:
    """``n`` searched questions (a third two-hop: three calls), as calls."""
    tokenizer = tiny_tokenizer()
    segment = DropoutBPE(tokenizer, dropout, random.Random(f"search-structure-bpe:{seed}"))
    options = Options(topk=topk, history=history, prompt="short")
    out = []
    for q in train_inputs(0, n, seed=seed, kinds=KINDS):
        out.append(
            [
                ModelCall(
                    prompt_ids(tokenizer, messages),
                    (ids := encode_reply(tokenizer, reply, segment)),
                    [0.0] * len(ids),
                )
                for messages, reply in calls_of(q, plan(q, True, ""), options, index)
            ]
        )
    return out


def report(n: int, seed: int, dropout: float) -> str:
    index = Index(load_corpus("geonames"))
    rows = [["history", *COLUMNS]]
    for history in HISTORIES:
        rows += merge_rows(history, rollouts(history, n, seed, dropout, index))
    return (
        f"{n} searched questions per history (a third two-hop; seed {seed}, "
        f"BPE-dropout {dropout})\n" + text_table(rows)
    )


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.search.structure")
    parser.add_argument("--n", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dropout", type=float, default=0.0)
    args = parser.parse_args()
    print(report(args.n, args.seed, args.dropout))


if __name__ == "__main__":
    main()
