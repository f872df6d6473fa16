"""The one prepared check for a day a GPU is lent (issue 45): under 10 minutes on one H100,
with only PyTorch, transformers and safetensors (random-init models from configs, the
repository's tiny tokenizer: nothing downloaded).

1. ``logprobs``: the built-in engine's logprobs vs a teacher-forced forward (fp32, bf16).
2. ``train``: ``agl.train`` for 2 steps with ``backend.device=cuda`` and the embedded
   engine: it must not fail on a device mismatch.
3. ``ppo``: a TorchBackend PPO step, 0.5B shape in fp32 and bf16 (and bf16 without fp32
   master weights, the before), 1.5B in bf16: step time, peak memory, fraction of weights
   changed at lr 1e-6.
4. ``throughput``: the engine's tokens/s and KV memory at batch 1, 8, 32 and 128, and 128
   again under a ``kv_cache_gib`` budget that holds half the rows.
5. ``weight_sync``: the weight sender's bucketing of the 0.5B weights to bf16, a gloo
   broadcast of those buckets between two local processes, and a safetensors write +
   read, per GB.

    python -m bench.gpu_check --out $OUT                 # everything, on the GPU (~5-9 min)
    python -m bench.gpu_check --parts 1,3 --out DIR
    python -m bench.gpu_check --dry-run --out DIR        # every part tiny, on the CPU

Each part runs in a process of its own under its time budget (spawned on the GPU, so each
starts with CUDA untouched; forked in the dry run), so one that crashes the device or runs
over leaves the others their turn. It rewrites ``DIR/partN_NAME.json`` after every
measurement: a part killed midway keeps what it measured, marked ``timeout`` or
``error``, and a measurement that fails keeps its error and traceback under its key while
the part goes on. ``DIR/summary.json`` (versions, each part's status and device) is
rewritten after each part. The dry run writes the same keys, with tiny shapes and
``null`` for the device-only figures (peak memory). Exit status: 0 when every part chosen
ran to ``ok``, 1 otherwise, 2 with no GPU (and no ``--dry-run``) or bad arguments.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import platform
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

from bench.gpu import logprobs, ppo, throughput, train_run, weight_sync
from bench.gpu.record import Budget, Context, Report, one_line, write_json

DEFAULT_OUT = Path("runs") / "gpu_check"


@dataclass(frozen=True)
class Part:
    name: str
    run: Callable[[Context], None]
    budget_s: float  # on the GPU; the whole check stays under 10 minutes
    dry_budget_s: float


PARTS: dict[int, Part] = {
    1: Part("logprobs", logprobs.run, 60, 60),
    2: Part("train", train_run.run, 120, 90),
    3: Part("ppo", ppo.run, 150, 60),
    4: Part("throughput", throughput.run, 90, 60),
    5: Part("weight_sync", weight_sync.run, 60, 60),
}
NO_GPU = "no CUDA device here; --dry-run runs every part on the CPU"
# After its budget a part gets this long to notice and save before it is killed.
GRACE_S = 10.0


def _parse_parts(text: str) -> list[int]:
    try:
        chosen = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        chosen = []
    if not chosen or any(p not in PARTS for p in chosen):
        raise argparse.ArgumentTypeError(
            f"parts are numbers among {sorted(PARTS)}, comma-separated"
        )
    return chosen


def _path(out: Path, number: int) -> Path:
    return out / f"part{number}_{PARTS[number].name}.json"


def _run_part(number: int, out: Path, dry_run: bool) -> None:
    """The process of one part: run it, save its result as ok or error. Nothing here
    touches CUDA before the part does (part 5 forks its gloo pair first)."""
    part = PARTS[number]
    budget_s = part.dry_budget_s if dry_run else part.budget_s
    device = "cpu" if dry_run else "cuda"
    report = Report(_path(out, number), number, part.name, dry_run, device, budget_s)
    report.save()
    if dry_run:
        # One intra-op thread, as agl's CPU defaults: with more, OpenMP's threads spin and
        # stall whenever another process holds a core (a busy CI machine).
        torch.set_num_threads(1)
    torch.manual_seed(0)  # (CUDA's seed waits for CUDA's first use)
    try:
        part.run(Context(device, dry_run, out, Budget(budget_s), report))
    except Exception as error:  # one line on the console; the JSON keeps the traceback too
        report.device = _device_name(device)
        report.save("error", one_line(error), traceback.format_exc(limit=-12))
        return
    report.device = _device_name(device)
    if report.errors:  # each failed measurement's traceback is under its own key
        report.save("error", "; ".join(report.errors))
        return
    report.save("ok")


def _device_name(device: str) -> str:
    if device != "cuda":
        return device
    try:
        return torch.cuda.get_device_name()
    except Exception:  # the device is gone (the part's error says why): its kind is enough
        return device


def run_isolated(number: int, out: Path, dry_run: bool) -> dict[str, Any]:
    """Run part ``number`` in a process of its own under its budget; answers its JSON."""
    part = PARTS[number]
    budget_s = part.dry_budget_s if dry_run else part.budget_s
    path = _path(out, number)
    path.unlink(missing_ok=True)  # an earlier run's file must not pass for this one's
    # On the CPU a fork (the imports are done); with a GPU a fresh interpreter: anything
    # here that asked the driver a question (is_available) would break CUDA in a fork.
    start = "fork" if dry_run else "spawn"
    process = multiprocessing.get_context(start).Process(  # type: ignore[attr-defined]
        target=_run_part, args=(number, out, dry_run), name=f"gpu-check-{part.name}"
    )
    process.start()
    process.join(budget_s + GRACE_S)
    killed = process.is_alive()
    if killed:
        process.kill()
        process.join()
    result: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    if result.get("status") in (None, "running"):
        # Killed, or died without saving (a segfault, the device lost): keep what it saved.
        result |= {
            "part": number,
            "name": part.name,
            "status": "timeout" if killed else "error",
            "error": f"ran past its {budget_s:.0f} s budget"
            if killed
            else f"exit code {process.exitcode}",
        }
        result.setdefault("results", {})
        write_json(path, result)
    return result


def _environment(dry_run: bool) -> dict[str, Any]:
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python -m bench.gpu_check", *sys.argv[1:]]),
        "dry_run": dry_run,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_cuda": torch.version.cuda,
        "host": platform.node(),
    }


def _line(result: dict[str, Any]) -> str:
    """A part for the console: its status, then each measurement's figures on one line
    (nested ones as ``outer.inner``; a list of them, such as the run's steps, a line
    each)."""
    head = f"part {result['part']} {result['name']}: {result['status']}"
    if result.get("error"):
        head += f" ({result['error']})"  # its traceback, if any, is in the part's JSON
    lines = [head]
    for key, value in result.get("results", {}).items():
        if isinstance(value, dict):
            shown = ", ".join(f"{k}={v}" for k, v in _flat(value))
            lines.append(f"    {key}: {shown}")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, dict):
                    shown = ", ".join(f"{k}={v}" for k, v in _flat(item))
                    lines.append(f"    {key}[{i}]: {shown}")
        else:
            lines.append(f"    {key}: {_short(value)}")
    return "\n".join(lines)


def _flat(values: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in values.items():
        if key == "traceback":
            continue
        if isinstance(value, dict):
            out += _flat(value, f"{prefix}{key}.")
        elif not isinstance(value, list):
            out.append((f"{prefix}{key}", _short(value)))
    return out


def _short(value: Any) -> Any:
    return float(f"{value:.4g}") if isinstance(value, float) else value


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", type=Path, help=f"results folder (default {DEFAULT_OUT}/<time>)")
    parser.add_argument("--parts", type=_parse_parts, default=sorted(PARTS), help="e.g. 1,3")
    parser.add_argument("--dry-run", action="store_true", help="every part tiny, on the CPU")
    args = parser.parse_args(argv)
    # (The parts run in fresh interpreters on a GPU: asking the driver here is harmless.)
    if not args.dry_run and not torch.cuda.is_available():
        parser.exit(
            2, f"{parser.prog}: no CUDA device here; --dry-run runs every part on the CPU\n"
        )
    out: Path = args.out or DEFAULT_OUT / time.strftime("%Y-%m-%d-%H-%M-%S")
    out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"environment": _environment(args.dry_run), "parts": {}}
    started = time.monotonic()
    for number in args.parts:
        result = run_isolated(number, out, args.dry_run)
        summary["parts"][str(number)] = {
            "name": result["name"],
            "status": result["status"],
            "error": result.get("error"),
            "wall_s": result.get("wall_s"),
            "device": result.get("device"),
        }
        summary["wall_s"] = round(time.monotonic() - started, 1)
        write_json(out / "summary.json", summary)
        print(_line(result), flush=True)
    print(f"{summary['wall_s']} s; results in {out}", flush=True)
    return 0 if all(p["status"] == "ok" for p in summary["parts"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
