"""The dataset task's harness: a question from a dataset row, the model's answer, and
another try after a wrong one (up to ``max_turns`` answers); reward 1.0 when the last
answer matches the row's.

A row (after ``task.columns``) has ``prompt``: a string, or chat messages as verl's
datasets store them (``[{"role": "user", "content": ...}]``), and ``answer``: a number or a
string that is one (matched against the last number of the reply) or any other string
(matched against the reply, case and surrounding whitespace aside). Every other key is a
knob: ``system``, ``max_turns``, ``temperature``, ``max_tokens``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from agl.agent.harness import Attempt, Outcome, run_command, run_episode

RETRY = "That is not right. Try again."
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def messages_of(prompt: object, system: str | None) -> list[dict[str, Any]]:
    """The chat a row's prompt starts."""
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt):
        messages = [dict(m) for m in prompt]
    else:
        raise ValueError("a row's prompt is a string or a list of chat messages")
    if system and not (messages and messages[0].get("role") == "system"):
        messages.insert(0, {"role": "system", "content": system})
    return messages


def is_correct(reply: str | None, answer: object) -> bool:
    """A numeric answer (a number, or a string that is one: verl's datasets keep ground
    truths as strings) against the reply's last number; any other against the reply."""
    reply = reply or ""
    if isinstance(answer, str) and _NUMBER.fullmatch(answer.strip()):
        answer = float(answer)
    if isinstance(answer, int | float) and not isinstance(answer, bool):
        numbers = _NUMBER.findall(reply)
        return bool(numbers) and abs(float(numbers[-1]) - float(answer)) < 1e-6
    return reply.strip().casefold() == str(answer).strip().casefold()


async def run(env: Mapping[str, str]) -> None:
    # The OpenAI client's own defaults, not the agent SDK's.
    await run_episode(env, _episode, timeout_s=600.0, max_retries=2)


async def _episode(attempt: Attempt) -> Outcome:
    row = attempt.agent.input
    messages = messages_of(row["prompt"], row.get("system"))
    correct = False
    for turn in range(int(row.get("max_turns", 1))):
        if turn:
            messages.append({"role": "user", "content": RETRY})
        reply = await attempt.client.chat.completions.create(
            model=attempt.model,
            messages=messages,
            temperature=float(row.get("temperature", 1.0)),
            max_tokens=int(row.get("max_tokens", 64)),
        )
        content = reply.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": content})
        correct = is_correct(content, row["answer"])
        if correct:
            break
    return Outcome(1.0 if correct else 0.0)


def main() -> None:
    run_command(run, "experiments.qa.harness")


if __name__ == "__main__":
    main()
