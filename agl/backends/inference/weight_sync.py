"""The trainer's side of ``inference.weight_sync=distributed``: weights broadcast to vLLM.

The trainer is rank 0 of a process group of its own (``weight_receiver.process_group``:
gloo, or NCCL between GPUs, as ``VllmServers`` picks; not torch's default group, which
verl's ranks use); every worker of every replica is one of ranks 1..N, joined by
``WeightReceiver.init_weight_sync`` through ``/collective_rpc``. A publish packs the
module's parameters, in the serving dtype, into buckets of at most ``bucket_bytes`` (a
larger tensor gets a bucket of its own) and broadcasts them one after the other while
each replica's ``receive_weights(manifest)`` call waits for them; the manifest (names,
shapes, dtypes, offsets, the policy version, the group) travels in that call. A replica
joins one group at a time: when another trainer attaches to it, the first one's next
publish fails at once (the worker refuses a manifest of a group it left) and the one
after rebuilds its group.

Tied parameters are sent once and listed under each name (the output embedding as
``lm_head.weight`` too): the served config is untied, for the reason
``vllm.write_weights`` gives (vLLM's CPU backend prepares its LM head at load).

The group's rendezvous store is torch's ``TCPStore``, whose server listens on every
interface (torch binds it so) for the trainer's lifetime; gloo's own connections use the
interface on the route to the replicas only. Who may make a replica join or load is
guarded (``/collective_rpc`` needs the inference key); the store is not: on a network
shared with strangers, prefer ``file`` or a firewall on the trainer's ports.

Invariant: ``send`` returns only when every rank has received every bucket; the group's
collectives time out after ``timeout_s`` (a replica that died mid-update fails the
publish instead of hanging it).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import TCPStore
from torch.distributed.tensor import DTensor

from agl.backends.inference.weight_receiver import broadcast, process_group, route_address
from agl.core.ports import free_port

BUCKET_BYTES = 256 * 2**20
ALIGN = 64  # every tensor's offset in a bucket: any dtype's view of it is aligned
_DTYPE_ALIASES = {"half": "float16", "float": "float32", "bf16": "bfloat16"}


def serving_dtype(name: str, model: torch.nn.Module) -> torch.dtype:
    """vLLM's ``--dtype`` as a torch dtype (``auto``: the module's own)."""
    if name == "auto":
        return next(model.parameters()).dtype
    dtype = getattr(torch, _DTYPE_ALIASES.get(name, name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"inference.dtype={name!r} is not a torch dtype")
    return dtype


@dataclass
class _Entry:
    names: list[str]
    tensor: torch.Tensor  # the trainer's parameter, not yet converted
    offset: int
    nbytes: int


@dataclass
class _Bucket:
    entries: list[_Entry]
    nbytes: int

    def manifest(self, dtype: torch.dtype) -> dict[str, Any]:
        name = str(dtype).removeprefix("torch.")
        return {
            "nbytes": self.nbytes,
            "tensors": [
                {
                    "names": e.names,
                    "shape": list(e.tensor.shape),
                    "dtype": name,
                    "offset": e.offset,
                    "nbytes": e.nbytes,
                }
                for e in self.entries
            ],
        }


def plan(model: torch.nn.Module, dtype: torch.dtype, bucket_bytes: int) -> list[_Bucket]:
    """The module's parameters in buckets of at most ``bucket_bytes`` (a larger tensor
    alone in one), each parameter once under all its names."""
    # Tied names yield the same Parameter (a DTensor has no storage pointer to compare).
    by_parameter: dict[int, _Entry] = {}
    entries: list[_Entry] = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in by_parameter:
            by_parameter[id(p)].names.append(name)
            continue
        entry = _Entry([name], p.detach(), 0, p.numel() * dtype.itemsize)
        by_parameter[id(p)] = entry
        entries.append(entry)
    buckets: list[_Bucket] = []
    current = _Bucket([], 0)
    for entry in entries:
        offset = -(-current.nbytes // ALIGN) * ALIGN
        if current.entries and offset + entry.nbytes > bucket_bytes:
            buckets.append(current)
            current, offset = _Bucket([], 0), 0
        entry.offset = offset
        current.entries.append(entry)
        current.nbytes = offset + entry.nbytes
    if current.entries:
        buckets.append(current)
    return buckets


def pack(bucket: _Bucket, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One bucket's bytes: each tensor converted to ``dtype`` at its offset."""
    buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
    for entry in bucket.entries:
        tensor = entry.tensor
        if isinstance(tensor, DTensor):  # a module FSDP2 (backend=verl) left sharded
            tensor = tensor.full_tensor()
        view = buffer[entry.offset : entry.offset + entry.nbytes].view(dtype)
        view.view(tensor.shape).copy_(tensor)
    return buffer


class WeightSender:
    """Rank 0 of the weight-sync group: ``connect`` once, then ``send`` per publish."""

    def __init__(
        self, peer_host: str, *, timeout_s: float = 120.0, bucket_bytes: int = BUCKET_BYTES
    ) -> None:
        # The address the replicas reach the trainer at: this machine's on the route to
        # them (loopback for replicas on this machine).
        self.address = route_address(peer_host)
        self.timeout_s = timeout_s
        self.bucket_bytes = bucket_bytes
        self._group: Any = None
        self._group_id = ""  # host:port of the store: the receivers check it
        self._store: TCPStore | None = None
        self._backend = "gloo"

    @property
    def connected(self) -> bool:
        return self._group is not None

    def connect(
        self,
        world_size: int,
        backend: str,
        join: Callable[[str, int], None],
    ) -> None:
        """Build the group of ``world_size`` ranks; ``join(address, port)`` must make every
        other rank join (it blocks until they have), while this thread waits for them."""
        self._backend = backend
        port = free_port(self.address)
        # Serving the store before the replicas are told where it is: they connect to it.
        self._store = TCPStore(
            self.address,
            port,
            world_size,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=self.timeout_s),
        )
        store = self._store

        def build() -> Any:
            return process_group(store, 0, world_size, backend, self.address, self.timeout_s)

        self._group = None
        self._group = _beside(build, lambda: join(self.address, port))
        self._group_id = f"{self.address}:{port}"

    def send(
        self,
        model: torch.nn.Module,
        dtype: torch.dtype,
        policy_version: int,
        receive: Callable[[str], None],
    ) -> int:
        """Broadcast ``model``'s parameters; ``receive(manifest)`` must make every other
        rank receive them (it blocks until they have). Answers the bytes sent."""
        if self._group is None:
            raise RuntimeError("WeightSender.send before connect")
        buckets = plan(model, dtype, self.bucket_bytes)
        manifest = json.dumps(
            {
                "group": self._group_id,
                "policy_version": policy_version,
                "buckets": [b.manifest(dtype) for b in buckets],
            }
        )
        # gloo sends from host memory (a module on a GPU is copied bucket by bucket).
        device = torch.device("cpu") if self._backend == "gloo" else next(model.parameters()).device
        group = self._group

        @torch.no_grad()
        def push() -> None:
            for bucket in buckets:
                broadcast(group, pack(bucket, dtype, device))

        try:
            _beside(push, lambda: receive(manifest))
        except BaseException:
            # A broadcast may still be pending in the group: the next publish builds a
            # new one (``connect``) rather than mix its buckets with this one's.
            self.close()
            raise
        return sum(b.nbytes for b in buckets)

    def close(self) -> None:
        self._group = None
        self._store = None


def _beside(work: Callable[[], Any], calls: Callable[[], None]) -> Any:
    """``work()`` in a thread while ``calls()`` runs here; answers ``work``'s result.
    A failure of ``calls`` (it names the replica) is raised at once, without waiting for
    ``work``: its collective then only ends at the group's timeout."""
    result: list[Any] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result.append(work())
        except BaseException as error:  # reported below, in the caller's thread
            failure.append(error)

    thread = threading.Thread(target=run, name="agl-weight-sync", daemon=True)
    thread.start()
    calls()  # raising here leaves the daemon thread to its timeout
    thread.join()
    if failure:
        raise failure[0]
    return result[0]


def world_of(workers: Sequence[int]) -> tuple[int, list[int]]:
    """The group's size and each replica's first rank, from each replica's worker count
    (the trainer is rank 0)."""
    offsets, next_rank = [], 1
    for count in workers:
        offsets.append(next_rank)
        next_rank += count
    return next_rank, offsets
