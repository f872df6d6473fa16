"""A batching generation engine for a transformers causal LM (CPU or one GPU).

Requests are submitted from an asyncio event loop; one background thread owns the model
and runs every forward pass, so torch work never blocks the loop. The thread does
*continuous batching*: before each decode step it admits waiting requests (one batched,
left-padded prefill), copies their KV cache into the running batch, and then decodes one
token for every running sequence in a single forward pass. A sequence that finishes (eos,
``max_tokens``, the context limit, or cancelled by the caller, e.g. on a stop string) is
removed from the batch at once: it costs no more work.

The KV cache is a preallocated slab per layer, ``[batch capacity, kv heads, columns,
head dim]``. Every live sequence is right-aligned at the column ``end``; its mask is 1
on its own tokens and 0 elsewhere, and its position ids count only its own tokens, so
the logits are those of the sequence run alone (left padding is invisible). A decode step
writes one column in place (no per-step ``torch.cat`` of the whole cache); a finished row
is replaced by the last row (one row copied, not the whole cache); columns no live row
uses any more are dropped from the attention window.

Sampling: temperature (0 = greedy), top-k, top-p, and a per-request ``torch.Generator``
when a seed is given (one uniform draw per token, so a seeded request is reproducible
whatever else is in the batch). The logprob returned for a token is that of the
distribution it was sampled from: ``agl.backends.sampling``'s transform (temperature, then
top-k and top-p, renormalised; plain ``log_softmax`` for greedy), which the training
backends apply to the same tokens.

Memory: with ``kv_cache_gib`` every KV tensor the engine holds at once (the slab, a
prefill's own cache, a relayout's copy of the window) stays within the budget. A request
is admitted only if the running rows and it, each grown to its longest possible length
(prompt + ``max_tokens``, capped by the context), fit in half the budget as one slab; the
other half covers the transients. A request that does not fit waits (first come, first
served); one that could never fit fails at once with a one-line error. The slab's rows and
columns are sized per allocation within the budget. ``paused()`` (a weight update, a
training step) frees the slab: the trainer gets that memory; the next prefill makes a new
one.

Device: the engine runs where the model's parameters are, read before every prefill, so
the model may be moved (e.g. by the training backend) after the engine is built, while no
sequence runs (before the first request or inside ``paused()``).

Weights change only between generations: ``update_weights`` stops admitting, waits for
the running sequences to finish, swaps, bumps ``policy_version`` and resumes. A generation
therefore never mixes two policies, and reports the version that sampled all its tokens.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, cast

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from agl.backends.sampling import logprobs_under
from agl.core.contracts.samples import Sampling

log = logging.getLogger(__name__)

# First allocation of KV columns; the slab doubles when a sequence outgrows it.
_INITIAL_COLUMNS = 256


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    n: int = 1
    ignore_eos: bool = False

    @cached_property
    def sampling(self) -> Sampling:
        # Read for every row of every decode step: built once per request.
        return Sampling(self.temperature, self.top_p, self.top_k)


@dataclass
class Choice:
    """One sampled sequence, as the event loop sees it."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None  # stop | length | abort


@dataclass(frozen=True)
class Delta:
    """Tokens one choice gained since the previous delta (and its finish, if it ended)."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None


@dataclass
class EngineStats:
    forward_passes: int = 0
    prefill_passes: int = 0
    decode_steps: int = 0
    tokens_generated: int = 0
    requests: int = 0
    max_running: int = 0  # the most sequences decoded together in one step
    busy_s: float = 0.0  # time spent in forward passes and sampling (not waiting for work)


class EngineError(RuntimeError):
    """The engine could not run a generation (the model raised, or the engine closed)."""


class Generation:
    """A submitted request: its choices fill in on the event loop that submitted it."""

    def __init__(
        self,
        request_id: int,
        prompt_ids: list[int],
        params: SamplingParams,
        stream: bool,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.choices = [Choice(i) for i in range(params.n)]
        self.policy_version: int | None = None  # set when admitted
        self.error: BaseException | None = None
        self.cancelled = False
        # A unary request is woken once, when done; a stream after every step.
        self._stream = stream
        self._loop = loop
        self._wake = asyncio.Event()
        self._engine: Engine | None = None

    @property
    def finished(self) -> bool:
        return self.error is not None or all(c.finish_reason for c in self.choices)

    async def wait(self) -> list[Choice]:
        """Every choice, once all are finished."""
        while not self.finished:
            await self._wake.wait()
            self._wake.clear()
        if self.error is not None:
            raise EngineError(str(self.error)) from self.error
        return self.choices

    async def deltas(self) -> AsyncIterator[list[Delta]]:
        """What each choice gained, batch by batch, until all are finished."""
        sent = [0] * len(self.choices)
        done = [False] * len(self.choices)
        while True:
            batch: list[Delta] = []
            for c in self.choices:
                finish = c.finish_reason
                end = len(c.token_ids)
                if end > sent[c.index] or (finish and not done[c.index]):
                    batch.append(
                        Delta(
                            c.index,
                            c.token_ids[sent[c.index] : end],
                            c.logprobs[sent[c.index] : end],
                            finish,
                        )
                    )
                    sent[c.index] = end
                    done[c.index] = bool(finish)
            if batch:
                yield batch
            if self.error is not None:
                raise EngineError(str(self.error)) from self.error
            if all(done):
                return
            await self._wake.wait()
            self._wake.clear()

    def cancel(self, index: int | None = None) -> None:
        """Stop sampling one choice (or all): its row leaves the batch at the next step.

        Call on the generation's event loop. A choice still running ends as ``abort``.
        """
        indices = range(len(self.choices)) if index is None else (index,)
        for i in indices:
            if not self.choices[i].finish_reason:
                self.choices[i].finish_reason = "abort"
        self.cancelled = all(c.finish_reason == "abort" for c in self.choices)
        if self._engine is not None:
            self._engine._cancel(self, tuple(indices))
        self._wake.set()

    def _deliver(
        self, index: int, tokens: list[int], logprobs: list[float], finish: str | None
    ) -> None:
        choice = self.choices[index]
        if choice.finish_reason:  # cancelled meanwhile: later tokens are not part of it
            return
        choice.logprobs.extend(logprobs)
        choice.token_ids.extend(tokens)
        if finish:
            choice.finish_reason = finish

    def _fail(self, error: BaseException) -> None:
        self.error = error
        self._wake.set()


# (generation, choice index, new tokens, their logprobs, finish reason)
_Update = tuple[Generation, int, list[int], list[float], str | None]


@dataclass
class _Row:
    """A running sequence, as the engine thread sees it."""

    generation: Generation
    index: int
    generated: int
    max_new: int  # max_tokens, capped by the context left after the prompt
    stop_ids: frozenset[int]
    generator: torch.Generator | None
    stream: bool
    # A unary request's tokens wait here and cross to the event loop once, at the end:
    # a per-step wake-up of the loop costs more than a decode step of a small model.
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


class _SlabLayer(DynamicLayer):
    """One layer's KV cache in the slab: ``update`` writes new columns in place and
    returns the live window ``[:rows, :, start:end + new]``."""

    def __init__(self, slab: _Slab, layer: int) -> None:
        super().__init__()
        self.slab = slab
        self.layer = layer
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.slab
        rows, new = key_states.shape[0], key_states.shape[-2]
        keys, values = s.keys[self.layer], s.values[self.layer]
        keys[:rows, :, s.end : s.end + new] = key_states
        values[:rows, :, s.end : s.end + new] = value_states
        return keys[:rows, :, s.start : s.end + new], values[:rows, :, s.start : s.end + new]

    def get_seq_length(self) -> int:
        return self.slab.end - self.slab.start

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0


@dataclass
class _Slab:
    """The running batch's KV cache and per-row state. Columns ``[start, end)`` are the
    attention window; row ``b``'s tokens occupy its last columns up to ``end``."""

    capacity: int = 0  # rows
    columns: int = 0
    layers: int = 0  # the model's (known once a prefill ran)
    rows: int = 0
    start: int = 0
    end: int = 0
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    # [capacity, columns] bool; empty until the first prompt allocates the buffers
    mask: torch.Tensor = field(default_factory=lambda: torch.zeros((0, 0), dtype=torch.bool))
    cache: Cache | None = None


class Engine:
    """Generation with continuous batching on a background thread.

    ``submit`` (on an event loop) returns a ``Generation``; ``update_weights`` may be
    called from any thread but the event loop's own (it blocks until the swap is done).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: object,
        *,
        max_batch_size: int = 32,
        max_context: int | None = None,
        policy_version: int = 0,
        seed: int = 0,
        num_threads: int | None = None,
        kv_cache_gib: float | None = None,
    ) -> None:
        if kv_cache_gib is not None and not kv_cache_gib > 0:
            raise ValueError(f"kv_cache_gib must be positive, not {kv_cache_gib}")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, not {max_batch_size}")
        if max_context is not None and max_context < 1:
            raise ValueError(f"max_context must be at least 1, not {max_context}")
        self.model = model.eval()
        # an HF model's PretrainedConfig (nn.Module's __getattr__ types it as a tensor)
        self.config: Any = model.config
        self.kv_cache_budget_bytes = None if kv_cache_gib is None else int(kv_cache_gib * 2**30)
        self.max_batch_size = max_batch_size
        self.max_context = max_context or int(
            getattr(self.config, "max_position_embeddings", 0) or 2048
        )
        self.policy_version = policy_version
        self.eos_ids = _eos_ids(model, tokenizer)
        self.pad_id = _pad_id(model, tokenizer)
        self.stats = EngineStats()
        self._check_full_attention()
        self._num_threads = num_threads
        self._seed = seed
        # Device state, made for the model's device before the first prefill (_follow_model).
        self.device: torch.device | None = None
        self._generator = torch.Generator()
        self._cell_bytes = 0  # KV bytes of one token of one row (all layers, keys and values)
        self._ids = itertools.count()
        self._cv = threading.Condition()
        self._pending: deque[Generation] = deque()
        self._cancelled: list[tuple[Generation, tuple[int, ...]]] = []
        self._paused = 0
        self._active = 0  # rows admitted and not yet removed (guarded by _cv)
        self._closed = False
        self._rows: list[_Row] = []
        self._slab = _Slab()
        # Per row of the slab: the next position id and the next input token.
        self._positions = torch.zeros(max_batch_size, dtype=torch.long)
        self._next = torch.zeros(max_batch_size, dtype=torch.long)
        self._thread = threading.Thread(target=self._run, name="agl-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public API

    def submit(
        self, prompt_ids: list[int], params: SamplingParams, *, stream: bool = False
    ) -> Generation:
        """Queue a request; call from the event loop that will read its result."""
        if not 1 <= params.n <= self.max_batch_size:
            raise ValueError(f"n must be between 1 and {self.max_batch_size}")
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) >= self.max_context:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens; the context is {self.max_context}"
            )
        if params.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        generation = Generation(
            next(self._ids), list(prompt_ids), params, stream, asyncio.get_running_loop()
        )
        generation._engine = self
        too_big = self._never_fits(generation)
        if too_big:
            generation._fail(EngineError(too_big))
            return generation
        with self._cv:
            if self._closed:
                raise EngineError("the engine is closed")
            self._pending.append(generation)
            self.stats.requests += 1
            self._cv.notify_all()
        return generation

    @property
    def running(self) -> int:
        """Sequences admitted and not finished."""
        return self._active

    @property
    def kv_cache_allocated(self) -> int:
        """Bytes of the KV slab now allocated (keys, values and their mask; 0 when freed)."""
        s = self._slab
        return sum(t.nbytes for t in s.keys + s.values) + s.mask.nbytes

    @property
    def admitting(self) -> bool:
        """False while ``paused()`` (a weight update) holds new requests back."""
        return not self._paused

    def update_weights(
        self,
        state_dict: Mapping[str, torch.Tensor] | None,
        policy_version: int | None = None,
        timeout: float | None = None,
    ) -> int:
        """Swap in new weights between generations; answers the new policy version.

        Admission stops, running generations finish under the old weights, then the
        tensors of ``state_dict`` (all or some of the model's) are copied in and
        ``policy_version`` becomes the given one (default: the current one plus 1).
        ``state_dict=None`` only bumps the version (weights changed in place by the
        caller, e.g. a trainer sharing the model, inside ``paused()``).
        """
        with self.paused(timeout):
            if state_dict is not None:
                self._load(state_dict)
            self.policy_version = (
                self.policy_version + 1 if policy_version is None else policy_version
            )
            log.info("weights updated: policy_version %d", self.policy_version)
            return self.policy_version

    @contextmanager
    def paused(self, timeout: float | None = None) -> Iterator[None]:
        """Hold admission and wait until no generation runs; the model is the caller's
        inside the block. Raises ``TimeoutError`` if generations still run after
        ``timeout`` seconds (admission then resumes). The KV cache is freed for the block
        (nothing runs, so the engine thread does not touch it)."""
        with self._cv:
            self._paused += 1
            if not self._cv.wait_for(lambda: self._active == 0 or self._closed, timeout):
                self._paused -= 1
                self._cv.notify_all()
                raise TimeoutError(f"generations still running after {timeout} s")
            if self._active == 0:  # (closed, a step may still be running)
                self._free_slab()
        try:
            yield
        finally:
            with self._cv:
                self._paused -= 1
                self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            pending = list(self._pending)
            self._pending.clear()
            self._cv.notify_all()
        self._thread.join(timeout=30)
        for generation in pending:
            _call_on_loop(generation, generation._fail, EngineError("the engine is closed"))

    # ------------------------------------------------------------ engine thread

    def _cancel(self, generation: Generation, indices: tuple[int, ...]) -> None:
        with self._cv:
            if generation.cancelled and generation in self._pending:
                self._pending.remove(generation)
            else:
                self._cancelled.append((generation, indices))
            self._cv.notify_all()

    def _run(self) -> None:
        if self._num_threads:
            # Intra-op threads are per OS thread: set them where the forward runs.
            torch.set_num_threads(self._num_threads)
        with torch.inference_mode():
            while True:
                with self._cv:
                    self._cv.wait_for(self._has_work)
                    if self._closed:
                        break
                    admitted = self._admit()
                    cancelled, self._cancelled = self._cancelled, []
                busy_from = time.perf_counter()
                try:
                    if admitted:
                        self._follow_model()
                        self._prefill(admitted)
                    # After the prefill: a request cancelled right after admission is in it.
                    self._drop_cancelled(cancelled)
                    if self._rows:
                        self._decode()
                except Exception as error:  # the model raised: fail what runs, carry on
                    log.exception("generation failed")
                    self._fail_running(error, admitted)
                self.stats.busy_s += time.perf_counter() - busy_from
                with self._cv:
                    self._active = len(self._rows)
                    if not self._rows:
                        self._cv.notify_all()
        self._fail_running(EngineError("the engine is closed"))

    def _has_work(self) -> bool:
        return (
            self._closed
            or bool(self._rows)
            or bool(self._cancelled)
            or (bool(self._pending) and not self._paused)
        )

    def _admit(self) -> list[Generation]:
        """Waiting requests that fit in the batch and the KV budget, first come first
        served (guarded)."""
        if self._paused:
            return []
        admitted: list[Generation] = []
        free = self.max_batch_size - len(self._rows)
        rows = len(self._rows)
        longest = max((self._final_length(r.generation) for r in self._rows), default=0)
        while self._pending and self._pending[0].params.n <= free:
            head = self._pending[0]
            grown = max(longest, self._final_length(head))
            if not self._fits(rows + head.params.n, grown):
                if rows:
                    break  # waits until running rows finish
                # Alone it does not fit: the budget's estimate grew (the real layout).
                self._pending.popleft()
                _call_on_loop(head, head._fail, EngineError(self._too_big(head)))
                continue
            generation = self._pending.popleft()
            generation.policy_version = self.policy_version
            admitted.append(generation)
            free -= generation.params.n
            rows += generation.params.n
            longest = grown
        self._active += self.max_batch_size - len(self._rows) - free
        return admitted

    # ------------------------------------------------------------ the KV budget

    def _final_length(self, generation: Generation) -> int:
        """The most tokens one of its sequences can reach."""
        return min(len(generation.prompt_ids) + generation.params.max_tokens, self.max_context)

    def _slab_cells(self) -> int | None:
        """Row-columns the running slab may have (half the budget), None: unbounded."""
        if self.kv_cache_budget_bytes is None:
            return None
        if not self._cell_bytes:
            self._cell_bytes = _config_cell_bytes(self.config, next(self.model.parameters()))
        return self.kv_cache_budget_bytes // self._cell_bytes // 2

    def _fits(self, rows: int, longest: int) -> bool:
        """``rows`` sequences of up to ``longest`` tokens fit in the slab's half (the
        window is shared: every row is right-aligned, so it is as wide as the longest
        row, plus the column a decode step writes)."""
        cells = self._slab_cells()
        return cells is None or rows * (longest + 1) <= cells

    def _never_fits(self, generation: Generation) -> str | None:
        if self._fits(generation.params.n, self._final_length(generation)):
            return None
        return self._too_big(generation)

    def _too_big(self, generation: Generation) -> str:
        need = generation.params.n * (self._final_length(generation) + 1) * self._cell_bytes * 2
        return (
            f"the request needs {need / 2**30:.2f} GiB of KV cache (n={generation.params.n} "
            f"x {self._final_length(generation)} tokens, twice for prefill headroom); "
            f"kv_cache_gib is {(self.kv_cache_budget_bytes or 0) / 2**30:g}: lower max_tokens or n"
        )

    def _shape(self, rows: int, width: int) -> tuple[int, int]:
        """(row capacity, columns) of a new slab for ``rows`` rows and a ``width``-column
        window: columns double until there is room for the window twice (rare moves),
        within the budget; admission guarantees ``rows * (width + 1)`` fits (the floors
        only matter if the config's KV estimate was short of the real layout)."""
        columns = max(self._slab.columns, _INITIAL_COLUMNS)
        while columns < 2 * width + 1:
            columns *= 2
        cells = self._slab_cells()
        if cells is None:
            return self.max_batch_size, columns
        columns = max(min(columns, cells // rows), width + 1)
        return max(min(self.max_batch_size, cells // columns), rows), columns

    def _free_slab(self) -> None:
        """Drop the KV buffers (only while no row runs); the next prefill allocates."""
        s = self._slab
        s.keys, s.values, s.cache = [], [], None
        s.mask = torch.zeros((0, 0), dtype=torch.bool)
        s.capacity = s.columns = s.rows = s.start = s.end = 0

    # ------------------------------------------------------------ the device

    def _follow_model(self) -> None:
        """Make the per-row state where the model is now (it may have moved since the
        last batch: the trainer moves it after building the engine)."""
        device = next(self.model.parameters()).device
        if device == self.device:
            return
        if self._rows:
            raise EngineError(f"the model moved to {device} while sequences ran on {self.device}")
        self._free_slab()
        self._cell_bytes = 0  # the dtype may have changed too
        self.device = device
        self._positions = torch.zeros(self.max_batch_size, dtype=torch.long, device=device)
        self._next = torch.zeros(self.max_batch_size, dtype=torch.long, device=device)
        self._generator = torch.Generator(device=device).manual_seed(self._seed)

    def _drop_cancelled(self, cancelled: list[tuple[Generation, tuple[int, ...]]]) -> None:
        if not cancelled:
            return
        gone = {(g.request_id, i) for g, indices in cancelled for i in indices}
        self._remove(
            [
                b
                for b, row in enumerate(self._rows)
                if (row.generation.request_id, row.index) in gone
            ]
        )

    def _prefill(self, generations: list[Generation]) -> None:
        """One forward over the new prompts (left-padded), their first tokens sampled,
        their KV copied into the running batch (once per prompt, shared by its n rows)."""
        assert self.device is not None  # _follow_model ran
        width = max(len(g.prompt_ids) for g in generations)
        ids = torch.full((len(generations), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(generations), width), dtype=torch.bool)
        for j, g in enumerate(generations):
            ids[j, width - len(g.prompt_ids) :] = torch.tensor(g.prompt_ids)
            mask[j, width - len(g.prompt_ids) :] = True
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.config)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self.stats.forward_passes += 1
        self.stats.prefill_passes += 1
        source = torch.tensor(
            [j for j, g in enumerate(generations) for _ in range(g.params.n)], device=self.device
        )
        rows = [
            _Row(
                generation=g,
                index=i,
                generated=0,
                max_new=min(g.params.max_tokens, self.max_context - len(g.prompt_ids)),
                stop_ids=frozenset() if g.params.ignore_eos else self.eos_ids,
                generator=_seeded(g.params.seed, i, ids.device),
                stream=g._stream,
            )
            for g in generations
            for i in range(g.params.n)
        ]
        first = self._slab.rows
        self._insert(cache, mask, source, [len(g.prompt_ids) for g in generations])
        self._rows.extend(rows)
        tokens, logprobs = self._sample(out.logits[:, -1][source], rows)
        self._next[first : first + len(rows)] = tokens
        self._finish_step(rows, first, tokens, logprobs)

    def _decode(self) -> None:
        """One token for every running row, in one forward pass."""
        s = self._slab
        if s.end + 1 > s.columns:
            self._relayout(0, s.rows)
        b = s.rows
        s.mask[:b, s.end] = True
        out = self.model(
            input_ids=self._next[:b, None],
            attention_mask=s.mask[:b, s.start : s.end + 1],
            position_ids=self._positions[:b, None],
            past_key_values=s.cache,
            use_cache=True,
        )
        s.end += 1
        self._positions[:b] += 1
        self.stats.forward_passes += 1
        self.stats.decode_steps += 1
        self.stats.max_running = max(self.stats.max_running, b)
        tokens, logprobs = self._sample(out.logits[:, -1], self._rows)
        self._next[:b] = tokens
        self._finish_step(list(self._rows), 0, tokens, logprobs)

    def _finish_step(
        self, rows: list[_Row], first: int, tokens: torch.Tensor, logprobs: torch.Tensor
    ) -> None:
        """Hand the step's tokens to their generations; finished rows leave the batch."""
        done: list[int] = []
        updates: list[_Update] = []
        for offset, (row, token, logprob) in enumerate(
            zip(rows, tokens.tolist(), logprobs.tolist(), strict=True)
        ):
            row.generated += 1
            finish = None
            if token in row.stop_ids:
                finish = "stop"
            elif row.generated >= row.max_new:
                finish = "length"
            if finish:
                done.append(first + offset)
            if row.stream:
                updates.append((row.generation, row.index, [token], [logprob], finish))
            else:
                row.tokens.append(token)
                row.logprobs.append(logprob)
                if finish:
                    updates.append((row.generation, row.index, row.tokens, row.logprobs, finish))
        self.stats.tokens_generated += len(rows)
        if updates:
            self._post(updates)
        self._remove(done)

    def _post(self, updates: list[_Update]) -> None:
        """Deliver a step's tokens with one wake-up per event loop (not one per token)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[_Update]] = {}
        for update in updates:
            by_loop.setdefault(update[0]._loop, []).append(update)
        for loop, batch in by_loop.items():
            with suppress(RuntimeError):  # that loop is closed: nobody waits any more
                loop.call_soon_threadsafe(_deliver_batch, batch)

    def _fail_running(self, error: BaseException, admitted: Sequence[Generation] = ()) -> None:
        running = {g.request_id: g for g in admitted}
        running.update((row.generation.request_id, row.generation) for row in self._rows)
        for generation in running.values():
            _call_on_loop(generation, generation._fail, error)
        self._rows.clear()
        self._slab.rows = 0
        self._slab.start = self._slab.end = 0

    # ------------------------------------------------------------ sampling

    def _sample(self, logits: torch.Tensor, rows: list[_Row]) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and their logprobs under each row's transform (``agl.backends.sampling``:
        temperature, top-k, top-p, renormalised); greedy rows take the argmax, logged
        untransformed."""
        params = [row.generation.params for row in rows]
        logits = logits.float()
        temperature = [p.temperature for p in params]
        if all(t == 0 for t in temperature):
            tokens = logits.argmax(-1)
            logprobs = torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1)
            return tokens, logprobs
        logp = logprobs_under(logits, [p.sampling for p in params])
        probs = logp.exp()
        cdf = probs.cumsum(-1)
        u = torch.rand(len(rows), generator=self._generator, device=logits.device)
        for b, row in enumerate(rows):
            if row.generator is not None:
                u[b] = torch.rand((), generator=row.generator, device=logits.device)
        tokens = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1)
        tokens = tokens.clamp_(max=logits.shape[-1] - 1)
        # Rounding can land on a token the truncation removed (or past the end): the mode.
        tokens = torch.where(
            probs.gather(1, tokens[:, None]).squeeze(1) > 0, tokens, probs.argmax(-1)
        )
        if any(x == 0 for x in temperature):
            greedy = torch.tensor([x == 0 for x in temperature], device=logits.device)
            tokens = torch.where(greedy, logits.argmax(-1), tokens)
        return tokens, logp.gather(1, tokens[:, None]).squeeze(1)

    # ------------------------------------------------------------ the KV slab

    def _allocate(self, like: torch.Tensor, layers: int, capacity: int, columns: int) -> None:
        """Make the slab's buffers (zeros: stale columns must hold finite numbers)."""
        s = self._slab
        shape = (capacity, like.shape[1], columns, like.shape[3])
        s.keys = [torch.zeros(shape, dtype=like.dtype, device=like.device) for _ in range(layers)]
        s.values = [torch.zeros(shape, dtype=like.dtype, device=like.device) for _ in range(layers)]
        s.mask = torch.zeros((capacity, columns), dtype=torch.bool, device=like.device)
        s.capacity, s.columns = capacity, columns
        s.cache = Cache(layers=[_SlabLayer(s, i) for i in range(layers)])
        # The real layout, in case the config's estimate was short (budget: stay within).
        cell = 2 * layers * like.shape[1] * like.shape[3] * like.element_size() + 1
        self._cell_bytes = max(self._cell_bytes, cell)

    def _relayout(self, prompt_width: int, rows: int, like: torch.Tensor | None = None) -> None:
        """Move the live window to the left edge so that it has ``prompt_width`` columns
        before ``end`` and as many again after it (so moves are rare: amortized O(1)
        column per step); the buffers are made anew (within the budget) when that does
        not fit or ``rows`` rows do not. ``like``: a prefill's keys, for the first slab."""
        s = self._slab
        live = s.end - s.start
        width = max(live, prompt_width)
        at = width - live
        # Copied out first: the window may overlap where it goes, or its buffers go.
        window = [buffer[: s.rows, :, s.start : s.end].clone() for buffer in s.keys + s.values]
        mask = s.mask[: s.rows, s.start : s.end].clone()
        if not s.keys or 2 * width + 1 > s.columns or rows > s.capacity:
            capacity, columns = self._shape(rows, width)
            if (capacity, columns) != (s.capacity, s.columns):
                source = s.keys[0] if s.keys else like
                assert source is not None  # the first slab comes from a prefill
                # Empty, not a view of the old buffer (a view would keep it alive).
                template = source.new_empty((0, source.shape[1], 0, source.shape[3]))
                kept = s.rows
                self._free_slab()  # before the new buffers: never both at once
                s.rows = kept
                self._allocate(template, s.layers, capacity, columns)
        if s.rows:
            for buffer, old in zip(s.keys + s.values, window, strict=True):
                buffer[: s.rows, :, at:width] = old
            s.mask[: s.rows] = False
            s.mask[: s.rows, at:width] = mask
        s.start, s.end = 0, width

    def _insert(
        self, cache: DynamicCache, mask: torch.Tensor, source: torch.Tensor, lengths: list[int]
    ) -> None:
        """Copy prefilled prompts (rows ``source`` of ``cache``) into the slab's new rows."""
        s = self._slab
        width = mask.shape[1]
        layers = []
        for cached in cast(list[DynamicLayer], cache.layers):
            assert cached.keys is not None and cached.values is not None  # the prefill filled it
            layers.append((cached.keys, cached.values))
        s.layers = len(layers)
        if s.rows == 0:
            s.start = s.end = 0
        rows = s.rows + len(source)
        if not s.keys or s.end < width or s.end + 1 > s.columns or rows > s.capacity:
            self._relayout(width, rows, like=layers[0][0])
        s.start = min(s.start, s.end - width)
        lo, hi = s.rows, rows
        for layer, (k, v) in enumerate(layers):
            s.keys[layer][lo:hi, :, s.end - width : s.end] = k[source]
            s.values[layer][lo:hi, :, s.end - width : s.end] = v[source]
        s.mask[lo:hi] = False
        s.mask[lo:hi, s.end - width : s.end] = mask[source]
        self._positions[lo:hi] = torch.tensor(lengths, device=self._positions.device)[source]
        s.rows = hi

    def _remove(self, indices: list[int]) -> None:
        """Drop rows: each is overwritten by the current last row (one row copied)."""
        if not indices:
            return
        s = self._slab
        for b in sorted(indices, reverse=True):
            last = s.rows - 1
            if b != last:
                for buffer in s.keys + s.values:
                    buffer[b, :, s.start : s.end] = buffer[last, :, s.start : s.end]
                s.mask[b] = s.mask[last]
                self._positions[b] = self._positions[last]
                self._next[b] = self._next[last]
                self._rows[b] = self._rows[last]
            self._rows.pop()
            s.rows = last
        if s.rows == 0:
            s.start = s.end = 0
            return
        # Columns no live row attends to leave the window (less attention work).
        used = s.mask[: s.rows, s.start : s.end].any(0)
        s.start += int(used.int().argmax())

    # ------------------------------------------------------------ weights

    def _load(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            result = self.model.load_state_dict(dict(state_dict), strict=False)
        if result.unexpected_keys:
            raise KeyError(f"not parameters of the model: {result.unexpected_keys[:5]}")

    def _check_full_attention(self) -> None:
        # The slab keeps every column: a sliding-window layer would attend too far back.
        types = getattr(self.config, "layer_types", None) or ()
        if any(t != "full_attention" for t in types):
            raise ValueError(f"only full-attention models are supported, not {types}")


def _deliver_batch(batch: list[_Update]) -> None:
    woken: dict[int, Generation] = {}
    for generation, index, tokens, logprobs, finish in batch:
        generation._deliver(index, tokens, logprobs, finish)
        if generation._stream or generation.finished:
            woken[generation.request_id] = generation
    for generation in woken.values():
        generation._wake.set()


def _call_on_loop(generation: Generation, fn: object, *args: object) -> None:
    with suppress(RuntimeError):
        generation._loop.call_soon_threadsafe(fn, *args)  # type: ignore[arg-type]


def _seeded(seed: int | None, index: int, device: torch.device) -> torch.Generator | None:
    # Choice i of a seeded request uses seed + i: choices differ, and choice 0 of n
    # equals the n=1 request with the same seed.
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed + index)


def _eos_ids(model: torch.nn.Module, tokenizer: object) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return frozenset(ids)


def _pad_id(model: torch.nn.Module, tokenizer: object) -> int:
    config: Any = model.config
    for value in (getattr(tokenizer, "pad_token_id", None), config.pad_token_id):
        if isinstance(value, int):
            return value
    return 0


def _config_cell_bytes(config: Any, parameter: torch.Tensor) -> int:
    """KV bytes of one token of one row, from the config: keys and values of every layer
    in the model's dtype, plus the slab mask's byte."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return 2 * text.num_hidden_layers * kv_heads * head_dim * parameter.element_size() + 1
