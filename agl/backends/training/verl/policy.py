"""verl (0.9.1) as agl's training backend: :class:`VerlPolicy`, agl's ``Policy`` whose
samples, advantages and loss weights are handed to verl's own actor update
(``TrainingWorker.train_mini_batch`` on verl's FSDP engine, the code
``ActorRolloutRefWorker.update_actor`` runs on every GPU worker). It trains what
``TorchBackend`` trains, gradient for gradient (``tests/backends/training/test_verl_backend.py``,
``tests/backends/training/test_verl_sampling.py``: equal to ~1e-6 of the gradient's scale).

The path of one ``train()``:

1. agl's scheduler cuts the step into optimizer mini-batches (a rollout's samples stay in
   one).
2. Before any update, verl's engine runs forward-only (``infer_batch``, as verl's
   ``compute_log_prob``/``compute_ref_log_prob``) where the step needs it: the KL
   reference's logprobs (``kl_coef``), and under a rollout correction (``rollout_is``/
   ``rollout_rs``) π_old, the current weights' own logprobs. The correction
   (``agl.backends.training.correction``, as ``TorchBackend`` applies it) gives each
   action token its IS weight and makes the rejected tokens context, all before the loss
   strategy sees the samples.
3. The loss strategy's weights are computed once per mini-batch, exactly as in
   ``TorchBackend``.
4. Each mini-batch becomes one ``DataProto`` (``dataproto.to_dataproto``, verl's field
   names: ``input_ids``, ``attention_mask``, ``position_ids``, ``prompts``, ``responses``,
   ``response_mask``, ``rollout_log_probs`` (recorded), ``old_log_probs`` (the recorded
   ones, or π_old under a correction: verl's decoupled PPO), ``rollout_is_weights``,
   ``ref_log_prob``, ``advantages``, plus ``agl_loss_weights``, ``agl_advantages`` and
   the per-token ``sampling.SAMPLING_KEYS``), and is handed to verl as ONE verl
   mini-batch (``mini_batch_size`` = the whole hand-off), so whatever verl reorders or
   balances inside it, no rollout is split across updates.
5. verl runs its micro-batches, its ``ppo_loss``/``compute_policy_loss_vanilla`` (inside
   ``loss.agl_ppo_loss``: why that is agl's loss exactly), FSDP's gradient reduction,
   grad clipping and AdamW step.

**Many ranks.** ``backend.ranks > 1`` runs the same hand-offs on verl's ``RayWorkerGroup``
of FSDP workers instead (:mod:`agl.backends.training.verl.ray`): :class:`VerlPolicy`'s
``_updating``/``_update``/``_infer``/``_refresh``/``_dp_size`` (and checkpoints) are the
only steps that differ.
"""

from __future__ import annotations

import copy
import math
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from agl.backends.training.correction import CorrectionConfig, correct
from agl.backends.training.schedule import schedule
from agl.backends.training.verl.config import VerlBackendConfig
from agl.backends.training.verl.dataproto import (
    mini_batch_rows,
    to_dataproto,
    to_infer_tensordict,
    to_train_tensordict,
)
from agl.backends.training.verl.layout import TokenTargets, pad_to_multiple, split
from agl.backends.training.verl.worker import build_worker, lr_step, response_logprobs
from agl.core.contracts.samples import Sample
from agl.core.contracts.strategies import Loss

if TYPE_CHECKING:
    import torch
    import transformers
    from tensordict import TensorDict

__all__ = ["VerlPolicy", "corrected"]


@dataclass
class _Totals:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    clip: list[float] = field(default_factory=list)
    ppo_kl: list[float] = field(default_factory=list)
    tokens_trained: int = 0
    tokens_computed: int = 0
    # agl_ppo_loss's sums over trained tokens (entropy and KL only when penalised)
    penalty_tokens: float = 0.0
    entropy: float | None = None
    kl_reference: float | None = None
    extra: dict[str, float] = field(default_factory=dict)

    def metrics(self, mini_batches: int, train_s: float) -> dict[str, float]:
        out = {
            "loss": _mean(self.losses),
            "grad_norm": _mean(self.grad_norms),
            "clip_fraction": _mean(self.clip),
            "ppo_kl": _mean(self.ppo_kl),
            "tokens_trained": float(self.tokens_trained),
            "tokens_computed": float(self.tokens_computed),
            "mini_batches": float(mini_batches),
            "train_s": train_s,
        }
        per_token = max(self.penalty_tokens, 1.0)  # no trained token: 0, not NaN
        if self.entropy is not None:
            out["entropy"] = self.entropy / per_token
        if self.kl_reference is not None:
            out["kl_reference"] = self.kl_reference / per_token
        return out | self.extra


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _scalars(value: Any) -> list[float]:
    """verl's metric values (a float, a Metric, or lists of them) as floats."""
    if isinstance(value, list | tuple):
        return [x for v in value for x in _scalars(v)]
    inner = getattr(value, "value", value)
    if isinstance(inner, list | tuple):
        return _scalars(list(inner))
    try:
        return [float(inner)]
    except (TypeError, ValueError):
        return []


def corrected(
    samples: Sequence[Sample], old: Sequence[Sequence[float]], config: CorrectionConfig
) -> tuple[list[Sample], list[list[float]], dict[str, float]]:
    """The rollout correction as ``TorchBackend`` applies it: from ``old`` (π_old per
    token, 0 where nothing predicts it) and the recorded logprobs of every action token,
    the samples with the rejected tokens made context, each token's IS weight (1 off the
    actions) and the correction's metrics."""
    actions = [[i for i, a in enumerate(s.action_mask) if a] for s in samples]
    log_ratios = [
        [old[j][i] - samples[j].logprobs[i] for i in positions]
        for j, positions in enumerate(actions)
    ]
    result = correct(log_ratios, config)
    out: list[Sample] = []
    weights: list[list[float]] = []
    for j, s in enumerate(samples):
        mask = list(s.action_mask)
        weight = [1.0] * len(s.tokens)
        for i, w, keep in zip(actions[j], result.weights[j], result.keep[j], strict=True):
            weight[i] = w
            mask[i] = int(keep)
        out.append(s if mask == list(s.action_mask) else replace(s, action_mask=mask))
        weights.append(weight)
    return out, weights, result.metrics


class VerlPolicy:
    """agl's ``Policy`` on verl's actor update (see the module doc).

    ``model`` is updated in place and may be shared with an embedded inference engine:
    ``paused`` (e.g. ``EmbeddedServer.paused``) then gives the block in which nothing
    generates, as for ``CollocatedPolicy``; without one (vLLM serves), the caller publishes
    weights from :meth:`state_dict`. With ``kl_coef`` a second worker holds the KL
    reference, a frozen copy of ``model`` as it is now.
    """

    CHECKPOINT = "verl"
    REFERENCE = "verl_reference"

    def __init__(
        self,
        model: transformers.PreTrainedModel,
        config: VerlBackendConfig,
        tokenizer: Any = None,
        paused: Callable[[], AbstractContextManager[None]] | None = None,
        work_dir: Path | None = None,
    ) -> None:
        self._setup(model, config, tokenizer, paused, work_dir)
        with self.paused():
            # Copied before FSDP converts model in place: the reference's own module.
            frozen = copy.deepcopy(model) if config.kl_coef else None
            self.worker = build_worker(model, tokenizer, config, self.work_dir / "hf_config")
            self.reference = None
            if frozen is not None:
                self.reference = build_worker(
                    frozen, tokenizer, config, self.work_dir / "hf_config_reference", True
                )
            self._unshard()

    def _setup(
        self,
        model: transformers.PreTrainedModel,
        config: VerlBackendConfig,
        tokenizer: Any,
        paused: Callable[[], AbstractContextManager[None]] | None,
        work_dir: Path | None,
    ) -> None:
        """What every verl policy holds, wherever its update runs."""
        self.config = config
        self.model = model
        self.paused = paused or nullcontext
        self._own_dir = work_dir is None
        self.work_dir = Path(work_dir or tempfile.mkdtemp(prefix="agl-verl-"))
        pad_id = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = int(pad_id) if pad_id is not None else 0
        embeddings = cast("torch.nn.Embedding", model.get_input_embeddings())  # typed as a Module
        self.vocab = embeddings.num_embeddings

    def _unshard(self) -> None:
        """Gather every FSDP2 unit's full parameters now, outside inference mode.

        The inference engine runs the shared module under ``torch.inference_mode``, where
        FSDP2's own all-gather fails ("Inference tensors do not track version counter").
        With ``reshard_after_forward=False`` (set by :func:`build_worker`) gathered
        parameters stay gathered, so the engine's forwards need no collective; training
        reshards in backward, so this runs again after every update (an all-gather
        copies the stepped shards into the full parameters the engine reads).
        """
        import torch
        from torch.distributed.fsdp import FSDPModule

        with torch.no_grad():
            for unit in self.worker.engine.module.modules():
                if isinstance(unit, FSDPModule):
                    unit.unshard()

    def train(
        self,
        samples: list[Sample],
        advantages: list[float],
        loss: Loss,
    ) -> dict[str, float]:
        """One step: one verl update per agl mini-batch; answers the step's metrics.

        ``loss`` is called once per mini-batch with its samples, after a rollout
        correction's rejection (if any) made tokens context, as in ``TorchBackend``.
        """
        start = time.perf_counter()
        self._check(samples, advantages)
        plan = schedule(
            samples,
            num_mini_batches=self.config.num_mini_batches,
            ranks=1,  # verl balances its own ranks; any cut of a hand-off is exact
            max_tokens_per_micro_batch=self.config.max_tokens_per_micro_batch,
        )
        dp = self._dp_size()
        totals = _Totals()
        was_training = self.model.training
        try:
            with self._updating():
                samples, targets = self._targets(samples, dp, totals)
                for mini in plan.mini_batches:
                    index = mini.sample_indices
                    chosen = [samples[i] for i in index]
                    rows = mini_batch_rows(
                        chosen,
                        [advantages[i] for i in index],
                        _weights(chosen, loss),
                        [targets[i] for i in index],
                    )
                    rows = pad_to_multiple(rows, dp)
                    trained = sum(1 for r in rows for w in r.weights if w != 0.0)
                    if not trained:
                        totals.losses.append(0.0)
                        totals.grad_norms.append(0.0)
                        continue  # nothing to learn: no step (weight decay stays put too)
                    data = to_dataproto(rows, self.pad_id)
                    td = to_train_tensordict(
                        data,
                        self.config.ppo_epochs,
                        calculate_entropy=bool(self.config.entropy_coef),
                    )
                    out = self._update(td)
                    self._collect(out, totals)
                    totals.tokens_trained += trained
                    totals.tokens_computed += sum(r.length for r in rows)
            lr = self._lr_step()
        finally:
            self.model.train(was_training)
            self._refresh()
        return totals.metrics(len(plan.mini_batches), time.perf_counter() - start) | {"lr": lr}

    def _targets(
        self, samples: list[Sample], dp: int, totals: _Totals
    ) -> tuple[list[Sample], list[TokenTargets]]:
        """Per token, before any update of the step: the reference's logprobs (KL), and
        under a rollout correction π_old (the current weights' own logprobs) and the IS
        weights, with the rejected tokens made context."""
        reference = self._logprobs(samples, dp, reference=True) if self.config.kl_coef else None
        refs: list[list[float] | None] = list(reference) if reference else [None] * len(samples)
        correction = self.config.correction
        if not correction.enabled:
            return samples, [TokenTargets(ref_logprobs=r) for r in refs]
        old = self._logprobs(samples, dp, reference=False)
        samples, is_weights, metrics = corrected(samples, old, correction)
        totals.extra |= metrics
        # rejection alone takes π_old as the ratio's anchor with weight 1 (as TorchBackend)
        use_is = correction.rollout_is is not None
        return samples, [
            TokenTargets(old_logprobs=o, is_weights=w if use_is else None, ref_logprobs=r)
            for o, w, r in zip(old, is_weights, refs, strict=True)
        ]

    def _logprobs(self, samples: list[Sample], dp: int, reference: bool) -> list[list[float]]:
        """Every token's logprob (under its sampling transform; 0 in a row's prompt, where
        nothing is trained) from one forward-only pass of verl's engine: the policy's
        (π_old) or the reference's."""
        rows = [split(s, [0.0] * len(s.tokens), 0.0) for s in samples]
        td = to_infer_tensordict(to_dataproto(pad_to_multiple(rows, dp), self.pad_id))
        values = self._infer(td, reference).tolist()
        # fillers come after the real rows, so zip stops at them
        return [
            [0.0] * len(row.prompt) + v[: len(row.response)]
            for row, v in zip(rows, values, strict=False)
        ]

    def _collect(self, out: Any, totals: _Totals) -> None:
        from verl.utils import tensordict_utils as tu

        metrics = tu.get(out, "metrics") if out is not None else {}
        totals.losses.append(sum(_scalars(metrics.get("loss", []))))
        totals.grad_norms.extend(_scalars(metrics.get("grad_norm", [])))
        totals.clip.extend(_scalars(metrics.get("actor/pg_clipfrac", [])))
        totals.ppo_kl.extend(_scalars(metrics.get("actor/ppo_kl", [])))
        totals.penalty_tokens += sum(_scalars(metrics.get("agl/trained_tokens", [])))
        for key, name in (("agl/entropy_sum", "entropy"), ("agl/kl_reference_sum", "kl_reference")):
            if key in metrics:
                setattr(totals, name, (getattr(totals, name) or 0.0) + sum(_scalars(metrics[key])))

    # -- what differs between verl in this process and verl on Ray (``ray``)

    def _updating(self) -> AbstractContextManager[None]:
        """Held around a step's updates: here FSDP steps the served module itself."""
        return self.paused()

    def _update(self, td: TensorDict) -> Any:
        """One verl mini-batch (``train_mini_batch``); answers its output (metrics)."""
        return self.worker.train_mini_batch(td)

    def _lr_step(self) -> float:
        """After a step's updates: the lr they used; the schedule advances."""
        return lr_step(self.worker)

    def _infer(self, td: TensorDict, reference: bool) -> torch.Tensor:
        """A forward-only pass: ``[rows, R]`` logprobs of the response columns."""
        worker = self.reference if reference else self.worker
        output = response_logprobs(worker, td)
        assert output is not None  # in-process: the one rank, which always answers
        return output["log_probs"]

    def _refresh(self) -> None:
        """After a step: make the served module hold the updated weights."""
        with self.paused():
            self._unshard()

    def _dp_size(self) -> int:
        return int(self.worker.engine.get_data_parallel_size())

    def _check(self, samples: list[Sample], advantages: list[float]) -> None:
        from agl.backends.training.inputs import check_train_inputs

        for s in samples:
            if s.parents is not None or s.position_ids is not None:
                split(s, [0.0] * len(s.tokens), 0.0)  # raises TreeSampleError
        check_train_inputs(samples, advantages, self.vocab)

    # -- weights and checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The model's full (unsharded) weights as CPU copies (later steps leave them be),
        keyed as the HF model's own ``state_dict``, e.g. for a vLLM weight reload."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        # a full model state dict: tensors only (its type admits any state value)
        state = cast(
            "dict[str, torch.Tensor]",
            get_model_state_dict(self.worker.engine.module, options=options),
        )
        # On CPU "offload" is a no-op: the tensors would be the live parameters.
        return {k: v.detach().clone() for k, v in state.items()}

    def save(self, folder: Path) -> None:
        """verl's own FSDP checkpoint (model, optimizer, lr scheduler) under ``folder``,
        and the KL reference's weights (a resumed run keeps its anchor)."""
        self.worker.save_checkpoint(str(folder / self.CHECKPOINT))
        if self.reference is not None:
            self.reference.save_checkpoint(str(folder / self.REFERENCE))

    def load(self, folder: Path) -> None:
        with self.paused():
            self.worker.load_checkpoint(str(folder / self.CHECKPOINT), del_local_after_load=False)
            if self.reference is not None and (folder / self.REFERENCE).is_dir():
                self.reference.load_checkpoint(
                    str(folder / self.REFERENCE), del_local_after_load=False
                )
            self._unshard()

    def close(self) -> None:
        if self._own_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)


def _weights(samples: list[Sample], loss: Loss) -> list[list[float]]:
    """The loss strategy's weights over one mini-batch (as ``TorchBackend._weights``);
    negative weights are refused (folding needs ``w ≥ 0``)."""
    computed = loss(samples)
    if len(computed) != len(samples):
        raise ValueError(
            f"the loss strategy returned weights for {len(computed)} samples, "
            f"expected {len(samples)}"
        )
    out = []
    for s, w in zip(samples, computed, strict=True):
        if len(w) != len(s.tokens):
            raise ValueError(
                f"the loss strategy returned {len(w)} weights for a sample of "
                f"{len(s.tokens)} tokens"
            )
        row = [float(x) for x in w]
        if not all(math.isfinite(x) and x >= 0.0 for x in row):
            raise ValueError(
                "loss weights must be finite and >= 0 for verl (they are folded into the "
                "advantage, which is exact for w >= 0 only)"
            )
        out.append(row)
    return out
