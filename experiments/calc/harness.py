"""The calculator task's harness: an arithmetic question, a ``calculator`` tool the model
may call (OpenAI tool calling through the proxy), reward 1.0 for the right final number.

A tool-using loop like any agent framework's: call the model with the tools; run each
tool call and append its result; stop at a reply without tool calls (the answer) or after
``max_turns`` calls. Runs as a worker entry point (``run(env)``) or a command.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from collections.abc import Mapping
from typing import Any

from agl.agent.harness import Attempt, Outcome, run_command, run_episode

SYSTEM = "Answer with the result. A calculator tool is available."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def calculate(expression: str) -> str:
    """Arithmetic only (no names, no calls): the tool a model can be trusted with."""
    try:
        return _format(_eval(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError, TypeError, RecursionError) as error:
        return f"error: {error}"


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    raise ValueError("only numbers and + - * / ( ) are allowed")


def _format(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def final_number(text: str | None) -> float | None:
    """The last number of the reply ("3 + 4 = 7" answers 7); replies are kept short by
    ``max_tokens``, so rambling past the answer costs the reward."""
    numbers = _NUMBER.findall(text or "")
    return float(numbers[-1]) if numbers else None


async def run(env: Mapping[str, str]) -> None:
    # The OpenAI client's own defaults, not the agent SDK's.
    await run_episode(env, _episode, timeout_s=600.0, max_retries=2)


async def _episode(attempt: Attempt) -> Outcome:
    task = attempt.agent.input
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": task["question"]},
    ]
    answer = None
    for _ in range(int(task.get("max_turns", 3))):
        reply = await attempt.client.chat.completions.create(
            model=attempt.model,
            messages=messages,
            tools=TOOLS,
            temperature=float(task.get("temperature", 1.0)),
            max_tokens=int(task.get("max_tokens", 48)),
        )
        message = reply.choices[0].message
        if not message.tool_calls:
            answer = final_number(message.content)
            break
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            try:
                expression = json.loads(call.function.arguments).get("expression", "")
            except (json.JSONDecodeError, AttributeError):
                expression = ""
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": calculate(str(expression))}
            )
    return Outcome(1.0 if answer is not None and abs(answer - task["answer"]) < 1e-6 else 0.0)


def main() -> None:
    run_command(run, "experiments.calc.harness")


if __name__ == "__main__":
    main()
