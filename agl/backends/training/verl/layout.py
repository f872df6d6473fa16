"""agl samples in verl's row layout, as plain lists (no torch): the pure half of the verl
backend (``agl.backends.training.verl.dataproto`` turns these rows into a ``DataProto``).

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
- ``logprobs``, ``weights`` (the loss strategy's) over the response;
  0 wherever the mask is 0, so nothing masked can leak into a sum;
- optional, per response column: ``sampling`` (each token's ``Sample.sampling`` as scored,
  untransformed where masked; None when no column is transformed), and the step's
  :class:`TokenTargets` — ``old_logprobs`` (π_old of a rollout correction),
  ``is_weights``, ``ref_logprobs`` (the KL reference's). Rows of one batch carry the
  same optional fields (:func:`pad` fills a row's missing ones with neutral values).

Invariants (``tests/backends/training/test_verl_backend.py``, Hypothesis):
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

from agl.core.contracts.samples import NO_TRANSFORM, Sample, Sampling


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
    sampling: tuple[Sampling, ...] | None = None  # scored transform per column; None: none
    old_logprobs: list[float] | None = None  # π_old per column; None: ``logprobs`` are π_old
    is_weights: list[float] | None = None  # rollout-correction IS weight per column
    ref_logprobs: list[float] | None = None  # the KL reference's logprob per column

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.response)


@dataclass(frozen=True)
class TokenTargets:
    """Per token of one sample (aligned with its tokens), what a step compares against
    besides the recorded logprobs; None: not used this step."""

    old_logprobs: Sequence[float] | None = None
    is_weights: Sequence[float] | None = None
    ref_logprobs: Sequence[float] | None = None


def response_sampling(
    sampling: Sequence[Sampling] | None, mask: Sequence[int]
) -> tuple[Sampling, ...] | None:
    """The scored transform of each response column (untransformed where masked, where
    nothing is trained); None when no column is transformed, so a row has one form."""
    if sampling is None:
        return None
    columns = tuple(s.scored if m else NO_TRANSFORM for s, m in zip(sampling, mask, strict=True))
    return None if all(c == NO_TRANSFORM for c in columns) else columns


def prompt_length(action_mask: Sequence[int]) -> int:
    """Where verl's response starts: the first action token after token 0 (token 0 has
    nothing to predict it, so its flag never matters), else the last token, so that the
    response is never empty. Needs ``len(action_mask) >= 2``; answers ``1..n-1``.

    Canonical: a row's prompt holds no action flag and its response starts with an action
    (or is a lone last token with none), so re-splitting a joined row gives the same row.
    """
    n = len(action_mask)
    return next((i for i in range(1, n) if action_mask[i]), n - 1)


def split(
    sample: Sample,
    weights: Sequence[float],
    advantage: float,
    targets: TokenTargets | None = None,
) -> VerlRow:
    """``sample`` (linear) as one verl row; ``weights`` (and ``targets``) are aligned with
    its tokens."""
    if sample.parents is not None or sample.position_ids is not None:
        raise TreeSampleError(
            f"sample of rollout {sample.rollout_id!r} is a tree sample (merge=tree): verl's "
            "row layout has one causal chain per row and cannot express its branch mask; "
            "use backend=torch for merge=tree, or a linear merge (prefix, independent, stitch)"
        )
    n = len(sample.tokens)
    targets = targets or TokenTargets()
    aligned: dict[str, Sequence[object] | None] = {
        "mask": sample.action_mask,
        "logprobs": sample.logprobs,
        "weights": weights,
        "sampling": sample.sampling,
        "old logprobs": targets.old_logprobs,
        "IS weights": targets.is_weights,
        "reference logprobs": targets.ref_logprobs,
    }
    wrong = {k: len(v) for k, v in aligned.items() if v is not None and len(v) != n}
    if wrong:
        counts = ", ".join(f"{c} {k}" for k, c in wrong.items())
        raise ValueError(f"sample of rollout {sample.rollout_id!r}: {n} tokens but {counts}")
    if n < 2:
        raise ValueError(
            f"sample of rollout {sample.rollout_id!r} has {n} token(s): verl needs a prompt "
            "token and at least one response token"
        )
    p = prompt_length(sample.action_mask)
    mask = [1 if a else 0 for a in sample.action_mask[p:]]

    def masked(values: Sequence[float]) -> list[float]:
        return [float(v) if m else 0.0 for v, m in zip(values[p:], mask, strict=True)]

    def optional(values: Sequence[float] | None) -> list[float] | None:
        return None if values is None else masked(values)

    return VerlRow(
        prompt=list(sample.tokens[:p]),
        response=list(sample.tokens[p:]),
        response_mask=mask,
        logprobs=masked(sample.logprobs),
        weights=masked(weights),
        advantage=float(advantage),
        rollout_id=sample.rollout_id,
        group_id=sample.group_id,
        sampling=response_sampling(None if sample.sampling is None else sample.sampling[p:], mask),
        old_logprobs=optional(targets.old_logprobs),
        is_weights=optional(targets.is_weights),
        ref_logprobs=optional(targets.ref_logprobs),
    )


def join(row: VerlRow) -> Sample:
    """The linear sample a row came from (inverse of :func:`split`).

    The prompt's action flags are not stored: a prompt holds no action token except a
    first token that is one (kept in the prompt because verl needs ``prompt_len > 0``),
    and such a token is never trained, so it comes back as context (``action_mask`` 0).
    :func:`split` of the result gives the same row (the targets are not a sample's: they
    stay behind).
    """
    sampling = None
    if row.sampling is not None:
        sampling = [NO_TRANSFORM] * len(row.prompt) + list(row.sampling)
    return Sample(
        tokens=row.prompt + row.response,
        action_mask=[0] * len(row.prompt) + list(row.response_mask),
        logprobs=[0.0] * len(row.prompt) + list(row.logprobs),
        rollout_id=row.rollout_id,
        group_id=row.group_id,
        sampling=sampling,
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
    lists are 0 on padding, the sampling columns untransformed (temperature 1, top-k 0,
    top-p 1). An optional field is None when no row of the batch has it.
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
    temperature: list[list[float]] | None = None
    top_k: list[list[int]] | None = None
    top_p: list[list[float]] | None = None
    old_logprobs: list[list[float]] | None = None
    is_weights: list[list[float]] | None = None
    ref_logprobs: list[list[float]] | None = None


def _columns(
    rows: Sequence[VerlRow], width: int, value: str, default: str, fill: float = 0.0
) -> list[list[float]] | None:
    """Row attribute ``value`` (None where no row has it) right-padded to ``width`` with
    ``fill``; a row without it takes its attribute ``default`` instead."""
    if all(getattr(r, value) is None for r in rows):
        return None
    out = []
    for r in rows:
        values = getattr(r, value)
        values = list(getattr(r, default) if values is None else values)
        out.append(values + [fill] * (width - len(values)))
    return out


def _sampling_columns(
    rows: Sequence[VerlRow], width: int
) -> tuple[list[list[float]], list[list[int]], list[list[float]]] | None:
    """``(temperature, top_k, top_p)`` per response column, untransformed on padding and on
    rows without a transform; None when no row has one."""
    if all(r.sampling is None for r in rows):
        return None
    temperature, top_k, top_p = [], [], []
    for r in rows:
        columns = list(r.sampling or [NO_TRANSFORM] * len(r.response))
        columns += [NO_TRANSFORM] * (width - len(columns))
        temperature.append([s.temperature for s in columns])
        top_k.append([s.top_k for s in columns])
        top_p.append([s.top_p for s in columns])
    return temperature, top_k, top_p


def pad(rows: Sequence[VerlRow], pad_id: int) -> Padded:
    """Lay out ``rows`` as verl's left/right-padded batch (see :class:`Padded`)."""
    if not rows:
        raise ValueError("no rows to pad")
    width_p = max(len(r.prompt) for r in rows)
    width_r = max(len(r.response) for r in rows)
    prompts, responses, input_ids, attention_mask, position_ids = [], [], [], [], []
    response_mask, logprobs, weights, advantages = [], [], [], []
    for r in rows:
        left = width_p - len(r.prompt)
        right = width_r - len(r.response)
        prompt = [pad_id] * left + r.prompt
        response = r.response + [pad_id] * right
        prompts.append(prompt)
        responses.append(response)
        input_ids.append(prompt + response)
        attention_mask.append([0] * left + [1] * (len(r.prompt) + len(r.response)) + [0] * right)
        position_ids.append([0] * left + list(range(r.length)) + [0] * right)
        response_mask.append(r.response_mask + [0] * right)
        logprobs.append(r.logprobs + [0.0] * right)
        weights.append(r.weights + [0.0] * right)
        advantages.append([r.advantage if m else 0.0 for m in r.response_mask] + [0.0] * right)
    sampling = _sampling_columns(rows, width_r)
    temperature, top_k, top_p = sampling if sampling is not None else (None, None, None)
    return Padded(
        prompts=prompts,
        responses=responses,
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        response_mask=response_mask,
        logprobs=logprobs,
        weights=weights,
        advantages=advantages,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        # a row without π_old trains against its recorded logprobs, without an IS weight
        # with weight 1 on its masked-in columns (the mask: 1 or 0), without a reference
        # on nothing (its weights are all 0: a filler)
        old_logprobs=_columns(rows, width_r, "old_logprobs", "logprobs"),
        is_weights=_columns(rows, width_r, "is_weights", "response_mask"),
        ref_logprobs=_columns(rows, width_r, "ref_logprobs", "logprobs"),
    )


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

        def cut(values: list[list[float]] | None, i: int = i, n: int = n_response) -> list | None:
            return None if values is None else list(values[i][:n])

        sampling = None
        if padded.temperature is not None and padded.top_k is not None and padded.top_p is not None:
            sampling = response_sampling(
                [
                    Sampling(float(t), float(p), int(k))
                    for t, k, p in zip(
                        padded.temperature[i][:n_response],
                        padded.top_k[i][:n_response],
                        padded.top_p[i][:n_response],
                        strict=True,
                    )
                ],
                padded.response_mask[i][:n_response],
            )
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
                sampling=sampling,
                old_logprobs=cut(padded.old_logprobs),
                is_weights=cut(padded.is_weights),
                ref_logprobs=cut(padded.ref_logprobs),
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
    zeros = [0.0] * len(row.response)

    def like(values: list[float] | None) -> list[float] | None:
        return None if values is None else list(zeros)  # the same optional fields as row's

    return VerlRow(
        prompt=list(row.prompt),
        response=list(row.response),
        response_mask=[0] * len(row.response),
        logprobs=list(zeros),
        weights=list(zeros),
        advantage=0.0,
        rollout_id="",
        group_id="",
        old_logprobs=like(row.old_logprobs),
        is_weights=like(row.is_weights),
        ref_logprobs=like(row.ref_logprobs),
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
