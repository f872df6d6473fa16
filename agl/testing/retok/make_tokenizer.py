"""Train the testbed's byte-level BPE on a built-in corpus.

Run ``python -m agl.testing.retok.make_tokenizer [PATH]`` to regenerate the tiny model's
``agl/backends/inference/tiny_tokenizer.json``.

The corpus (English prose, Python-like code, JSON, rendered chats) is generated from a
fixed seed, and ``tokenizers``' BPE trainer is deterministic on it, so the committed
``tiny_tokenizer.json`` is exactly what this script writes; a test checks that. The
pre-tokenizer is Qwen2's regex and special tokens are split out before it, so message
boundaries are token boundaries, as in the real model.
"""

from __future__ import annotations

import json
import random
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from agl.backends.inference.qwen_chat import TINY_TOKENIZER_PATH
from agl.testing.retok import SPECIAL_TOKENS
from agl.testing.retok.template import render, render_assistant_output

VOCAB_SIZE = 1536
CORPUS_SEED = 20250101

# Qwen2's pre-tokenizer pattern: words with one leading non-letter, single digits,
# punctuation runs, and newline runs kept apart from the word that follows them.
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_PROSE_WORDS = (
    "the a an of to and in is it that for on with as was be by at this have having from or "
    "not are but they which you one all were we when there can had her his been if more "
    "will would what their so no about out up into them some could time only new other "
    "then these two may first any like now my such make over did even most after also "
    "made many before must through back years where much your way well down should "
    "because each just those people how too little state good very world still own see "
    "men work long here between both life being under never day same another know while "
    "last might great old year off come since against go came right used take three "
    "function value return error result request response token tokens prompt model "
    "sample samples merge training rollout reward agent harness tool call calls message "
    "history template string number list file path line test tests check run running "
    "output input query search answer question think reasoning step steps plan first "
    "next finally update version policy gradient loss batch sequence prefix suffix "
    "retokenize retokenization boundary special decode encode parse parsed summary "
    "subagent context window memory server client endpoint gateway proxy record store "
    "database table column index build install package module import config setting "
    "default option argument parameter variable object array dictionary key keys data "
    "format json python code bug fix patch diff commit branch repository directory"
)
PROSE_WORDS = tuple(_PROSE_WORDS.split())

_IDENTIFIERS = (
    "self x y i j n k value result items item key keys data path text name count total "
    "tokens ids prompt_ids response_ids logprobs sample samples calls call rollout_id "
    "group_id config args kwargs buffer offset length size index start end left right "
    "node parent children queue stack cache lock event status version mask weights"
)
IDENTIFIERS = tuple(_IDENTIFIERS.split())

_FUNCTIONS = (
    "load save parse render encode decode merge split apply update compute build check "
    "validate run read write open close fetch send handle process train evaluate"
)
FUNCTIONS = tuple(_FUNCTIONS.split())

TOOL_NAMES = ("read_file", "run_command", "search", "write_file", "list_dir")


def prose(rng: random.Random, sentences: int) -> str:
    """A few sentences of English-like text from a fixed word list."""
    out = []
    for _ in range(sentences):
        words = [rng.choice(PROSE_WORDS) for _ in range(rng.randint(4, 14))]
        words[0] = words[0].capitalize()
        if rng.random() < 0.2:
            words.insert(rng.randrange(1, len(words)), str(rng.randint(0, 2048)))
        out.append(" ".join(words) + rng.choice(".....?!:"))
    return " ".join(out)


def identifier(rng: random.Random) -> str:
    return rng.choice(IDENTIFIERS) if rng.random() < 0.8 else "_".join(rng.sample(IDENTIFIERS, 2))


def code(rng: random.Random, lines: int) -> str:
    """A Python-like function: indentation, calls, operators, literals."""
    name = f"{rng.choice(FUNCTIONS)}_{rng.choice(IDENTIFIERS)}"
    params = ", ".join(identifier(rng) for _ in range(rng.randint(0, 3)))
    body = []
    depth = 1
    for _ in range(lines):
        pad = "    " * depth
        kind = rng.random()
        if kind < 0.3:
            call_args = ", ".join(identifier(rng) for _ in range(rng.randint(0, 3)))
            body.append(f"{pad}{identifier(rng)} = {rng.choice(FUNCTIONS)}({call_args})")
        elif kind < 0.45 and depth < 3:
            body.append(f"{pad}for {identifier(rng)} in range({rng.randint(1, 64)}):")
            depth += 1
        elif kind < 0.6 and depth < 3:
            body.append(f"{pad}if {identifier(rng)} {rng.choice(['==', '<', '>=', 'is'])} None:")
            depth += 1
        elif kind < 0.75:
            body.append(f"{pad}{identifier(rng)}[{rng.randint(0, 9)}] += {rng.random():.3f}")
        elif kind < 0.85 and depth > 1:
            body.append(f"{pad}return {identifier(rng)}")
            depth -= 1
        else:
            body.append(f"{pad}# {prose(rng, 1).lower()}")
    body.append(f"    return {identifier(rng)}")
    return f"def {name}({params}):\n" + "\n".join(body)


def json_value(rng: random.Random, depth: int = 0) -> object:
    kind = rng.random()
    if depth < 2 and kind < 0.3:
        return {identifier(rng): json_value(rng, depth + 1) for _ in range(rng.randint(1, 4))}
    if depth < 2 and kind < 0.4:
        return [json_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if kind < 0.6:
        return rng.randint(-100, 5000)
    if kind < 0.7:
        return rng.choice([True, False, None])
    if kind < 0.8:
        return round(rng.uniform(-1, 1), 4)
    return " ".join(rng.choice(PROSE_WORDS) for _ in range(rng.randint(1, 4)))


def json_text(rng: random.Random) -> str:
    """A JSON document in one of the layouts harnesses and models produce."""
    value = {identifier(rng): json_value(rng, 1) for _ in range(rng.randint(1, 5))}
    layout = rng.random()
    if layout < 0.5:
        return json.dumps(value)
    if layout < 0.75:
        return json.dumps(value, separators=(",", ":"))
    return json.dumps(value, indent=2)


def _chat(rng: random.Random) -> str:
    """A rendered conversation, so role names and template glue get their own merges."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a helpful coding agent."},
        {"role": "user", "content": prose(rng, 2)},
    ]
    for _ in range(rng.randint(1, 3)):
        name = rng.choice(TOOL_NAMES)
        args = {"path": f"src/{rng.choice(IDENTIFIERS)}.py", "line": rng.randint(1, 400)}
        call = {"function": {"name": name, "arguments": json.dumps(args)}}
        messages.append(
            {
                "role": "assistant",
                "content": prose(rng, 1),
                "reasoning_content": prose(rng, 2),
                "tool_calls": [call],
            }
        )
        messages.append({"role": "tool", "content": rng.choice([code, _json_doc])(rng, 4)})
    text = render(messages, add_generation_prompt=True)
    return text + render_assistant_output(prose(rng, 1), prose(rng, 1))


def _json_doc(rng: random.Random, _lines: int) -> str:
    return json_text(rng)


def corpus(seed: int = CORPUS_SEED, documents: int = 3000) -> Iterator[str]:
    """The training texts, with special tokens cut out (they are never merged)."""
    rng = random.Random(seed)
    specials = re.compile("|".join(re.escape(s) for s in SPECIAL_TOKENS))
    for _ in range(documents):
        kind = rng.random()
        if kind < 0.4:
            text = prose(rng, rng.randint(1, 6))
        elif kind < 0.65:
            text = code(rng, rng.randint(2, 12))
        elif kind < 0.85:
            text = json_text(rng)
        else:
            text = _chat(rng)
        yield from (piece for piece in specials.split(text) if piece)


def build_tokenizer(seed: int = CORPUS_SEED, vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Train the BPE: specials first (ids 0..8), then the 256 byte symbols, then merges."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    return tok


def tokenizer_json(seed: int = CORPUS_SEED, vocab_size: int = VOCAB_SIZE) -> str:
    """The file's content; compact JSON keeps the committed file small."""
    return build_tokenizer(seed, vocab_size).to_str(pretty=False) + "\n"


def main(argv: list[str]) -> int:
    path = Path(argv[0]) if argv else TINY_TOKENIZER_PATH
    path.write_text(tokenizer_json(), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
