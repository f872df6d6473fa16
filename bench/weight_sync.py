"""Weight sync benchmark: ``inference.weight_sync`` file vs distributed, side by side.

One vLLM replica (CPU, eager) per model serves while the trainer's module is perturbed in
place and published, ``--reps`` times per mode in A B B A order (drift favours neither):

- **file**: ``write_weights`` (one safetensors file, written then renamed) and every
  replica's in-place ``reload_weights`` from it;
- **distributed**: the buckets broadcast over the trainer's gloo group to the replica's
  worker (``weight_sync.WeightSender``), loaded through the same in-place reload. The
  group is built at the first distributed publish, reported apart.

Per mode: median seconds per publish (pause to resume, the write included), bytes written
to disk per step, bytes sent over the group per step. Beside them the GPU estimate for
NCCL: the bytes in bf16 (the serving dtype there) over a broadcast bandwidth (NVLink in
one node, an InfiniBand NIC across nodes; assumed figures, stated in the table).

    python -m bench.weight_sync                # tiny, then SmolLM2-135M if cached: ~2 min idle
    python -m bench.weight_sync --models tiny --reps 5

Prints the table and writes it (with the command and the date) to
bench/results/weight_sync.txt (``--out``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from agl.backends.inference.models import ModelUnavailable, load_model
from agl.backends.inference.vllm import WEIGHTS_FILE, VllmOptions, VllmServers, find_vllm_python
from agl.backends.inference.weight_sync import BUCKET_BYTES, plan
from bench.engines import timed, vllm_version

OUT = Path(__file__).parent / "results" / "weight_sync.txt"
MODES = ("file", "distributed")
# Broadcast bandwidths assumed for the GPU estimate (bytes/s): NCCL's bus bandwidth for a
# broadcast within one H100 node over NVLink, and over one 400 Gb/s InfiniBand NIC.
NVLINK_BPS = 200e9
IB_BPS = 45e9


@dataclass
class ModelRun:
    name: str
    parameters: int
    startup_s: float = 0.0
    connect_s: float = 0.0
    seconds: dict[str, list[float]] = field(default_factory=lambda: {m: [] for m in MODES})
    written: dict[str, list[int]] = field(default_factory=lambda: {m: [] for m in MODES})
    sent: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MODES, 0))


def run_model(name: str, reps: int) -> ModelRun | None:
    try:
        loaded = load_model(name)
    except ModelUnavailable as error:
        print(f"[bench.weight_sync] {name} skipped: {error}", file=sys.stderr)
        return None
    model = loaded.model
    run = ModelRun(name, sum(p.numel() for p in model.parameters()))
    options = VllmOptions(python=find_vllm_python(), max_model_len=512, startup_timeout_s=900)
    generator = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="bench-weight-sync-") as tmp:
        started = time.perf_counter()
        with VllmServers(model, loaded.tokenizer, name, Path(tmp), options, api_key=None) as s:
            run.startup_s = time.perf_counter() - started
            weights = s.weights_dir / WEIGHTS_FILE
            version = 0
            for mode in _abba(reps):
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(1 + 1e-3 * torch.randn(p.shape, generator=generator))
                s.options.weight_sync = mode
                version += 1
                before = weights.stat().st_mtime_ns
                if mode == "distributed" and not run.connect_s:
                    connect_started = time.perf_counter()
                    s.publish(version)  # builds the group: reported apart
                    run.connect_s = time.perf_counter() - connect_started
                    version += 1
                began = time.perf_counter()
                s.publish(version)
                run.seconds[mode].append(time.perf_counter() - began)
                rewritten = weights.stat().st_mtime_ns != before
                run.written[mode].append(weights.stat().st_size if rewritten else 0)
            buckets = plan(model, torch.float32, BUCKET_BYTES)
            run.sent["distributed"] = sum(b.nbytes for b in buckets)
    return run


def _abba(reps: int) -> list[str]:
    """``reps`` publishes per mode, as A B B A A B B A ..."""
    pairs = [MODES if i % 2 == 0 else tuple(reversed(MODES)) for i in range(reps)]
    return [mode for pair in pairs for mode in pair]


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def table(runs: Sequence[ModelRun], reps: int) -> str:
    lines = [
        f"Seconds per publish (median of {reps}, pause to resume), bytes per step, 1 replica:",
        "",
        "| model | params | mode | s/publish | written/step | sent/step |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for run in runs:
        for mode in MODES:
            lines.append(
                f"| {run.name} | {run.parameters / 1e6:.1f} M | {mode} | "
                f"{statistics.median(run.seconds[mode]):.2f} | "
                f"{mib(statistics.median(run.written[mode]))} | {mib(run.sent[mode])} |"
            )
    lines += [
        "",
        "Once per run: replica start (s), first distributed publish (group built, s):",
        "",
        *(
            f"- {r.name}: start {r.startup_s:.0f} s, group + publish {r.connect_s:.2f} s"
            for r in runs
        ),
        "",
        f"GPU estimate (NCCL broadcast, bf16 = 2 bytes/param; {NVLINK_BPS / 1e9:.0f} GB/s "
        f"NVLink in a node, {IB_BPS / 1e9:.0f} GB/s over one 400 Gb/s NIC; assumed):",
        "",
    ]
    sizes = [(r.name, r.parameters) for r in runs] + [("a 7B model", 7_600_000_000)]
    for name, params in sizes:
        nbytes = 2 * params
        lines.append(
            f"- {name}: {mib(nbytes)}: {nbytes / NVLINK_BPS * 1e3:.2f} ms (NVLink), "
            f"{nbytes / IB_BPS * 1e3:.2f} ms (IB); the file path writes and reads "
            f"{mib(nbytes)} per step"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--reps", type=int, default=4, help="publishes per mode")
    parser.add_argument("--out", type=Path, default=OUT)
    args_list = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(args_list)
    if find_vllm_python() is None:
        sys.exit("vLLM is not installed: bash tests/vllm/install.sh")
    runs = []
    for name in args.models.split(","):
        with timed(f"weight sync, {name}"):
            run = run_model(name, args.reps)
        if run is not None:
            runs.append(run)
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    text = (
        f"$ python -m bench.weight_sync {shlex.join(args_list)}\n"
        f"{now}; {os.cpu_count()} CPUs; torch {torch.__version__}, vllm {vllm_version()}\n\n"
        + table(runs, args.reps)
    )
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
