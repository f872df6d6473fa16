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

``--kinds task`` asks the task's own questions (``conf/task/search.yaml``: one hop, two
calls a searched rollout), as the studies run it; the default mix adds two-hop ones.
The scripted player writes no invalid reply, so the table shows the harness's breaks
that sampling causes by retokenising alone (the merge comparison,
``conf/study/merges.yaml``, needs those).
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Mapping, Sequence
from pathlib import Path

from agl.core.contracts.samples import ModelCall
from agl.strategies.dedup import dedup
from agl.strategies.merge.stitch import stitch
from agl.strategies.merge_metrics import merge_metrics
from experiments.agentic.structure import COLUMNS, merge_rows, text_table, tiny_tokenizer
from experiments.agentic.warmup import encode_reply, prompt_ids
from experiments.guess.baselines import task_options
from experiments.guess.warmup import DropoutBPE
from experiments.search.facts import train_inputs
from experiments.search.harness import HISTORIES, Options
from experiments.search.retriever import Index, load_corpus
from experiments.search.warmup import calls_of, plan

KINDS = {"capital": 1.0, "country": 1.0, "two_hop": 1.0}
TASK_CONFIG = Path(__file__).resolve().parents[2] / "conf" / "task" / "search.yaml"


def task_kinds() -> dict[str, float]:
    """The question kinds the task asks (``conf/task/search.yaml``'s ``options.kinds``)."""
    kinds = task_options(TASK_CONFIG).get("kinds")
    if not isinstance(kinds, Mapping):
        raise ValueError(f"{TASK_CONFIG}: options.kinds is no mapping of kind to weight")
    return {str(k): float(v) for k, v in kinds.items()}


def rollouts(
    history: str,
    n: int,
    seed: int,
    dropout: float,
    index: Index,
    topk: int = 1,
    kinds: Mapping[str, float] = KINDS,
) -> list[list[ModelCall]]:
    """``n`` searched questions of ``kinds`` (a two-hop one: three calls), as calls."""
    tokenizer = tiny_tokenizer()
    segment = DropoutBPE(tokenizer, dropout, random.Random(f"search-structure-bpe:{seed}"))
    options = Options(topk=topk, history=history, prompt="short")
    out = []
    for q in train_inputs(0, n, seed=seed, kinds=kinds):
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


def stitched_share(calls: Sequence[list[ModelCall]]) -> float:
    """The share of calls that stitch trains under a prompt it changed (its
    ``merge/stitched_calls``): the breaks it mends, which the other merges leave alone."""
    decode = tiny_tokenizer().decode
    kept = [dedup(c) for c in calls]
    merged = [stitch(c, f"r{i}", "g", decode=decode) for i, c in enumerate(kept)]
    return merge_metrics(merged, sum(map(len, kept)))["merge/stitched_calls"]


def report(
    n: int,
    seed: int,
    dropouts: Sequence[float],
    histories: Sequence[str] = HISTORIES,
    kinds: Mapping[str, float] = KINDS,
) -> str:
    index = Index(load_corpus("geonames"))
    rows = [["history", "dropout", *COLUMNS, "stitched"]]
    for history in histories:
        for dropout in dropouts:
            calls = rollouts(history, n, seed, dropout, index, kinds=kinds)
            stitched = f"{stitched_share(calls):.1%}"
            for row in merge_rows(history, calls):
                rows.append(
                    [row[0], f"{dropout:g}", *row[1:], stitched if row[1] == "stitch" else "-"]
                )
    mix = ", ".join(f"{k} {v:g}" for k, v in kinds.items())
    return (
        f"{n} searched questions per row (kinds: {mix}; seed {seed}; dropout: "
        "the replies' BPE-dropout)\n" + text_table(rows)
    )


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.search.structure")
    parser.add_argument("--n", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dropout", type=float, nargs="+", default=[0.0])
    parser.add_argument("--history", choices=HISTORIES, nargs="+", default=list(HISTORIES))
    parser.add_argument(
        "--kinds",
        choices=("mixed", "task"),
        default="mixed",
        help="mixed: a third two-hop questions; task: conf/task/search.yaml's kinds",
    )
    args = parser.parse_args()
    kinds = task_kinds() if args.kinds == "task" else KINDS
    print(report(args.n, args.seed, args.dropout, args.history, kinds))


if __name__ == "__main__":
    main()
