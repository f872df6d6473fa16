"""A toy tokenizer and Hypothesis-generated call traces with every kind of drift.

Token ids map to strings; some ids are concatenations of others ("ab" = "a" + "b"), so
one text has several segmentations, as in BPE. A trace is built the way a harness builds
prompts: continue exactly, retokenize the whole text, transform the last response, rewrite
the history, or retry the same prompt.
"""

from __future__ import annotations

from hypothesis import strategies as st

from agl.core.contracts.samples import ModelCall

VOCAB = {1: "a", 2: "b", 3: "c", 4: "d", 5: "ab", 6: "cd", 7: "abc", 8: "|", 9: "<s>", 10: "e"}
BY_TEXT = {text: i for i, text in VOCAB.items()}
LONGEST = max(len(t) for t in VOCAB.values())


def decode(ids: list[int]) -> str:
    return "".join(VOCAB[i] for i in ids)


def encode(text: str) -> list[int]:
    """Canonical segmentation: greedy longest match."""
    out, i = [], 0
    while i < len(text):
        for n in range(min(LONGEST, len(text) - i), 0, -1):
            if text[i : i + n] in BY_TEXT:
                out.append(BY_TEXT[text[i : i + n]])
                i += n
                break
        else:
            raise ValueError(f"cannot encode {text[i]!r}")
    return out


texts = st.text(alphabet="abcde", min_size=1, max_size=8)


@st.composite
def segmentation(draw: st.DrawFn, text: str) -> list[int]:
    """Any segmentation of ``text`` into vocabulary tokens (the model may sample any)."""
    out, i = [], 0
    while i < len(text):
        options = [
            n for n in range(1, min(LONGEST, len(text) - i) + 1) if text[i : i + n] in BY_TEXT
        ]
        n = draw(st.sampled_from(options))
        out.append(BY_TEXT[text[i : i + n]])
        i += n
    return out


OPERATIONS = ("continue", "retokenize", "transform", "rewrite", "retry", "fresh", "partial")


@st.composite
def traces(draw: st.DrawFn, max_calls: int = 8) -> list[ModelCall]:
    n = draw(st.integers(1, max_calls))
    prompt = encode("<s>" + draw(texts))
    calls: list[ModelCall] = []
    carry: list[int] = []
    for i in range(n):
        # After "partial", the model may sample again the very tokens it sampled before.
        response = carry + draw(segmentation(draw(texts)))
        carry = []
        logprobs = [-(i + 1) - j / 100 for j in range(len(response))]
        version = draw(st.integers(0, 2))
        calls.append(ModelCall(prompt, response, logprobs, version))
        observation = "|" + draw(texts)
        operation = draw(st.sampled_from(OPERATIONS))
        if operation == "continue":
            prompt = prompt + response + encode(observation)
        elif operation == "retokenize":
            prompt = encode(decode(prompt + response) + observation)
        elif operation == "transform":
            prompt = prompt + encode(decode(response)[::-1] + "e" + observation)
        elif operation == "rewrite":
            keep = draw(st.integers(0, len(prompt)))
            prompt = prompt[:keep] + encode(observation)
        elif operation == "fresh":
            prompt = encode("<s>" + draw(texts))
        elif operation == "partial":  # e.g. "continue" after a cut-off answer
            cut = draw(st.integers(0, len(response) - 1))
            prompt = prompt + response[:cut]
            if draw(st.booleans()):
                carry = response[cut : draw(st.integers(cut + 1, len(response)))]
        # retry: the same prompt again
    return calls
