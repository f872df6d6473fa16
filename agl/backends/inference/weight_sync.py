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

The sender need not be the trainer: a ``WeightSource`` (``backend=verl`` on Ray: verl's
rank 0, ``verl.ray.RayWeightSource``) hosts the group and broadcasts from its own shards;
the plan then comes from parameter metadata (``plan_specs``: names, shapes) and each
tensor from a producer called in plan order (``pack``'s ``produce``), so the sender never
holds more than one bucket and one full tensor.

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
from typing import Any, Protocol

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
    shape: list[int]
    index: int  # the tensor's position in the plan's order (``pack``'s ``produce``)
    offset: int
    nbytes: int
    tensor: torch.Tensor | None = None  # the module's parameter (``plan``), not converted


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
                    "shape": e.shape,
                    "dtype": name,
                    "offset": e.offset,
                    "nbytes": e.nbytes,
                }
                for e in self.entries
            ],
        }


def plan_specs(
    specs: Sequence[tuple[list[str], Sequence[int]]], dtype: torch.dtype, bucket_bytes: int
) -> list[_Bucket]:
    """Buckets of at most ``bucket_bytes`` (a larger tensor alone in one) for tensors
    given as (names, shape), in order; entry ``i`` is ``specs[i]``."""
    buckets: list[_Bucket] = []
    current = _Bucket([], 0)
    for index, (names, shape) in enumerate(specs):
        nbytes = int(torch.Size(shape).numel()) * dtype.itemsize
        offset = -(-current.nbytes // ALIGN) * ALIGN
        if current.entries and offset + nbytes > bucket_bytes:
            buckets.append(current)
            current, offset = _Bucket([], 0), 0
        current.entries.append(_Entry(list(names), list(shape), index, offset, nbytes))
        current.nbytes = offset + nbytes
    if current.entries:
        buckets.append(current)
    return buckets


def parameter_specs(
    model: torch.nn.Module,
) -> tuple[list[tuple[list[str], list[int]]], list[torch.Tensor]]:
    """The module's parameters once each, under all their names (a tied one under each),
    as ``plan_specs``'s (names, shape) and the parameters in the same order. A DTensor
    (FSDP2) gives its full shape."""
    # Tied names yield the same Parameter (a DTensor has no storage pointer to compare).
    by_parameter: dict[int, int] = {}
    specs: list[tuple[list[str], list[int]]] = []
    tensors: list[torch.Tensor] = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in by_parameter:
            specs[by_parameter[id(p)]][0].append(name)
            continue
        by_parameter[id(p)] = len(specs)
        specs.append(([name], list(p.shape)))
        tensors.append(p.detach())
    return specs, tensors


def plan(model: torch.nn.Module, dtype: torch.dtype, bucket_bytes: int) -> list[_Bucket]:
    """The module's parameters in buckets of at most ``bucket_bytes`` (a larger tensor
    alone in one), each parameter once under all its names."""
    specs, tensors = parameter_specs(model)
    buckets = plan_specs(specs, dtype, bucket_bytes)
    for bucket in buckets:
        for entry in bucket.entries:
            entry.tensor = tensors[entry.index]
    return buckets


def manifest(
    buckets: Sequence[_Bucket], dtype: torch.dtype, group_id: str, policy_version: int
) -> str:
    """What every receiver's ``receive_weights`` reads: the group, the version, and each
    bucket's tensors (names, shapes, dtype, offsets)."""
    return json.dumps(
        {
            "group": group_id,
            "policy_version": policy_version,
            "buckets": [b.manifest(dtype) for b in buckets],
        }
    )


def full(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` whole: a DTensor (FSDP2, ``backend=verl``) is gathered, a collective
    every rank of its mesh must join."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def pack(
    bucket: _Bucket,
    dtype: torch.dtype,
    device: torch.device,
    produce: Callable[[_Entry], torch.Tensor] | None = None,
) -> torch.Tensor:
    """One bucket's bytes: each tensor converted to ``dtype`` at its offset; the tensor is
    ``produce(entry)`` where given (called once per entry, in order), else the module's
    parameter ``plan`` recorded."""
    buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
    for entry in bucket.entries:
        if produce is not None:
            tensor = produce(entry)
        else:
            assert entry.tensor is not None, "a plan_specs bucket needs produce"
            tensor = full(entry.tensor)
        view = buffer[entry.offset : entry.offset + entry.nbytes].view(dtype)
        view.view(entry.shape).copy_(tensor)
    return buffer


class WeightSource(Protocol):
    """A sender of weights other than ``VllmServers``' own module (the trainer's): it
    hosts the weight-sync group as rank 0 and broadcasts what it holds.

    ``connect(peer_host, world_size, backend, timeout_s, join)``: build the group, where
    ``join(address, port)`` makes every other rank join (it blocks until they have);
    ``send(dtype, policy_version, receive)``: broadcast, where ``receive(manifest)``
    makes every other rank receive (it blocks until they have); answers the bytes sent.
    A failed ``send`` leaves the source not ``connected`` (the next publish rebuilds)."""

    @property
    def name(self) -> str: ...  # who sends, for the log

    @property
    def connected(self) -> bool: ...

    @property
    def on_gpu(self) -> bool: ...

    def connect(
        self,
        peer_host: str,
        world_size: int,
        backend: str,
        timeout_s: float,
        join: Callable[[str, int], None],
    ) -> None: ...

    def send(
        self, dtype: torch.dtype, policy_version: int, receive: Callable[[str], None]
    ) -> int: ...

    def close(self) -> None: ...


class WeightSender:
    """Rank 0 of the weight-sync group: ``connect`` once, then ``send`` per publish.

    A sender in another process than the one that calls the replicas (verl's rank 0)
    splits both: ``listen`` then ``joined`` for ``connect``, ``manifest`` (given to the
    replicas) and ``push`` (the broadcast, meanwhile) for ``send``."""

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
        self._building: _Background | None = None

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
        other rank join (it blocks until they have), while this thread waits for them.
        A failure of ``join`` (it names the replica) is raised at once."""
        address, port = self.listen(world_size, backend)
        join(address, port)  # raising here leaves the group's build to its timeout
        self.joined()

    def listen(self, world_size: int, backend: str) -> tuple[str, int]:
        """Serve the group's store and start building the group (in a thread: it waits
        for the other ranks); answers the address and port they join at."""
        self.close()
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

        self._building = _Background(build)
        self._group_id = f"{self.address}:{port}"
        return self.address, port

    def joined(self) -> None:
        """Wait for the group ``listen`` started (every other rank has joined)."""
        if self._building is None:
            raise RuntimeError("WeightSender.joined before listen")
        building, self._building = self._building, None
        self._group = building.result()

    def manifest(self, buckets: Sequence[_Bucket], dtype: torch.dtype, version: int) -> str:
        """``manifest`` for this group."""
        return manifest(buckets, dtype, self._group_id, version)

    def push(
        self,
        buckets: Sequence[_Bucket],
        dtype: torch.dtype,
        device: torch.device,
        produce: Callable[[_Entry], torch.Tensor] | None = None,
    ) -> int:
        """Broadcast ``buckets`` (``pack``'s ``produce``); answers the bytes sent. On a
        failure the group is dropped: a broadcast may still be pending in it, and the
        next publish builds a new one (``connect``) rather than mix its buckets in."""
        group = self._group
        if group is None:
            raise RuntimeError("WeightSender.push before connect")
        try:
            with torch.no_grad():
                for bucket in buckets:
                    broadcast(group, pack(bucket, dtype, device, produce))
        except BaseException:
            self.close()
            raise
        return sum(b.nbytes for b in buckets)

    @property
    def device(self) -> torch.device | None:
        """Where buckets are packed: host memory for gloo; None: the tensors' device."""
        return torch.device("cpu") if self._backend == "gloo" else None

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
        text = self.manifest(buckets, dtype, policy_version)
        # gloo sends from host memory (a module on a GPU is copied bucket by bucket).
        device = self.device or next(model.parameters()).device
        pushing = _Background(lambda: self.push(buckets, dtype, device))
        try:
            receive(text)
        except BaseException:
            self.close()  # the push is left to the group's timeout
            raise
        return int(pushing.result())

    def close(self) -> None:
        self._group = None
        self._store = None
        self._building = None


class _Background:
    """``work()`` in a daemon thread; ``result()`` waits for it and answers (or raises)
    what it did, in the caller's thread. Left unwaited, it ends at the group's timeout."""

    def __init__(self, work: Callable[[], Any]) -> None:
        self._result: list[Any] = []
        self._failure: list[BaseException] = []
        self._thread = threading.Thread(
            target=self._run, args=(work,), name="agl-weight-sync", daemon=True
        )
        self._thread.start()

    def _run(self, work: Callable[[], Any]) -> None:
        try:
            self._result.append(work())
        except BaseException as error:  # reported by result(), in the caller's thread
            self._failure.append(error)

    def result(self) -> Any:
        self._thread.join()
        if self._failure:
            raise self._failure[0]
        return self._result[0]


def world_of(workers: Sequence[int]) -> tuple[int, list[int]]:
    """The group's size and each replica's first rank, from each replica's worker count
    (the trainer is rank 0)."""
    offsets, next_rank = [], 1
    for count in workers:
        offsets.append(next_rank)
        next_rank += count
    return next_rank, offsets
