"""Where ``bench/gpu_check.py`` meets the issue-45 work that landed beside it: the parts
call only these, so a rename there is one change here.

- ``make_backend``: the torch backend in a dtype, with or without fp32 master weights
  (``TorchBackendConfig.fp32_master_weights``, ``agl/backends/training/master.py``).
  Part 3 reads the tensors the optimizer steps (``optimizer.param_groups``), so its
  "fraction changed" measures the masters whatever they are called.
- ``make_engine``: the built-in engine, with its KV budget (``Engine(kv_cache_gib=)``);
  the engine follows its model's device (part 2 depends on that).
- ``bucket_for_serving``: the trainer-side cost of a weight sync, the sender's own
  bucketing (``agl/backends/inference/weight_sync.py``: ``plan``, then ``pack`` per
  bucket); ``group`` and ``broadcast``: its process group and collective
  (``weight_receiver``), which part 5 runs over gloo between two local processes.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
import transformers

from agl.backends.inference import weight_receiver, weight_sync
from agl.backends.inference.engine import Engine
from agl.backends.training.torch import TorchBackend, TorchBackendConfig


def make_backend(
    model: transformers.PreTrainedModel,
    dtype: torch.dtype,
    config: TorchBackendConfig,
    fp32_master_weights: bool = True,
) -> TorchBackend:
    """A TorchBackend training ``model`` (built in fp32) in ``dtype``."""
    # (transformers types PreTrainedModel.to through a decorator that loses its signature)
    model = model.to(dtype)  # type: ignore[arg-type]
    return TorchBackend(model, replace(config, fp32_master_weights=fp32_master_weights))


def make_engine(
    model: torch.nn.Module,
    tokenizer: object,
    max_batch_size: int,
    kv_cache_gib: float | None = None,
) -> Engine:
    """The built-in engine over ``model`` (on its device), its KV cache bounded by
    ``kv_cache_gib`` (None: by the batch and the context only)."""
    return Engine(model, tokenizer, max_batch_size=max_batch_size, kv_cache_gib=kv_cache_gib)


def bucket_sizes(model: torch.nn.Module, dtype: torch.dtype, bucket_bytes: int) -> list[int]:
    """The bytes of each bucket a publish of ``model`` in ``dtype`` broadcasts."""
    return [b.nbytes for b in weight_sync.plan(model, dtype, bucket_bytes)]


def bucket_for_serving(
    model: torch.nn.Module, dtype: torch.dtype, bucket_bytes: int
) -> list[torch.Tensor]:
    """The model's weights in ``dtype``, packed into the sender's ``uint8`` buckets on the
    model's device (all at once: the sender packs one, broadcasts it, packs the next)."""
    device = next(model.parameters()).device
    with torch.no_grad():
        return [
            weight_sync.pack(b, dtype, device) for b in weight_sync.plan(model, dtype, bucket_bytes)
        ]


def group(store: dist.Store, rank: int, world_size: int, backend: str, timeout_s: float) -> Any:
    """The weight-sync process group (not torch's default one), on loopback."""
    return weight_receiver.process_group(store, rank, world_size, backend, "127.0.0.1", timeout_s)


def broadcast(process_group: Any, buffer: torch.Tensor) -> None:
    weight_receiver.broadcast(process_group, buffer)
