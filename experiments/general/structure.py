"""``python -m experiments.general.structure``: what the condenser makes of the general
agent's calls, under each merge, with no model and no sampling noise.

The warm-up's scripted player reads the tables for training questions (a third two-hop:
two commands) through the real harness (``warmup.episode_calls``, the simulated
computer over the real tables); each call becomes a ``ModelCall`` with the prompt ids
the server would render (the tools in the system prompt) and the reply's canonical ids.
The trainer's dedup and merges then turn them into samples
(``experiments.agentic.structure.structure``).

Without the condenser every call extends the one before, tool calls and all (the reply
is written in the template's own layout), so prefix, stitch and tree keep one sample a
rollout; past its budget the condenser rewrites an older tool output, which splits
prefix and stitch there, and only tree keeps one sample.
"""

from __future__ import annotations

import argparse
import random

from agl.core.contracts.samples import ModelCall
from experiments.agentic.structure import COLUMNS, merge_rows, text_table, tiny_tokenizer
from experiments.agentic.warmup import encode_reply
from experiments.general.harness import Options
from experiments.general.tables import table_lines
from experiments.general.warmup import SimulatedComputer, episode_calls, plan
from experiments.guess.warmup import DropoutBPE
from experiments.search.facts import train_inputs, world

KINDS = {"capital": 1.0, "country": 1.0, "two_hop": 1.0}
TOOLS = ("execute_bash", "submit")
# The grep's output is ~20-40 characters: past 30, the first output is elided by the time
# of the next call.
CONDENSE_CHARS = 30


def rollouts(condense_chars: int, n: int, seed: int) -> list[list[ModelCall]]:
    """``n`` training questions read and answered by the scripted player, as calls."""
    tokenizer = tiny_tokenizer()
    segment = DropoutBPE(tokenizer, 0.0, random.Random(0))
    options = Options(tools=TOOLS, prompt="short", max_turns=6, condense_chars=condense_chars)
    tables = table_lines(world())
    out = []
    for q in train_inputs(0, n, seed=seed, kinds=KINDS):
        computer = SimulatedComputer(tables, {}, random.Random(0))
        replies = plan(q, True, "", TOOLS)
        out.append(
            [
                ModelCall(
                    prompt, (ids := encode_reply(tokenizer, reply, segment)), [0.0] * len(ids)
                )
                for prompt, reply in episode_calls(tokenizer, q, replies, options, computer)
            ]
        )
    return out


def report(n: int, seed: int) -> str:
    rows = [["condenser", *COLUMNS]]
    for label, budget in (("off", 0), (f"{CONDENSE_CHARS} chars", CONDENSE_CHARS)):
        rows += merge_rows(label, rollouts(budget, n, seed))
    return f"{n} questions read and answered (a third two-hop; seed {seed})\n" + text_table(rows)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.general.structure")
    parser.add_argument("--n", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(report(args.n, args.seed))


if __name__ == "__main__":
    main()
