"""The fixed parts of the Qwen-style chat agl's own models speak (``agl.backends.inference.
models``): the tiny model's byte-level BPE (``tiny_tokenizer.json`` beside this file) and
the tools text of the chat template's system message. Production's, since the served
models are made of them; the retokenization testbed (``agl.testing.retok``) renders and
regenerates the same ones from here. Constants only, no torch: the testbed imports them
without loading a model."""

from __future__ import annotations

from pathlib import Path

# Written by ``python -m agl.testing.retok.make_tokenizer``; a test checks it is what that
# writes.
TINY_TOKENIZER_PATH = Path(__file__).with_name("tiny_tokenizer.json")

TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
