"""``python -m experiments.general.probe``: what a warm-up taught the tiny model, measured
greedily in-process, each question in a real sandbox, before any RL.

For training and validation questions: the reward, how often the model reads the tables
unprompted, and with its first reply forced to start a ``grep -Fw`` of the tables (the
model writes the name and the table): the reward then, which needs both copies (the name
into the command, the answer out of the line found).

    python -m experiments.general.probe --warmup '{"steps": 600}'
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from agl.backends.inference.server.tools import parse_tool_calls
from experiments.general.harness import (
    Message,
    Options,
    Reply,
    hidden_from_sandbox,
    play,
    tables_in,
    workspaces_root,
)
from experiments.general.sandbox import Sandbox, make_workspace
from experiments.general.warmup import warm_up
from experiments.search.facts import train_inputs, val_inputs
from experiments.search.harness import Question
from experiments.search.probe import probe_arguments, warmed_model

TASK_OPTIONS: dict[str, Any] = {
    "kinds": {"capital": 1.0, "country": 1.0, "two_hop": 0.0},
    "tools": ["execute_bash", "submit"],
    "max_turns": 4,
    "output_chars": 300,
    "prompt": "short",
    "max_tokens": 64,
}
FORCED = '<tool_call>\n{"name": "execute_bash", "arguments": {"command": "grep -Fw \''


class Greedy:
    """The model as the harness's ``ask``: greedy, its tool calls parsed as the server
    parses them; ``force`` starts the first reply with ``FORCED``."""

    def __init__(self, model: Any, tokenizer: Any, force: bool) -> None:
        self.model, self.tokenizer, self.force = model, tokenizer, force

    async def __call__(self, messages: list[Message], tools: list[dict[str, Any]]) -> Reply:
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False
        )
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        prefix = FORCED if self.force and len(messages) == 1 else ""
        ids += self.tokenizer.encode(prefix, add_special_tokens=False)
        with torch.no_grad():
            out = self.model.generate(
                torch.tensor([ids]),
                max_new_tokens=TASK_OPTIONS["max_tokens"],
                do_sample=False,
                pad_token_id=self.tokenizer.pad_token_id,
            )
        reply = prefix + self.tokenizer.decode(out[0, len(ids) :], skip_special_tokens=False)
        reply = reply.split(self.tokenizer.eos_token)[0]
        parsed = parse_tool_calls(reply)
        if parsed is None:
            return Reply(reply, [], "stop")
        return Reply(parsed[0], parsed[1], "stop")


async def measure(questions: Sequence[Mapping[str, Any]], ask: Greedy) -> dict[str, float]:
    options = Options.from_input(TASK_OPTIONS)
    root = workspaces_root(options)
    counts: Counter[str] = Counter()
    for i, q in enumerate(questions):
        workspace = make_workspace(root, f"probe-{i}", tables_in(root))
        async with await Sandbox.open(workspace, hidden_from_sandbox(root)) as sandbox:
            episode = await play(Question.from_input(q), options, ask, sandbox)
        counts["reward"] += episode.reward
        for key in ("read_input", "answered", "submitted", "invalid_turns"):
            counts[key] += episode.metrics[key]
    return {
        key: counts[key] / len(questions) for key in ("reward", *sorted(counts.keys() - {"reward"}))
    }


def main() -> None:
    args = probe_arguments("python -m experiments.general.probe")
    model, tokenizer = warmed_model(args, warm_up, TASK_OPTIONS)
    kinds = TASK_OPTIONS["kinds"]
    sides = {
        "train": train_inputs(10**6, args.n, seed=12345, kinds=kinds),
        "val": val_inputs(args.n, kinds=kinds),
    }
    for force in (False, True):
        ask = Greedy(model, tokenizer, force)
        for side, questions in sides.items():
            figures = asyncio.run(measure(questions, ask))
            label = f"{side} {'forced' if force else 'free'}"
            print(f"{label:12s}", "  ".join(f"{k} {v:.2f}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
