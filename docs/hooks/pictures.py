"""MkDocs hook: pictures made from the repository at build time, never committed copies.

- The studies' plots (``experiments/*/*/report/*.png``, written by ``python -m agl.study``
  and committed with the study) join the site at the same path they have in the
  repository, so a page shows the very figures the study's report holds.
- ``concepts/merges.svg``: what each merge strategy makes of one small rollout, drawn from
  the samples the registered strategies return for it (``agl.strategies``), so the
  picture changes when a strategy does.
"""

from __future__ import annotations

import html
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
STUDY_PLOTS = "experiments/*/*/report/*.png"
MERGES_SVG = "concepts/merges.svg"


def on_files(files: Files, config: MkDocsConfig) -> Files:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    for path in sorted(ROOT.glob(STUDY_PLOTS)):
        uri = path.relative_to(ROOT).as_posix()
        files.append(File.generated(config, uri, abs_src_path=str(path)))
    files.append(File.generated(config, MERGES_SVG, content=merges_svg()))
    return files


# -- the merges' picture -----------------------------------------------------------------

# A toy vocabulary: the words are what the picture shows of each token.
WORDS = ["<sys>", "Q1", "he", "llo", "hel", "lo", "A:", "ok", "Q2", "bye"]


@dataclass(frozen=True)
class Call:
    prompt: list[int]
    response: list[int]


# Three calls of one rollout. Call 1 extends call 0 token for token. Call 2's prompt holds
# call 1's reply "hello" retokenized ("hel|lo", not the sampled "he|llo"): the same text,
# other tokens, as when a harness sends back the text it got.
ROLLOUT = [
    Call([0, 1], [7]),
    Call([0, 1, 7, 8], [2, 3]),
    Call([0, 1, 7, 8, 4, 5, 6], [9]),
]
MERGES = ("independent", "prefix", "stitch", "tree")
TITLE = (
    "three calls of one rollout: call 2's prompt holds call 1's reply \"hello\" as hel|lo;"
    " it was sampled as he|llo"
)
LEGEND = (
    "grey: context (prompt tokens, loss weight 0); colour: the tokens a call sampled"
    " (trained); ↑n: a tree token's parent (-1: a root)"
)
# One colour per call for the tokens it sampled; context is grey.
CALL_COLOURS = ["#1f77b4", "#2ca02c", "#d62728"]
CONTEXT = "#e6e6e6"
BOX_W, BOX_H, GAP, ROW_GAP = 46, 26, 4, 10
LEFT = 200


def samples_by_merge() -> dict[str, list[Any]]:
    from agl.core.contracts.samples import ModelCall
    from agl.strategies.registry import get

    calls = [ModelCall(c.prompt, c.response, [0.0] * len(c.response)) for c in ROLLOUT]

    def decode(ids: list[int]) -> str:
        return "".join(WORDS[i] for i in ids)

    out: dict[str, list[Any]] = {}
    for name in MERGES:
        merge = get("merge", name)
        kwargs = {"decode": decode} if name == "stitch" else {}
        out[name] = merge(calls, "r0", "g0", **kwargs)
    return out


def text(x: float, y: float, body: str, size: int = 13, anchor: str = "start", **extra: str) -> str:
    attrs = " ".join(f'{k.replace("_", "-")}="{v}"' for k, v in extra.items())
    return (
        f'<text x="{x}" y="{y}" font-size="{size}" text-anchor="{anchor}" '
        f'font-family="sans-serif" {attrs}>{html.escape(body)}</text>'
    )


def token_row(sample: Any, y: float) -> list[str]:
    parts = []
    for i, token in enumerate(sample.tokens):
        x = LEFT + i * (BOX_W + GAP)
        call = sample.call_index[i] if sample.call_index else -1
        action = sample.action_mask[i] == 1
        fill = CALL_COLOURS[call % len(CALL_COLOURS)] if action and call >= 0 else CONTEXT
        colour = "#ffffff" if action else "#222222"
        parts.append(
            f'<rect x="{x}" y="{y}" width="{BOX_W}" height="{BOX_H}" rx="4" fill="{fill}" '
            f'stroke="#999999"/>'
        )
        parts.append(text(x + BOX_W / 2, y + 17, WORDS[token], 12, "middle", fill=colour))
        if sample.parents is not None:
            parent = f"↑{sample.parents[i]}"
            parts.append(text(x + BOX_W / 2, y + BOX_H + 12, parent, 10, "middle", fill="#555555"))
    return parts


def merges_svg() -> str:
    by_merge = samples_by_merge()
    parts: list[str] = []
    y = 10.0
    parts.append(text(10, y + 14, TITLE, 13, fill="#222222"))
    y += 30
    for i, call in enumerate(ROLLOUT):
        parts.append(text(10, y + 17, f"call {i}", 13, fill=CALL_COLOURS[i], font_weight="bold"))
        fake = _CallSample(call, i)
        parts += token_row(fake, y)
        y += BOX_H + ROW_GAP
    widest = max(len(c.prompt) + len(c.response) for c in ROLLOUT)
    for name in MERGES:
        y += 16
        right = LEFT + 14 * (BOX_W + GAP)
        parts.append(f'<line x1="10" y1="{y - 8}" x2="{right}" y2="{y - 8}" stroke="#cccccc"/>')
        samples = by_merge[name]
        stitched = sum(s.stitched_calls for s in samples)
        label = f"{name}: {len(samples)} sample{'s' if len(samples) != 1 else ''}"
        parts.append(text(10, y + 14, label, 14, font_weight="bold", fill="#222222"))
        note = f"{stitched} stitched call" if stitched else ""
        if note:
            parts.append(text(10, y + 30, note, 11, fill="#555555"))
        for sample in samples:
            why = sample.break_reason.value if sample.break_reason else ""
            parts += token_row(sample, y)
            if why:
                end = LEFT + len(sample.tokens) * (BOX_W + GAP) + 6
                parts.append(text(end, y + 17, f"← broke: {why}", 11, fill="#555555"))
            widest = max(widest, len(sample.tokens) + 6)
            y += BOX_H + ROW_GAP + (14 if sample.parents is not None else 0)
    width = LEFT + widest * (BOX_W + GAP) + 40
    legend_y = y + 14
    parts.append(text(10, legend_y, LEGEND, 11, fill="#555555"))
    height = legend_y + 14
    body = "\n".join(parts)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" '
        f'width="{width}" height="{height}" role="img" '
        f'aria-label="What each merge strategy makes of one rollout">\n'
        f'<rect width="100%" height="100%" fill="#ffffff"/>\n{body}\n</svg>\n'
    )


@dataclass
class _CallSample:
    """A call drawn as a row: its prompt as context, its response as its action."""

    call: Call
    index: int

    @property
    def tokens(self) -> list[int]:
        return self.call.prompt + self.call.response

    @property
    def action_mask(self) -> list[int]:
        return [0] * len(self.call.prompt) + [1] * len(self.call.response)

    @property
    def call_index(self) -> list[int]:
        return [-1] * len(self.call.prompt) + [self.index] * len(self.call.response)

    parents = None
