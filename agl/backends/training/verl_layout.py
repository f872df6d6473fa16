"""agl samples in verl's row layout, as plain lists (no torch): the pure half of the verl
backend (``agl/backends/training/verl.py`` turns these rows into a ``DataProto``).

verl's actor batch (``verl/trainer/ppo/ray_trainer.py``, ``verl/workers/utils/padding.py``)
holds one row per sequence: ``prompts`` left-padded to ``P`` columns, ``responses``
right-padded to ``R`` columns, ``input_ids = prompts ⧺ responses``, an ``attention_mask``
over both, ``position_ids`` counted over the real tokens only, and per response column a
``response_mask`` (1 = the policy sampled it, so it is trained; a multi-turn agent loop's
tool/user tokens inside the response are 0 — verl's ``AgentLoopOutput.response_mask``),
``old_log_probs`` and ``advantages``. verl reads a response token's logprob at the column
before it (``no_padding_2_padding``: ``values[offset - resp_len - 1 : offset - 1]``), which
is agl's linear-sample rule (a token is predicted from the previous one).

A linear agl sample maps to one row:

- ``prompt`` = its tokens before the first action token, but at least one token: verl
  asserts ``prompt_len > 0``, and a first token has nothing to predict it, so agl never
  trains it either (``TorchBackend``: "a root token ... is never trained"); a sample with
  no action token gets its last token as a (masked) response, so no response is empty;
- ``response`` = the rest; ``response_mask`` = the sample's ``action_mask`` there (a
  multi-turn sample's later prompts sit inside the response, masked 0, as in verl);
- ``logprobs``, ``weights`` (the loss strategy's, times ``token_scale``) over the response;
  0 wherever the mask is 0, so nothing masked can leak into a sum.

Invariants (``tests/test_verl_backend.py``, Hypothesis):
  - ``join(split(s)) == s`` for every linear sample (tokens, mask, logprobs, ids); weights
    and advantage come back unchanged;
  - a token is trained through verl iff ``TorchBackend`` trains it: an action token, not
    the first token, with a nonzero weight;
  - ``padded(rows)`` round-trips through ``unpad`` exactly.
Tree samples (``parents`` set) have no row form: a row is one causal chain, so they are
refused with :class:`TreeSampleError` (use ``backend=torch`` or a linear merge).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agl.core.types import Sample


class TreeSampleError(ValueError):
    """A tree sample (branch-aware mask) cannot be laid out as verl rows."""


@dataclass(frozen=True)
class VerlRow:
    """One sample as verl sees it, unpadded. ``response*`` lists have equal lengths."""

    prompt: list[int]
    response: list[int]
    response_mask: list[int]
    logprobs: list[float]  # behaviour logprobs of the response tokens (0 where masked)
    weights: list[float]  # per-token loss weights over the response (0 where masked)
    advantage: float
    rollout_id: str
    group_id: str

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.response)


def prompt_length(action_mask: Sequence[int]) -> int:
    """Where verl's response starts: the first action token after token 0 (token 0 has
    nothing to predict it, so its flag never matters), else the last token, so that the
    response is never empty. Needs ``len(action_mask) >= 2``; answers ``1..n-1``.

    Canonical: a row's prompt holds no action flag and its response starts with an action
    (or is a lone last token with none), so re-splitting a joined row gives the same row.
    """
    n = len(action_mask)
    return next((i for i in range(1, n) if action_mask[i]), n - 1)


def split(sample: Sample, weights: Sequence[float], advantage: float) -> VerlRow:
    """``sample`` (linear) as one verl row; ``weights`` are aligned with its tokens."""
    if sample.parents is not None or sample.position_ids is not None:
        raise TreeSampleError(
            f"sample of rollout {sample.rollout_id!r} is a tree sample (merge=tree): verl's "
            "row layout has one causal chain per row and cannot express its branch mask; "
            "use backend=torch for merge=tree, or a linear merge (prefix, independent, stitch)"
        )
    n = len(sample.tokens)
    if not (len(sample.action_mask) == len(sample.logprobs) == len(weights) == n):
        raise ValueError(
            f"sample of rollout {sample.rollout_id!r}: {n} tokens, "
            f"{len(sample.action_mask)} mask, {len(sample.logprobs)} logprobs, "
            f"{len(weights)} weights"
        )
    if n < 2:
        raise ValueError(
            f"sample of rollout {sample.rollout_id!r} has {n} token(s): verl needs a prompt "
            "token and at least one response token"
        )
    p = prompt_length(sample.action_mask)
    mask = [1 if a else 0 for a in sample.action_mask[p:]]
    return VerlRow(
        prompt=list(sample.tokens[:p]),
        response=list(sample.tokens[p:]),
        response_mask=mask,
        logprobs=[lp if m else 0.0 for lp, m in zip(sample.logprobs[p:], mask, strict=True)],
        weights=[float(w) if m else 0.0 for w, m in zip(weights[p:], mask, strict=True)],
        advantage=float(advantage),
        rollout_id=sample.rollout_id,
        group_id=sample.group_id,
    )


def join(row: VerlRow) -> Sample:
    """The linear sample a row came from (inverse of :func:`split`).

    The prompt's action flags are not stored: a prompt holds no action token except a
    first token that is one (kept in the prompt because verl needs ``prompt_len > 0``),
    and such a token is never trained, so it comes back as context (``action_mask`` 0).
    :func:`split` of the result gives the same row.
    """
    return Sample(
        tokens=row.prompt + row.response,
        action_mask=[0] * len(row.prompt) + list(row.response_mask),
        logprobs=[0.0] * len(row.prompt) + list(row.logprobs),
        rollout_id=row.rollout_id,
        group_id=row.group_id,
    )


def full_weights(row: VerlRow) -> list[float]:
    """The row's weights aligned with the whole sequence (0 over the prompt)."""
    return [0.0] * len(row.prompt) + list(row.weights)


# --- padding -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Padded:
    """A batch of rows in verl's padded layout, lists of equal-length lists.

    ``prompts[i]`` is left-padded to ``P``, ``responses[i]`` right-padded to ``R``;
    ``attention_mask[i]`` (``P + R``) is 1 on real tokens; ``position_ids[i]`` counts real
    tokens from 0 (0 on padding, as verl computes them from the mask). Per-response-column
    lists are 0 on padding.
    """

    prompts: list[list[int]]
    responses: list[list[int]]
    input_ids: list[list[int]]
    attention_mask: list[list[int]]
    position_ids: list[list[int]]
    response_mask: list[list[int]]
    logprobs: list[list[float]]
    weights: list[list[float]]
    advantages: list[list[float]]  # the row's scalar advantage on its masked columns


def pad(rows: Sequence[VerlRow], pad_id: int) -> Padded:
    """Lay out ``rows`` as verl's left/right-padded batch (see :class:`Padded`)."""
    if not rows:
        raise ValueError("no rows to pad")
    width_p = max(len(r.prompt) for r in rows)
    width_r = max(len(r.response) for r in rows)
    out = Padded([], [], [], [], [], [], [], [], [])
    for r in rows:
        left = width_p - len(r.prompt)
        right = width_r - len(r.response)
        prompt = [pad_id] * left + r.prompt
        response = r.response + [pad_id] * right
        attention = [0] * left + [1] * (len(r.prompt) + len(r.response)) + [0] * right
        positions = [0] * left + list(range(r.length)) + [0] * right
        out.prompts.append(prompt)
        out.responses.append(response)
        out.input_ids.append(prompt + response)
        out.attention_mask.append(attention)
        out.position_ids.append(positions)
        out.response_mask.append(r.response_mask + [0] * right)
        out.logprobs.append(r.logprobs + [0.0] * right)
        out.weights.append(r.weights + [0.0] * right)
        out.advantages.append([r.advantage if m else 0.0 for m in r.response_mask] + [0.0] * right)
    return out


def unpad(
    padded: Padded,
    advantages: Sequence[float],
    rollout_ids: Sequence[str],
    group_ids: Sequence[str],
) -> list[VerlRow]:
    """Rows back from the padded layout (inverse of :func:`pad`).

    The scalar advantage of a row is passed in: a row without a masked-in column keeps
    none in ``padded.advantages``.
    """
    rows = []
    width_p = len(padded.prompts[0]) if padded.prompts else 0
    for i, attention in enumerate(padded.attention_mask):
        n_prompt = sum(attention[:width_p])
        n_response = sum(attention[width_p:])
        rows.append(
            VerlRow(
                prompt=padded.prompts[i][width_p - n_prompt :],
                response=padded.responses[i][:n_response],
                response_mask=padded.response_mask[i][:n_response],
                logprobs=padded.logprobs[i][:n_response],
                weights=padded.weights[i][:n_response],
                advantage=float(advantages[i]),
                rollout_id=rollout_ids[i],
                group_id=group_ids[i],
            )
        )
    return rows


# --- rollout boundaries --------------------------------------------------------------------


def filler(row: VerlRow) -> VerlRow:
    """A copy of ``row`` that trains nothing (weights 0, advantage 0, mask 0).

    verl splits a batch evenly over its data-parallel ranks (``DataProto.chunk``), so a
    hand-off must hold a multiple of ``dp_size`` rows. verl's own pad
    (``pad_dataproto_to_divisor``) repeats real rows, which would count them twice;
    a filler adds tokens to the forward and nothing to any sum.
    """
    return VerlRow(
        prompt=list(row.prompt),
        response=list(row.response),
        response_mask=[0] * len(row.response),
        logprobs=[0.0] * len(row.response),
        weights=[0.0] * len(row.response),
        advantage=0.0,
        rollout_id="",
        group_id="",
    )


def pad_to_multiple(rows: Sequence[VerlRow], multiple: int) -> list[VerlRow]:
    """``rows`` plus fillers (copies of the shortest row) up to a multiple of ``multiple``."""
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    if not rows:
        raise ValueError("no rows")
    missing = -len(rows) % multiple
    shortest = min(rows, key=lambda r: r.length)
    return list(rows) + [filler(shortest) for _ in range(missing)]
