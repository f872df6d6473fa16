"""agl's weight receiver inside vLLM: a worker extension (``--worker-extension-cls``).

vLLM mixes ``WeightReceiver`` into its worker class; the trainer calls its methods through
the dev-mode ``POST /collective_rpc`` (every worker of the replica runs the method; the
call answers when all have returned):

- ``weight_sync_rank()``: the worker's rank in its replica (the answer's length tells
  the trainer how many ranks the replica needs);
- ``init_weight_sync(host, port, rank_offset, world_size, backend, timeout_s)``: join the
  trainer's weight-sync group (rank ``rank_offset`` + the worker's rank; the trainer is
  rank 0), once per trainer; a later call replaces the group (a new trainer attached);
- ``receive_weights(manifest)``: (refused at once if the manifest names another group
  than the worker's) receive every bucket the trainer broadcasts and load the
  tensors the manifest names through the worker's own in-place reload
  (``Worker.reload_weights(weights_iterator=...)``: the path a reload from a file takes,
  so every layer is processed again after loading, the CPU backend's oneDNN LM head
  included).

The group is torch's own (a ``TCPStore`` the trainer serves and a ``ProcessGroupGloo`` or
``ProcessGroupNCCL`` built on it), never torch's default group, which vLLM's workers
(tensor parallelism) and verl's trainer ranks already use.

Invariant: a manifest's buckets arrive in order, each one ``nbytes`` of ``uint8`` holding
its tensors at 64-byte aligned offsets, in the serving dtype; a tensor listed under
several names (tied embeddings) is loaded under each.

Torch only: vLLM's interpreter (its own environment, without agl) imports a copy of this
file (``vllm.install_extensions``).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

STORE_PREFIX = "agl-weight-sync"


def route_address(peer: str) -> str:
    """This machine's address on the route to ``peer`` (no packet is sent: a UDP socket's
    connect only picks the route), so each side of the group names the interface the
    other can reach."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(peer), 9))
        return str(probe.getsockname()[0])


def process_group(
    store: dist.Store, rank: int, world_size: int, backend: str, address: str, timeout_s: float
) -> Any:
    """A weight-sync group outside torch's default one: gloo on ``address``'s interface,
    or NCCL (GPUs)."""
    prefixed = dist.PrefixStore(STORE_PREFIX, store)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timedelta(seconds=timeout_s)
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = timedelta(seconds=timeout_s)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    return dist.ProcessGroupGloo(prefixed, rank, world_size, options)


def broadcast(group: Any, buffer: torch.Tensor) -> None:
    """``buffer`` from rank 0 to every rank of ``group``."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([buffer], options).wait()


def unpack(
    buffer: torch.Tensor, entries: list[dict[str, Any]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The named tensors a bucket holds (views of ``buffer``)."""
    for entry in entries:
        start = entry["offset"]
        flat = buffer[start : start + entry["nbytes"]].view(getattr(torch, entry["dtype"]))
        tensor = flat.view(entry["shape"])
        for name in entry["names"]:
            yield name, tensor


class WeightReceiver:
    """Worker methods for ``/collective_rpc`` (``self`` is vLLM's worker: ``rank``,
    ``device`` and ``reload_weights`` are its own)."""

    _agl_group: Any = None
    _agl_group_id = ""  # the trainer's store, host:port: which group the worker is in
    _agl_device: torch.device | None = None

    def weight_sync_rank(self) -> int:
        return int(getattr(self, "rank", 0))

    def init_weight_sync(
        self,
        host: str,
        port: str,
        rank_offset: str,
        world_size: str,
        backend: str,
        timeout_s: str,
    ) -> None:
        rank = int(rank_offset) + self.weight_sync_rank()
        timeout = float(timeout_s)
        store = dist.TCPStore(
            host, int(port), int(world_size), is_master=False, timeout=timedelta(seconds=timeout)
        )
        self._agl_group = None  # a previous trainer's group is dropped first
        if backend == "nccl":
            self._agl_device = torch.device("cuda", torch.cuda.current_device())
        else:
            self._agl_device = torch.device("cpu")
        self._agl_group = process_group(
            store, rank, int(world_size), backend, route_address(host), timeout
        )
        self._agl_group_id = f"{host}:{port}"

    def receive_weights(self, manifest: str) -> dict[str, int]:
        """Load the buckets the trainer broadcasts; answers the policy version and the
        bytes received."""
        if self._agl_group is None:
            raise RuntimeError("receive_weights before init_weight_sync")
        plan = json.loads(manifest)
        if plan["group"] != self._agl_group_id:  # at once, not at the broadcast's timeout
            raise RuntimeError(
                f"weights for group {plan['group']} but this worker is in "
                f"{self._agl_group_id} (another trainer joined it since)"
            )
        buckets = plan["buckets"]
        group, device = self._agl_group, self._agl_device

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for bucket in buckets:
                # A new buffer per bucket: the reload may hold a layer's tensors until
                # the layer is complete, so a bucket's memory is not reused.
                buffer = torch.empty(bucket["nbytes"], dtype=torch.uint8, device=device)
                broadcast(group, buffer)
                yield from unpack(buffer, bucket["tensors"])

        self.reload_weights(weights_iterator=tensors())  # type: ignore[attr-defined]
        received = sum(int(b["nbytes"]) for b in buckets)
        return {"policy_version": int(plan["policy_version"]), "bytes": received}
