"""Part 5: what a weight sync costs on one GPU, per GB of weights in the serving dtype
(bf16), for the 0.5B shape whose trainer holds fp32 weights.

- ``bucket``: on the device, the weight sender's bucketing (``pack``: ``plan``, then
  every parameter cast to bf16 into 256 MiB ``uint8`` buckets), and ``to_cpu``: those
  buckets copied to host memory.
- ``gloo_broadcast``: buckets of the same sizes broadcast through the weight-sync group
  (``weight_receiver.process_group``, gloo over loopback) from one local process to
  another, the receiver checking every byte. NCCL needs two devices (``nccl_broadcast``
  says so on one); gloo runs where NCCL would.
- ``safetensors``: the path weights travel today, the bf16 state dict written with
  ``safetensors.torch.save_file`` to a temporary folder (never to the output folder) and
  read back onto the device with ``load_file`` (right after the write: from the page
  cache, so the read is a lower bound on a cold one).

The broadcasting pair is forked before this process touches the device (a process that
initialized CUDA cannot fork safely) and waits for the buckets' sizes, all it needs.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import socket
import tempfile
import time
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from bench.gpu import adapters, shapes
from bench.gpu.record import Context, one_line, synchronize

SHAPE = "0.5b"
SERVING = torch.bfloat16
BUCKET_BYTES = 256 * 1024**2  # the sender's default (weight_sync.BUCKET_BYTES)
GB = 1e9


def _pattern(size: int, bucket: int) -> torch.Tensor:
    """The bytes the sender sends in bucket ``bucket``; the receiver rebuilds them."""
    return ((torch.arange(size, dtype=torch.int64) * 7 + bucket) % 251).to(torch.uint8)


def _rank(rank: int, port: int, sizes_from: Connection, answer: Connection) -> None:
    """One rank of the gloo pair: waits for the buckets' sizes (None: stop), then rank 0
    broadcasts that many buckets and rank 1 receives them through the weight-sync group;
    answers (seconds from the first bucket to the last, every byte right) or (None, error)."""
    try:
        sizes: list[int] | None = sizes_from.recv()
        if sizes is None:
            return
        store = dist.TCPStore(
            "127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=60)
        )
        group = adapters.group(store, rank, 2, "gloo", 60.0)
        buckets = [
            _pattern(n, i) if rank == 0 else torch.empty(n, dtype=torch.uint8)
            for i, n in enumerate(sizes)
        ]
        adapters.broadcast(group, torch.zeros(1, dtype=torch.uint8))  # both are there
        start = time.perf_counter()
        for bucket in buckets:
            adapters.broadcast(group, bucket)
        seconds = time.perf_counter() - start
        right = rank == 0 or all(
            torch.equal(b, _pattern(n, i))
            for i, (b, n) in enumerate(zip(buckets, sizes, strict=True))
        )
        answer.send((seconds, right))
    except Exception as error:  # the part reports it as this measurement's error
        answer.send((None, one_line(error)))


class _GlooPair:
    """Two local processes, forked before the part touches the device (a process that
    initialized CUDA cannot fork safely); ``run`` hands them the sizes the part found."""

    def __init__(self) -> None:
        context = multiprocessing.get_context("fork")
        port = _free_port()
        self._sizes = [context.Pipe(duplex=False) for _ in range(2)]
        self._answers = [context.Pipe(duplex=False) for _ in range(2)]
        self._ranks = [
            context.Process(
                target=_rank,
                args=(rank, port, self._sizes[rank][0], self._answers[rank][1]),
                daemon=True,
                name=f"gpu-check-gloo-{rank}",
            )
            for rank in range(2)
        ]
        for process in self._ranks:
            process.start()

    def run(self, sizes: list[int], timeout_s: float) -> dict[str, Any]:
        for _, send in self._sizes:
            send.send(sizes)
        deadline = time.monotonic() + timeout_s
        answers = []
        for receive, _ in self._answers:
            if not receive.poll(max(deadline - time.monotonic(), 0)):
                raise TimeoutError(f"the gloo pair did not answer within {timeout_s:.0f} s")
            answers.append(receive.recv())
        errors = [a[1] for a in answers if a[0] is None]
        if errors:
            raise RuntimeError(f"the gloo pair failed: {errors[0]}")
        seconds = max(a[0] for a in answers)
        return _per_gb(seconds, sum(sizes)) | {"verified": answers[1][1]}

    def close(self) -> None:
        for _, send in self._sizes:
            with contextlib.suppress(OSError):
                send.send(None)  # a rank still waiting for sizes stops
        for process in self._ranks:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _per_gb(seconds: float, nbytes: int) -> dict[str, float]:
    return {"s": seconds, "s_per_gb": seconds / (nbytes / GB)}


def _bucket(model: torch.nn.Module, device: str, bucket_bytes: int, nbytes: int) -> dict[str, Any]:
    adapters.bucket_for_serving(model, SERVING, bucket_bytes)  # allocator, kernels: not timed
    synchronize(device)
    start = time.perf_counter()
    buckets = adapters.bucket_for_serving(model, SERVING, bucket_bytes)
    synchronize(device)
    packed = time.perf_counter() - start
    start = time.perf_counter()
    on_host = [b.to("cpu") for b in buckets]
    copied = time.perf_counter() - start
    del buckets, on_host
    return {"pack": _per_gb(packed, nbytes), "to_cpu": _per_gb(copied, nbytes)}


def _safetensors(model: torch.nn.Module, device: str) -> dict[str, Any]:
    state = {
        k: v.detach().to(SERVING).to("cpu").contiguous() for k, v in model.state_dict().items()
    }
    state.pop("lm_head.weight", None)  # tied to the embedding: written once, as HF saves it
    written = sum(t.numel() * t.element_size() for t in state.values())
    with tempfile.TemporaryDirectory(prefix="agl-gpu-check-") as folder:
        path = Path(folder) / "model.safetensors"
        start = time.perf_counter()
        save_file(state, str(path))
        write_s = time.perf_counter() - start
        start = time.perf_counter()
        loaded = load_file(str(path), device=device)
        synchronize(device)
        read_s = time.perf_counter() - start
        del loaded
    return {
        "gb": written / GB,
        "write": _per_gb(write_s, written),
        "read": _per_gb(read_s, written),
    }


def run(ctx: Context) -> None:
    pair = _GlooPair()
    try:
        tok = shapes.tokenizer()
        shape = shapes.shape_for(SHAPE, ctx.dry_run)
        bucket_bytes = 64 * 1024 if ctx.dry_run else BUCKET_BYTES
        model = shapes.build_model(shape, tok, torch.float32, ctx.device)  # the trainer's
        sizes = adapters.bucket_sizes(model, SERVING, bucket_bytes)
        ctx.report.results |= {
            "shape": shape,
            "serving_dtype": "bfloat16",
            "gb": sum(sizes) / GB,
            "buckets": len(sizes),
            "bucket_bytes": bucket_bytes,
            "nccl_broadcast": {"skipped": "NCCL broadcasts between two devices; one is lent"},
        }
        timeout = max(ctx.budget.left() / 2, 10)
        ctx.report.measure("gloo_broadcast", lambda: pair.run(sizes, timeout))
    finally:
        pair.close()
    ctx.report.measure("bucket", lambda: _bucket(model, ctx.device, bucket_bytes, sum(sizes)))
    ctx.report.measure("safetensors", lambda: _safetensors(model, ctx.device))
