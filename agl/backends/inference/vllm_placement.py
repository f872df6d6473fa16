"""Which GPUs each vLLM replica started here gets (``inference=vllm``'s placement).

A replica is one ``vllm serve`` process. On a GPU machine replica ``i`` is started with
its own ``CUDA_VISIBLE_DEVICES`` (``tensor_parallel_size`` devices), ``--tensor-parallel-
size`` and ``--gpu-memory-utilization``; on a machine without CUDA nothing GPU-specific
is rendered (vLLM for CPU takes its KV space from ``VLLM_CPU_KVCACHE_SPACE``).

The node's split, on the trainer's node (the one the replicas are started on):

- training takes the FIRST ``training_gpus`` visible GPUs: the trainer's own device
  (``cuda:0``, in-process training) or the ranks of the Ray that agl starts locally
  (``start_ray`` declares exactly those to Ray);
- replica ``i`` takes the next ``tensor_parallel_size`` visible GPUs after them
  (``gpus`` null), or the devices ``gpus[i]`` names.

Invariants of :func:`place_replicas`: no GPU is given to two replicas; no replica gets a
GPU training takes; every replica gets exactly ``tensor_parallel_size`` visible devices;
a placement that cannot be met is refused with one line (:class:`PlacementError`)
before any replica starts.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "CUDA_VISIBLE_DEVICES",
    "PlacementError",
    "ReplicaPlacement",
    "place_replicas",
    "visible_gpus",
]

CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
DEVICES = ("auto", "cpu", "cuda")

# A replica's GPUs as ``inference.gpus`` lists them: one id (tensor_parallel_size 1) or a
# list of ids; an id as nvidia-smi numbers it (or a GPU's UUID).
GpuIds = int | str | Sequence[int | str]


class PlacementError(RuntimeError):
    """A placement that cannot be met; the message is one line naming the options."""


@dataclass(frozen=True)
class ReplicaPlacement:
    """One replica's share of the node: its devices (``()`` on a machine without CUDA)."""

    devices: tuple[str, ...]
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9

    def env(self) -> dict[str, str]:
        """The replica's ``CUDA_VISIBLE_DEVICES`` (nothing on CPU)."""
        return {CUDA_VISIBLE_DEVICES: ",".join(self.devices)} if self.devices else {}

    def args(self) -> list[str]:
        """``vllm serve`` flags: on a GPU both, always (vLLM's own memory default would
        hide a share the recipe did not choose); on CPU only a tensor-parallel size
        other than 1 (vLLM for CPU shards over processes too)."""
        tp = ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        if self.devices:
            return [*tp, "--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        return tp if self.tensor_parallel_size != 1 else []


def visible_gpus(device: str = "auto", cuda_count: int | None = None) -> list[str]:
    """This node's GPUs as the trainer sees them, named as ``CUDA_VISIBLE_DEVICES`` names
    them (its entries when set, else ``0..n-1``).

    ``device``: ``cpu`` → none; ``cuda`` → the listed ones when ``CUDA_VISIBLE_DEVICES``
    is set (the trainer's torch need not have CUDA), else torch's count, refused when
    none; ``auto`` → torch's count (``cuda_count``, else ``torch.cuda``), none without
    CUDA.
    """
    if device not in DEVICES:
        raise PlacementError(f"inference.device must be one of {'|'.join(DEVICES)}, not {device!r}")
    if device == "cpu":
        return []
    listed = _listed()
    if device == "cuda" and listed:
        return listed
    if cuda_count is None:
        import torch

        cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    found = listed[:cuda_count] if listed is not None else [str(i) for i in range(cuda_count)]
    if device == "cuda" and not found:
        raise PlacementError("inference.device=cuda, but no GPU is visible on this machine")
    return found


def _listed() -> list[str] | None:
    value = os.environ.get(CUDA_VISIBLE_DEVICES)
    if value is None:
        return None
    return [d.strip() for d in value.split(",") if d.strip() and d.strip() != "NoDevFiles"]


def place_replicas(
    replicas: int,
    visible: Sequence[str],
    *,
    tensor_parallel_size: int = 1,
    gpu_memory_utilization: float = 0.9,
    gpus: Sequence[GpuIds] | None = None,
    training_gpus: int = 0,
) -> list[ReplicaPlacement]:
    """Each replica's placement on a node whose GPUs are ``visible`` (``[]``: no CUDA;
    see the module's docstring for the split and its invariants)."""
    if tensor_parallel_size < 1:
        raise PlacementError("inference.tensor_parallel_size must be at least 1")
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise PlacementError("inference.gpu_memory_utilization must be in (0, 1]")
    if training_gpus < 0:
        raise PlacementError("inference.training_gpus must be at least 0")
    if not visible:
        if gpus:
            raise PlacementError(
                f"inference.gpus={_show(gpus)} names GPUs, but none is visible here "
                "(no CUDA, or inference.device=cpu)"
            )
        return [ReplicaPlacement((), tensor_parallel_size)] * replicas
    training = list(visible[:training_gpus])
    if gpus is None:
        free = list(visible[training_gpus:])
        need = replicas * tensor_parallel_size
        if need > len(free):
            raise PlacementError(
                f"{replicas} vLLM replica(s) x tensor_parallel_size {tensor_parallel_size} "
                f"need {need} GPUs, but this node has {len(visible)} visible "
                f"({','.join(visible)}) of which training takes the first {len(training)} "
                "(inference.training_gpus): fewer replicas, or set inference.gpus"
            )
        tp = tensor_parallel_size
        chosen = [free[i * tp : (i + 1) * tp] for i in range(replicas)]
    else:
        chosen = _explicit(gpus, replicas, tensor_parallel_size, visible, training)
    return [
        ReplicaPlacement(tuple(ids), tensor_parallel_size, gpu_memory_utilization) for ids in chosen
    ]


def _explicit(
    gpus: Sequence[GpuIds],
    replicas: int,
    tensor_parallel_size: int,
    visible: Sequence[str],
    training: Sequence[str],
) -> list[list[str]]:
    """``inference.gpus`` checked: one entry per replica, ``tensor_parallel_size`` visible
    devices each, none shared with another replica or with training."""
    if len(gpus) != replicas:
        raise PlacementError(
            f"inference.gpus lists {len(gpus)} replica(s)' GPUs; inference.replicas is {replicas}"
        )
    chosen = [_ids(entry) for entry in gpus]
    seen: set[str] = set()
    for i, ids in enumerate(chosen):
        if len(ids) != tensor_parallel_size:
            raise PlacementError(
                f"inference.gpus[{i}]={_show(ids)} has {len(ids)} GPU(s); "
                f"inference.tensor_parallel_size is {tensor_parallel_size}"
            )
        for gpu in ids:
            if gpu not in visible:
                raise PlacementError(
                    f"inference.gpus[{i}]: GPU {gpu} is not visible here ({','.join(visible)})"
                )
            if gpu in training:
                raise PlacementError(
                    f"inference.gpus[{i}]: GPU {gpu} is training's (the first "
                    f"{len(training)} visible, inference.training_gpus)"
                )
            if gpu in seen:
                raise PlacementError(f"inference.gpus: GPU {gpu} is given to two replicas")
            seen.add(gpu)
    return chosen


def _ids(entry: GpuIds) -> list[str]:
    if isinstance(entry, int | str):
        return [str(entry)]
    return [str(gpu) for gpu in entry]


def _show(value: object) -> str:
    return str(list(value) if isinstance(value, tuple) else value).replace(" ", "")
