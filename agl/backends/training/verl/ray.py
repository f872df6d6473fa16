"""verl's FSDP workers on Ray as agl's training backend (``backend=verl backend.ranks=N``).

:class:`RayVerlPolicy` is :class:`~agl.backends.training.verl.policy.VerlPolicy` with the update
moved out of the trainer's process: a verl ``RayWorkerGroup`` of ``N``
:class:`AglTrainingWorker` actors (verl's ``TrainingWorker``, one FSDP rank each) over a
``RayResourcePool``, the layout verl's own ``RayPPOTrainer`` gives its actor. The samples,
weights, mini-batches and the ``TensorDict`` handed over are the in-process path's
(``VerlPolicy.train``); only where the update runs differs:

1. **Build.** Every worker loads the model through verl's own ``_build_module``
   (``from_pretrained``, then FSDP2 shards it) from ``model.path`` itself when the
   trainer's module still holds exactly those weights (``model=hf`` in float32, no
   warm-up, no ``revision``, which verl's loader cannot name), else from the copy the
   trainer writes (``save_pretrained``) to ``work_dir/hf_model``: either way all ranks
   start from the very weights the inference engine serves.
2. **Update.** Each agl mini-batch (padded to a multiple of the dp size with rows that
   train nothing) is ONE call of :meth:`AglTrainingWorker.agl_train`, dispatched by verl's
   ``train`` mesh (``DataProto``-style contiguous chunks, one per dp rank); each rank runs
   ``train_mini_batch`` on its chunk, FSDP averages gradients over the ranks, and
   ``token-sum``'s ``* dp_size`` cancels that average: the update is agl's loss over the
   whole hand-off (``tests/backends/training/test_verl_ray.py`` checks it against ``TorchBackend``).
3. **Weights back.** After a step rank 0 gathers the full state dict
   (``get_model_state_dict(full_state_dict=True, cpu_offload=True)``, a collective every
   rank joins), and the trainer loads it into its module under ``paused()``: the embedded
   engine then serves it; vLLM with ``weight_sync=file`` publishes from the module.
   With vLLM and ``weight_sync=distributed`` (``build.policy_for`` wires it) nothing comes
   back: verl's rank 0 is the weight sender (:class:`RayWeightSource`). It hosts the
   group the replicas join (:meth:`AglTrainingWorker.agl_weight_listen`), and per publish
   every rank walks the module's parameters in order, gathering each (``full_tensor``, a
   collective) while rank 0 packs it in the serving dtype and broadcasts bucket by
   bucket (:meth:`AglTrainingWorker.agl_send_weights`), as the replicas receive it
   against the manifest rank 0 computed from parameter metadata beforehand: no full
   state dict is held, nor goes through Ray's object store. The trainer's module then
   keeps the starting weights: nothing reads it during training (π_old and the
   reference are the workers', checkpoints are verl's; after a ``load`` the trainer
   publishes from rank 0 too).
4. **Checkpoints** are verl's (``save_checkpoint``/``load_checkpoint`` on every rank, one
   shard per rank under ``folder/verl``); a load pulls the weights back as in 3.

5. **Sampling, reference, correction** as in-process: each worker's engine is verl's
   FSDP engine with agl's per-token sampling transform (``sampling.sampling_engine``,
   selected through ``VERL_ENGINE_DEVICE`` on every device); with ``kl_coef`` each rank
   also holds a shard of the KL reference (a second ``TrainingWorker``, loaded from the
   same folder, so it is the weights the policy started from), and the forward-only
   passes (π_old for a rollout correction, the reference's logprobs) are
   :meth:`AglTrainingWorker.agl_logprobs`/``agl_reference_logprobs`` (verl's
   ``infer_batch`` per dp chunk, answers concatenated in order).

**CPU.** verl has no CPU platform; each worker registers agl's CPU platform
(:func:`~agl.backends.training.verl.platform.ensure_cpu_platform`) and starts its gloo process
group from the ``RANK``/``WORLD_SIZE``/``MASTER_*`` env ``RayWorkerGroup`` gives it, in its
``__init__`` before verl's ``TrainingWorker.__init__`` runs (which would otherwise try
NCCL on a CUDA platform it falls back to). The resource pool then asks for CPU bundles
only (``use_gpu=False``). On GPUs nothing of this runs: verl's CUDA platform and its own
NCCL group are used, one GPU per rank.

**Placement.** ``backend.ranks`` = ``gpus_per_node`` x nodes: one ``STRICT_PACK``
placement group of ``gpus_per_node`` one-rank bundles per node (verl's trainer's
``process_on_nodes = [n_gpus_per_node] * nnodes``), checked against the cluster's nodes
first (:func:`check_fits`: a group no node can hold is an error, not a wait). A Ray agl
starts itself (``ray_address`` null) is this node alone and declares only the first
``ranks`` visible GPUs (:func:`start_ray`); the ones after them are vLLM's
(``inference.training_gpus``, :mod:`agl.backends.inference.vllm_placement`).

Invariant: the trainer's module is never FSDP-wrapped on this path (the workers hold the
shards), so it stays the plain ``nn.Module`` the inference engine serves.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from verl.single_controller.base.decorator import (
    Dispatch,
    dispatch_lazy_compute_data_proto,
    make_nd_compute_dataproto_dispatch_fn,
    register,
)
from verl.workers.engine_workers import TrainingWorker

from agl.backends.inference.vllm_placement import CUDA_VISIBLE_DEVICES, visible_gpus
from agl.backends.inference.weight_sync import (
    BUCKET_BYTES,
    WeightSender,
    full,
    parameter_specs,
    plan_specs,
)
from agl.backends.training.lr_schedule import LrSchedule
from agl.backends.training.verl.config import VerlBackendConfig
from agl.backends.training.verl.loss import loss_fn
from agl.backends.training.verl.platform import (
    ensure_cpu_platform,
    ensure_process_group,
    override_env,
)
from agl.backends.training.verl.policy import VerlPolicy
from agl.backends.training.verl.sampling import register_sampling_engine
from agl.backends.training.verl.worker import (
    follow_schedule,
    lr_step,
    response_logprobs,
    worker_config,
)

if TYPE_CHECKING:
    import torch
    import transformers
    from tensordict import TensorDict
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    from agl.backends.inference.pretrained import PretrainedOptions

logger = logging.getLogger(__name__)

__all__ = ["AglTrainingWorker", "RayVerlPolicy", "RayWeightSource", "RayWorkers", "start_ray"]


# --- the worker (runs inside a Ray actor process) ------------------------------------------


def _train_dispatch(worker_group: Any, *args: Any, **kwargs: Any) -> Any:
    """verl's ``train`` mesh dispatch (``train_mini_batch``'s): one chunk per dp rank."""
    return dispatch_lazy_compute_data_proto("train", worker_group, *args, **kwargs)


def _to_all(worker_group: Any, *args: Any, **kwargs: Any) -> Any:
    """The same arguments to every rank (verl's ``ONE_TO_ALL``)."""
    n = worker_group.world_size
    return tuple([a] * n for a in args), {k: [v] * n for k, v in kwargs.items()}


def _rank_zero(worker_group: Any, output: list[Any]) -> Any:
    """Rank 0's answer: every dp rank of the ``train`` mesh answers the same metrics
    (verl all-gathers them over dp), and rank 0 alone holds a gathered state dict."""
    return output[0]


# verl registers its dispatch modes at import time (``Dispatch.register``): the member
# ``Dispatch.ONE_TO_ALL`` is, by name, ``Dispatch["ONE_TO_ALL"]``, the one mypy can see.
ONE_TO_ALL: Dispatch = Dispatch["ONE_TO_ALL"]
TRAIN_DISPATCH = {"dispatch_fn": _train_dispatch, "collect_fn": _rank_zero}
ONE_TO_ALL_RANK_ZERO = {"dispatch_fn": _to_all, "collect_fn": _rank_zero}
# One chunk per dp rank, the ranks' answers concatenated in order (verl's infer_batch mesh).
INFER_DISPATCH = make_nd_compute_dataproto_dispatch_fn(mesh_name="train")


class AglTrainingWorker(TrainingWorker):
    """verl's ``TrainingWorker`` with agl's device setup and the methods the trainer
    calls through the worker group (verl's ``@register`` dispatch).

    The engine is verl's FSDP engine with agl's per-token sampling transform
    (``sampling.sampling_engine``, on every device). ``reference`` (a worker config): this
    rank also holds the KL reference, a second ``TrainingWorker`` only run forward, as
    verl's ``ActorRolloutRefWorker`` holds its ``ref`` (built by
    :meth:`agl_reference_reset`).
    """

    def __init__(
        self, config: Any, device: str, threads: int, reference: Any | None = None
    ) -> None:
        import torch

        torch.set_num_threads(max(1, threads))
        if device == "cpu":
            # Before verl's __init__: it starts NCCL on the CUDA platform it falls back to.
            ensure_cpu_platform()
            ensure_process_group()  # gloo, from RayWorkerGroup's RANK/WORLD_SIZE/MASTER_*
        with override_env("VERL_ENGINE_DEVICE", register_sampling_engine()):
            super().__init__(config)
            self.agl_reference = TrainingWorker(reference) if reference is not None else None

    @register(dispatch_mode=TRAIN_DISPATCH)
    def agl_train(self, data: TensorDict) -> TensorDict | None:
        """``train_mini_batch`` on this rank's chunk; the metrics (rank 0's answered)."""
        output = self.train_mini_batch(data)
        return output.cpu() if output is not None else None

    @register(dispatch_mode=ONE_TO_ALL)
    def agl_follow_schedule(self, schedule: LrSchedule) -> None:
        follow_schedule(self, schedule)

    @register(dispatch_mode=ONE_TO_ALL_RANK_ZERO)
    def agl_lr_step(self) -> float:
        """Every rank advances its lr schedule one step (the step's last call); the lr
        the step used. The CUDA cache is emptied: what offload moved to the CPU would
        otherwise stay reserved on the GPU a sleeping vLLM wakes on (verl's trainer
        empties it before the rollout wakes too)."""
        import torch

        lr = lr_step(self)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return lr

    @register(dispatch_mode=INFER_DISPATCH)
    def agl_logprobs(self, data: TensorDict) -> TensorDict | None:
        """This rank's chunk's response logprobs under the current weights (π_old)."""
        return response_logprobs(self, data)

    @register(dispatch_mode=INFER_DISPATCH)
    def agl_reference_logprobs(self, data: TensorDict) -> TensorDict | None:
        """This rank's chunk's response logprobs under the KL reference."""
        return response_logprobs(self._reference(), data)

    @register(dispatch_mode=ONE_TO_ALL)
    def agl_reference_reset(self) -> None:
        """Build the reference's engine (FSDP-shards it over the ranks: all must call)."""
        self._reference().reset()

    @register(dispatch_mode=ONE_TO_ALL)
    def agl_reference_save(self, local_path: str) -> None:
        self._reference().save_checkpoint(local_path)

    @register(dispatch_mode=ONE_TO_ALL)
    def agl_reference_load(self, local_path: str) -> None:
        self._reference().load_checkpoint(local_path, del_local_after_load=False)

    def _fsdp_engine(self) -> FSDPEngine:
        """This rank's engine, verl's FSDP one (agl's sampling subclass of it), which
        ``TrainingWorker`` types as its ``BaseEngine``."""
        return cast("FSDPEngine", self.engine)

    def _reference(self) -> TrainingWorker:
        if self.agl_reference is None:
            raise RuntimeError("this worker holds no KL reference (kl_coef was 0)")
        return self.agl_reference

    @register(dispatch_mode=ONE_TO_ALL_RANK_ZERO)
    def agl_full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full weights on rank 0 (``{}`` elsewhere); every rank must call it."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        # a full model state dict: tensors only (its type admits any state value)
        state = cast(
            "dict[str, torch.Tensor]",
            get_model_state_dict(self._fsdp_engine().module, options=options),
        )
        return {k: v.detach().clone() for k, v in state.items()}

    # -- rank 0 as vLLM's weight sender (RayWeightSource): called on the actors directly

    def agl_weight_listen(
        self, peer_host: str, world_size: int, backend: str, timeout_s: float
    ) -> tuple[str, int]:
        """Rank 0 only: serve the weight-sync group's store on this node's route to
        ``peer_host`` (a replica) and start joining the group (it waits for the replicas;
        :meth:`agl_weight_joined` waits for it); answers where the replicas join."""
        self.agl_sender = WeightSender(peer_host, timeout_s=timeout_s)
        return self.agl_sender.listen(world_size, backend)

    def agl_weight_joined(self) -> None:
        """Rank 0 only: wait for the group :meth:`agl_weight_listen` started."""
        self._sender().joined()

    def agl_weight_manifest(self, dtype: str, policy_version: int) -> str:
        """Rank 0 only: the manifest of the next :meth:`agl_send_weights`, from the
        parameters' metadata (nothing gathered)."""
        return self._sender().manifest(self._weight_plan(dtype), _dtype(dtype), policy_version)

    def agl_send_weights(self, dtype: str) -> int:
        """Every rank: each parameter gathered in plan order (``full_tensor``: all ranks
        join each); rank 0 packs them in ``dtype`` and broadcasts each bucket to the
        replicas. Answers the bytes sent (0 off rank 0)."""
        import torch
        import torch.distributed as dist
        from verl.utils.fsdp_utils import load_fsdp_model_to_gpu, offload_fsdp_model_to_cpu

        engine = self._fsdp_engine()
        buckets = self._weight_plan(dtype)
        # param_offload keeps the shards in host memory between updates; NCCL gathers
        # device memory: on the GPU for the send, as verl's own per-tensor sync does.
        staged = bool(getattr(engine, "_is_offload_param", False)) and torch.cuda.is_available()
        if staged:
            load_fsdp_model_to_gpu(engine.module)
        _, tensors = parameter_specs(engine.module)  # after the move: the moved shards

        def produce(entry: Any) -> torch.Tensor:
            return full(tensors[entry.index])

        try:
            if dist.get_rank() != 0:
                with torch.no_grad():
                    for bucket in buckets:
                        for entry in bucket.entries:
                            produce(entry)  # this rank's part of each gather
                return 0
            sender = self._sender()
            device = sender.device or torch.device("cuda", torch.cuda.current_device())
            return sender.push(buckets, _dtype(dtype), device, produce)
        finally:
            if staged:
                offload_fsdp_model_to_cpu(engine.module)

    def _weight_plan(self, dtype: str) -> list[Any]:
        specs, _ = parameter_specs(self._fsdp_engine().module)
        return plan_specs(specs, _dtype(dtype), BUCKET_BYTES)

    def _sender(self) -> WeightSender:
        sender: WeightSender | None = getattr(self, "agl_sender", None)
        if sender is None:
            raise RuntimeError("rank 0 holds no weight-sync group (agl_weight_listen first)")
        return sender

    @register(dispatch_mode=ONE_TO_ALL)
    def agl_optimizer_steps(self) -> int:
        """AdamW steps this rank has taken (every rank answers: they must agree)."""
        steps = [
            int(state["step"])
            for state in self._fsdp_engine().optimizer.state.values()
            if "step" in state
        ]
        return max(steps, default=0)

    @register(dispatch_mode=ONE_TO_ALL_RANK_ZERO)
    def agl_dp_size(self) -> int:
        return int(self.engine.get_data_parallel_size())


def _dtype(name: str) -> torch.dtype:
    """A torch dtype from its name (``float32``), as the manifest spells it."""
    import torch

    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype), name
    return dtype


# --- Ray and the worker group (the trainer's side) ----------------------------------------


def start_ray(
    address: str | None, num_cpus: int, object_store_mb: int = 256, gpus: int | None = None
) -> bool:
    """Connect to Ray; answers whether this call started it (then :meth:`RayWorkers.close`
    shuts it down). ``address`` None starts a local Ray (``num_cpus`` logical CPUs, no
    dashboard, a small object store) that holds only training's GPUs: the first ``gpus``
    visible ones (None: all), the rest left to vLLM's replicas
    (:mod:`agl.backends.inference.vllm_placement`); else it joins a running cluster
    (``"auto"`` or ``host:port``, as ``ray start`` printed), whose nodes declared their
    own. An already initialized Ray is used as is.
    """
    import ray

    if ray.is_initialized():
        return False
    # Ray workers import agl: the trainer's own import path, whatever the worker's cwd.
    root = str(Path(__file__).resolve().parents[4])  # agl/backends/training/verl/ray.py
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    runtime_env = {"env_vars": {"PYTHONPATH": path}}
    if address is None:
        training = training_gpus(visible_gpus(), gpus)
        # Ray reads the node's GPUs from CUDA_VISIBLE_DEVICES in this process, and its
        # raylet and workers inherit it: set for the start only, so Ray can hand out
        # (and its workers see) exactly training's devices, never a replica's.
        declared = override_env(CUDA_VISIBLE_DEVICES, ",".join(training))
        with declared if training else nullcontext():
            ray.init(
                # A Ray of its own, even where a cluster runs on this machine (ray start,
                # another run): a plain init would join that one instead.
                address="local",
                num_cpus=num_cpus,
                num_gpus=len(training),
                include_dashboard=False,
                object_store_memory=object_store_mb * 1024 * 1024,
                runtime_env=runtime_env,
                logging_level=logging.WARNING,
                log_to_driver=True,
            )
    else:
        ray.init(address=address, runtime_env=runtime_env, logging_level=logging.WARNING)
    return True


def training_gpus(visible: list[str], gpus: int | None) -> list[str]:
    """The GPUs agl's local Ray declares: the first ``gpus`` of ``visible`` (None: all);
    none on a machine without them (ranks then run on CPU); a ``ValueError`` (one line)
    when the node has fewer than ``gpus``."""
    if not visible or gpus is None:
        return visible
    if gpus > len(visible):
        raise ValueError(
            f"backend.ranks={gpus} needs {gpus} GPUs on this node for agl's local Ray; "
            f"{len(visible)} are visible ({','.join(visible)}): lower backend.ranks, or "
            "join a cluster (backend.ray_address, backend.gpus_per_node)"
        )
    return visible[:gpus]


@dataclass
class RayWorkers:
    """``config.ranks`` verl workers (:class:`AglTrainingWorker`) in one ``RayWorkerGroup``.

    ``device`` ``cpu``: CPU bundles, gloo, agl's CPU platform in every worker; ``cuda``:
    one GPU per rank (verl's defaults). ``group`` answers verl's registered methods
    (``agl_train``, ``save_checkpoint``, ...) across all ranks.

    Placement: one placement group per node of ``config.process_on_nodes`` (verl's
    layout: ``gpus_per_node`` bundles of one rank each, packed on one node; the groups
    on distinct nodes when each fills one), checked against the cluster's nodes before
    it is asked for, since a group no node can hold would wait forever.
    """

    group: Any
    pool: Any
    started_ray: bool
    closed: bool = False

    @classmethod
    def start(
        cls,
        config: VerlBackendConfig,
        model_path: str | Path,
        address: str | None,
        trust_remote_code: bool = False,
        *,
        bundle_resource: str | None = None,
    ) -> RayWorkers:
        """``bundle_resource``: the accelerator each rank's bundle reserves; None: the
        device's (verl's platform's, ``GPU`` for CUDA; none on CPU). ``"GPU"`` with
        ``device: cpu`` is for a cluster whose nodes declare logical GPUs they do not
        have (the tests): the ranks hold the GPUs' places and compute on CPU with gloo."""
        import ray
        from verl.single_controller.ray import (
            RayClassWithInitArgs,
            RayResourcePool,
            RayWorkerGroup,
        )
        from verl.utils.device import get_platform

        ranks = config.ranks
        # CPU ranks need no GPU: a local Ray then declares the node's as before.
        gpus = None if config.device == "cpu" else ranks
        started = start_ray(address, num_cpus=ranks + 1, gpus=gpus)
        try:
            device = _device(config)
            if device == "cpu":
                ensure_cpu_platform()  # verl's platform: the workers' device and backend
            elif bundle_resource is None:
                bundle_resource = get_platform().ray_resource_name()
            # One process per bundle: max_colocate_count is the CPUs a bundle reserves.
            # Any: its placement groups are set here (verl types the attribute None).
            pool: Any = RayResourcePool(
                process_on_nodes=config.process_on_nodes,
                use_gpu=device != "cpu",
                max_colocate_count=1,
            )
            bundle = {"CPU": 1.0, **({bundle_resource: 1.0} if bundle_resource else {})}
            pool.pgs = placement_groups(config.process_on_nodes, bundle)
            # CPU ranks share this machine's cores; a GPU rank has its node's to itself.
            threads = config.torch_threads
            if device == "cpu":
                threads = max(1, threads // ranks)
            reference = None
            if config.kl_coef:
                reference = worker_config(config, model_path, True, trust_remote_code)
            worker = RayClassWithInitArgs(
                ray.remote(AglTrainingWorker),
                config=worker_config(config, model_path, trust_remote_code=trust_remote_code),
                device=device,
                threads=threads,
                reference=reference,
            )
            # Any: the group binds AglTrainingWorker's @register methods at runtime
            group: Any = RayWorkerGroup(
                resource_pool=pool,
                ray_cls_with_init=worker,
                device_name=device,
                worker_env={"OMP_NUM_THREADS": str(threads)},
            )
            group.reset()  # every rank builds verl's FSDP engine from the folder
            group.set_loss_fn(loss_fn(config))
            group.agl_follow_schedule(config)
            if reference is not None:
                # the same folder: the reference is the weights the policy started from
                group.agl_reference_reset()
        except BaseException:
            if started:
                ray.shutdown()
            raise
        return cls(group=group, pool=pool, started_ray=started)

    def close(self) -> None:
        """Kill the workers, free their placement groups, stop Ray if we started it."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if self.closed or not ray.is_initialized():
            return
        self.closed = True
        for handle in getattr(self.group, "_workers", []):
            ray.kill(handle, no_restart=True)
        for pg in self.pool.pgs or []:
            remove_placement_group(pg)
        if self.started_ray:
            ray.shutdown()


def placement_groups(process_on_nodes: list[int], bundle: dict[str, float]) -> list[Any]:
    """One ``STRICT_PACK`` placement group per entry of ``process_on_nodes`` (that many
    ``bundle``s, one node each), ready, in verl's order (by node address): the groups
    ``RayResourcePool.get_placement_groups`` would make, with ``bundle`` chosen here."""
    import ray
    from ray.util.placement_group import placement_group
    from verl.single_controller.ray.base import sort_placement_group_by_node_ip

    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    check_fits(process_on_nodes, bundle, nodes)
    pgs = [
        placement_group([dict(bundle)] * count, strategy="STRICT_PACK")
        for count in process_on_nodes
    ]
    ray.get([pg.ready() for pg in pgs])
    return list(sort_placement_group_by_node_ip(pgs))


def check_fits(
    process_on_nodes: list[int], bundle: dict[str, float], nodes: list[dict[str, float]]
) -> None:
    """A ``ValueError`` (one line) when no assignment of the groups to ``nodes`` (their
    total resources) gives each group a node of its own capacity: Ray would leave it
    pending forever. First fit, largest group first: exact for verl's equal groups."""
    free = [dict(node) for node in nodes]
    for count in sorted(process_on_nodes, reverse=True):
        need = {k: v * count for k, v in bundle.items()}
        for node in free:
            if all(node.get(k, 0.0) >= v for k, v in need.items()):
                for k, v in need.items():
                    node[k] -= v
                break
        else:
            have = "; ".join(
                ", ".join(f"{k} {node.get(k, 0.0):g}" for k in bundle) for node in nodes
            )
            raise ValueError(
                f"backend: {len(process_on_nodes)} node(s) x {max(process_on_nodes)} ranks "
                f"(each {', '.join(f'{k} {v:g}' for k, v in bundle.items())}) do not fit "
                f"this Ray cluster's nodes ({have or 'none'}): set backend.gpus_per_node to "
                "at most a node's GPUs (ranks = gpus_per_node x nodes)"
            )


def _device(config: VerlBackendConfig) -> str:
    """``cuda`` where the cluster has GPUs (``device: auto``) or ``device: cuda``; else
    ``cpu``: Ray workers run where the cluster's resources are, not where the trainer is."""
    import ray

    if config.device in ("cpu", "cuda"):
        return config.device
    return "cuda" if ray.cluster_resources().get("GPU", 0) >= 1 else "cpu"


# --- the policy ----------------------------------------------------------------------------


class RayVerlPolicy(VerlPolicy):
    """agl's ``Policy`` on verl's ``RayWorkerGroup`` of FSDP workers (see the module doc).

    ``model`` (the module the inference engine serves) stays a plain module on the
    trainer; after every ``train()`` and ``load()`` it holds the workers' weights, unless
    ``weight_source()`` was given out (the engine then gets them from rank 0).
    """

    def __init__(
        self,
        model: transformers.PreTrainedModel,
        config: VerlBackendConfig,
        tokenizer: Any = None,
        paused: Callable[[], AbstractContextManager[None]] | None = None,
        work_dir: Path | None = None,
        weights_from: PretrainedOptions | None = None,
        trust_remote_code: bool = False,
        *,
        bundle_resource: str | None = None,  # RayWorkers.start's (tests: logical GPUs)
    ) -> None:
        self._setup(model, config, tokenizer, paused, work_dir)
        start = time.perf_counter()
        if weights_from is not None:
            source: str | Path = weights_from.path
        else:
            source = _model_folder(model, tokenizer, self.work_dir / "hf_model")
        self.model_source = source
        self.workers = RayWorkers.start(
            config, source, config.ray_address, trust_remote_code, bundle_resource=bundle_resource
        )
        # agl.train closes its policy; any other owner that forgets still loses the
        # workers (and a Ray we started) at exit, before Ray's own handler (LIFO).
        atexit.register(self.close)
        self._dp = int(self.workers.group.agl_dp_size())
        self.publishes_itself = False  # weight_source() was given out: no _pull per step
        self.startup_s = time.perf_counter() - start
        logger.info("verl on Ray: %d ranks ready in %.1fs", config.ranks, self.startup_s)

    # -- VerlPolicy's hooks: the update runs on the workers

    def _updating(self) -> AbstractContextManager[None]:
        """Nothing here touches the served module while the workers train, so the
        engine may keep serving (the pause is only around the weight load)."""
        return nullcontext()

    def _update(self, td: TensorDict) -> Any:
        return self.workers.group.agl_train(td)

    def _lr_step(self) -> float:
        return float(self.workers.group.agl_lr_step())

    def _infer(self, td: TensorDict, reference: bool) -> torch.Tensor:
        group = self.workers.group
        output = group.agl_reference_logprobs(td) if reference else group.agl_logprobs(td)
        return output["log_probs"]

    def _refresh(self) -> None:
        if not self.publishes_itself:
            self._pull()

    def weight_source(self) -> RayWeightSource:
        """verl's rank 0 as the inference engine's weight sender; from now on a step no
        longer loads the weights into the trainer's module (the engine gets them from
        rank 0: ``VllmServers.publish_from``)."""
        self.publishes_itself = True
        return RayWeightSource(self.workers.group, _device(self.config))

    def _dp_size(self) -> int:
        return self._dp

    # -- weights and checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The workers' full weights (rank 0, gathered), as CPU tensors."""
        return dict(self.workers.group.agl_full_state_dict())

    def _pull(self) -> None:
        """The workers' weights into the served module, under ``paused()``."""
        import torch

        state = self.state_dict()
        with self.paused(), torch.no_grad():
            missing, unexpected = self.model.load_state_dict(state, strict=False)
        # Tied weights appear under one name only; anything else is a real mismatch.
        if unexpected or any(not _tied(self.model, k) for k in missing):
            raise RuntimeError(f"weights from verl: missing {missing}, unexpected {unexpected}")

    def save(self, folder: Path) -> None:
        """verl's FSDP checkpoint (a shard per rank: model, optimizer, lr scheduler), and
        the KL reference's weights (a shard per rank)."""
        self.workers.group.save_checkpoint(str(folder / self.CHECKPOINT))
        if self.config.kl_coef:
            self.workers.group.agl_reference_save(str(folder / self.REFERENCE))

    def load(self, folder: Path) -> None:
        path = str(folder / self.CHECKPOINT)
        self.workers.group.load_checkpoint(path, del_local_after_load=False)
        if self.config.kl_coef and (folder / self.REFERENCE).is_dir():
            self.workers.group.agl_reference_load(str(folder / self.REFERENCE))
        self._refresh()  # the trainer publishes after a load (its resume)

    def close(self) -> None:
        """Stop the workers (and Ray, if this policy started it); idempotent."""
        atexit.unregister(self.close)
        self.workers.close()
        if self._own_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)


class RayWeightSource:
    """verl's rank 0 as the sender of vLLM's weight-sync group (``weight_sync.WeightSource``):
    the trainer asks the replicas to join and receive while the workers host the group
    and broadcast. Every rank's ``agl_send_weights`` runs at once (Ray futures, one per
    actor), since each gather is a collective of all ranks.

    Invariant: ``send`` returns only when every replica answered ``receive`` and every
    rank finished its part; on a failure the source is disconnected (the next publish
    makes rank 0 host a new group)."""

    def __init__(self, group: Any, device: str) -> None:
        """``device``: where the ranks compute (``_device``'s answer, cpu or cuda)."""
        self._group = group
        self._device = device
        self._connected = False

    @property
    def _workers(self) -> list[Any]:
        return list(self._group._workers)  # the actors, in rank order

    name = "verl's rank 0"

    @property
    def connected(self) -> bool:
        return self._connected

    @property
    def on_gpu(self) -> bool:
        return self._device == "cuda"

    def connect(
        self,
        peer_host: str,
        world_size: int,
        backend: str,
        timeout_s: float,
        join: Callable[[str, int], None],
    ) -> None:
        import ray

        rank0 = self._workers[0]
        self._connected = False
        address, port = ray.get(
            rank0.agl_weight_listen.remote(peer_host, world_size, backend, timeout_s)
        )
        join(address, port)  # the replicas join; rank 0's thread meanwhile builds the group
        ray.get(rank0.agl_weight_joined.remote())
        self._connected = True

    def send(self, dtype: torch.dtype, policy_version: int, receive: Callable[[str], None]) -> int:
        import ray

        name = str(dtype).removeprefix("torch.")
        workers = self._workers
        manifest = ray.get(workers[0].agl_weight_manifest.remote(name, policy_version))
        sending = [w.agl_send_weights.remote(name) for w in workers]
        try:
            receive(manifest)
            return int(ray.get(sending)[0])
        except BaseException:
            # rank 0 may still be mid-broadcast: the next publish builds a new group
            self._connected = False
            raise

    def close(self) -> None:
        """Forget the group (rank 0 replaces it at the next ``connect``): no call to the
        workers, which may be gone already."""
        self._connected = False


def _tied(model: transformers.PreTrainedModel, name: str) -> bool:
    """Whether ``name`` is a tied parameter (e.g. ``lm_head.weight`` = the embedding)."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return False
    out = model.get_output_embeddings()
    return out is not None and out.weight is model.get_input_embeddings().weight


def _model_folder(model: transformers.PreTrainedModel, tokenizer: Any, folder: Path) -> Path:
    """``model`` (weights + config) and ``tokenizer`` as an HF folder verl's
    ``_build_module`` loads (``from_pretrained``); answers ``folder``."""
    import copy

    folder.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(model.config)
    if not getattr(config, "architectures", None):
        config.architectures = [type(model).__name__]  # verl asserts exactly one
    model.save_pretrained(folder, safe_serialization=True)
    config.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder
