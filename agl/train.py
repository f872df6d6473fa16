"""``python -m agl.train [group=option ...] [key=value ...]``: one training run (``-m`` for
a Hydra sweep, each run in its own folder).

A run starts its parts, trains, and stops them all, also on Ctrl-C or a crash:
the gateway (a child process, store in ``<run>/gateway/``), the embedded inference
server (a thread sharing the model with the trainer), the rollout controller and its
agents (``controller=local``: worker processes; ``controller=k8s``: Kubernetes Jobs,
deleted when the run ends). Metrics go to ``<run>/metrics.jsonl`` and W&B.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agl.backends.inference.models import LoadedModel
    from agl.backends.inference.service import InferenceService
    from agl.core.assemble import Advantage, MergeStrategy
    from agl.core.controller import Executor
    from agl.core.trainer import Policy

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "conf"
GROUPS = ("merge", "advantage", "loss", "model", "task", "backend", "inference", "controller")

log = logging.getLogger("agl.train")


class UserError(Exception):
    """A problem the user can fix; reported in one line, without a traceback."""


def check_choices(argv: Sequence[str], conf: Path = CONF) -> str | None:
    """The first ``group=option`` naming an option that has no yaml, as a message."""
    for arg in argv:
        key, sep, value = arg.lstrip("+~").partition("=")
        if not sep or key not in GROUPS:
            continue
        for option in value.split(","):
            if not (conf / key / f"{option}.yaml").exists():
                known = sorted(p.stem for p in (conf / key).glob("*.yaml"))
                return f"unknown {key} {option!r}; choose one of: {', '.join(known)}"
    return None


def main() -> None:
    problem = check_choices(sys.argv[1:])
    if problem:
        sys.stderr.write(f"agl.train: {problem}\n")
        raise SystemExit(2)
    import hydra

    hydra.main(config_path=str(CONF), config_name="train", version_base="1.3")(_hydra_job)()


def _hydra_job(cfg: Any) -> None:
    from hydra.core.hydra_config import HydraConfig

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    sweep = None
    if hydra_cfg.mode.name == "MULTIRUN":
        sweep = Path(hydra_cfg.sweep.dir).name
    # Ctrl-C and SIGTERM stop the run cleanly, even where the parent started us with
    # SIGINT ignored (a background job of a non-interactive shell).
    for stop in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop, signal.default_int_handler)
    try:
        train(cfg, run_dir, sweep=sweep)
    except UserError as error:
        sys.stderr.write(f"agl.train: {error}\n")
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        sys.stderr.write("agl.train: interrupted; every part of the run is stopped\n")
        raise SystemExit(130) from None


def train(cfg: Any, run_dir: Path, sweep: str | None = None) -> list[dict[str, float]]:
    """Run one experiment described by the composed config ``cfg``; answers its metrics."""
    from omegaconf import OmegaConf

    run_dir.mkdir(parents=True, exist_ok=True)
    _setup_logging(run_dir, cfg.logging.level)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    return asyncio.run(_run(cfg, run_dir, sweep))


async def _run(cfg: Any, run_dir: Path, sweep: str | None) -> list[dict[str, float]]:
    import torch
    from omegaconf import OmegaConf

    from agl.backends.inference.models import ModelUnavailable, default_cache_dir
    from agl.core.client import AsyncGatewayClient, fast_http_client
    from agl.core.console import Progress, summary
    from agl.core.controller import Controller
    from agl.core.records import ModelEndpoint
    from agl.core.registry import get
    from agl.core.services import ChildGateway
    from agl.core.tasks import Task, TaskConfig
    from agl.core.tracking import Tracker
    from agl.core.trainer import Trainer, TrainerConfig

    started = time.monotonic()
    options = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(options, dict)
    torch.manual_seed(cfg.seed)
    try:
        trainer_config = TrainerConfig(**options["trainer"])
        backend_config = _backend_config(options["backend"], trainer_config.steps)
        merge = make_merge(options["merge"])
        advantage = make_advantage(options["advantage"])
        loss = get("loss", cfg.loss.name)
        task = Task(TaskConfig(**options["task"]), ROOT, seed=cfg.seed)
    except (TypeError, ValueError, KeyError) as error:
        raise UserError(f"bad configuration: {error}") from None
    try:
        loaded = load_configured_model(options["model"])
    except (ValueError, ModelUnavailable) as error:
        raise UserError(str(error)) from None
    torch.set_num_threads(cfg.backend.torch_threads)
    merge = replace(merge, decode=text_decode(loaded.tokenizer))  # stitch compares texts
    with contextlib.ExitStack() as stack:
        try:
            gateway = ChildGateway(run_dir / "gateway", cfg.gateway.host, cfg.gateway.port)
        except OSError as error:
            raise UserError(str(error)) from None
        gateway.start()
        stack.callback(gateway.stop)
        log.info("trajectory viewer: %s/ui (admin token in %s)", gateway.url, gateway.token_file)
        if not cfg.resume:
            warm = task.warm_up(
                loaded.model,
                loaded.tokenizer,
                cache_dir=default_cache_dir().parent / "warmup",
                model_key=f"{loaded.name}:{cfg.model.get('seed', 0)}",
            )
            if warm:
                log.info("warm-up: %s", warm)
        server = _serve(options["inference"], loaded, cfg, run_dir)
        stack.callback(server.close)
        try:
            server.start()
        except (OSError, RuntimeError) as error:
            raise UserError(f"inference={cfg.inference.name}: {error}") from None
        policy = _policy(backend_config, loaded, server, run_dir)
        if close_policy := getattr(policy, "close", None):
            stack.callback(close_policy)  # verl's workers (and a Ray it started)
        agent_gateway_url = cfg.controller.get("agent_gateway_url") or gateway.url
        executor = _executor(
            options["controller"],
            cfg.task.harness,
            run_dir,
            agent_gateway_url,
            cfg.task.get("grader"),
        )
        http = fast_http_client(64)
        client = AsyncGatewayClient(gateway.url, gateway.token, timeout_s=120.0, http=http)
        await client.delete_models(loaded.name)  # endpoints of an earlier run in this folder

        async def publish(version: int) -> None:
            await asyncio.to_thread(server.publish, version)
            await client.register_models(
                [
                    ModelEndpoint(model=loaded.name, endpoint=url, policy_version=version)
                    for url in server.endpoints
                ]
            )

        controller = Controller(
            client,
            executor,
            gateway_url=agent_gateway_url,
            model=loaded.name,
            poll_s=cfg.controller.poll_s,
            reconcile_s=cfg.controller.get("reconcile_s"),
        )
        try:
            await executor.start()
        except ValueError as error:
            await executor.close()
            await http.aclose()
            raise UserError(str(error)) from None
        controller_task = asyncio.create_task(controller.run(), name="controller")
        tracker = Tracker(
            run_dir,
            options,
            wandb=cfg.logging.wandb,
            project=cfg.logging.wandb_project,
            group=sweep,
            name=run_dir.name,
            tags=[f"{g}={cfg[g].name}" for g in ("merge", "advantage", "loss", "model", "task")]
            + [f"mode={cfg.trainer.mode}"],
            resume=cfg.resume,
        )
        stack.callback(tracker.close)
        progress = Progress(trainer_config.steps, enabled=cfg.logging.progress)
        stack.callback(progress.close)

        generated = {"tokens": 0}

        def on_step(step: int, metrics: dict[str, float]) -> None:
            stats = server.stats
            if stats is not None:
                metrics["inference/busy_s"] = stats.busy_s  # cumulative
                new_tokens = stats.tokens_generated - generated["tokens"]
                generated["tokens"] = stats.tokens_generated
                if metrics.get("time/rollout_s"):
                    metrics["throughput/generated_tokens_per_s"] = (
                        new_tokens / metrics["time/rollout_s"]
                    )
            if metrics.get("time/train_s"):
                metrics["throughput/train_tokens_per_s"] = (
                    metrics.get("train/tokens_computed", 0.0) / metrics["time/train_s"]
                )
            tracker.log(step, metrics)
            progress.update(step, metrics)

        trainer = Trainer(
            client=client,
            policy=policy,
            publish=publish,
            task=task,
            merge=merge,
            advantage=advantage,
            loss=loss,
            config=trainer_config,
            run_dir=run_dir,
            on_step=on_step,
        )
        try:
            await _until_first_done(trainer.run(resume=cfg.resume), controller_task)
        finally:
            controller_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await controller_task
            await http.aclose()
        progress.close()
        if cfg.logging.progress:
            sys.stderr.write(
                summary(tracker.history, str(run_dir), time.monotonic() - started) + "\n"
            )
        return tracker.history


def _backend_config(group: dict[str, Any], steps: int) -> Any:
    """The training backend's config from ``backend=...`` for a run of ``steps``
    (TypeError, ValueError)."""
    options = _options(group)
    options["total_training_steps"] = steps  # the lr schedule's length, as verl's trainer
    options["betas"] = tuple(options.get("betas", (0.9, 0.999)))
    if group["name"] == "torch":
        from agl.backends.training.torch import TorchBackendConfig

        options.pop("torch_threads", None)
        return TorchBackendConfig(**options)
    if group["name"] == "verl":
        try:
            from agl.backends.training.verl import VerlBackendConfig
        except ImportError as error:
            raise UserError(
                f"backend=verl needs verl 0.9.1 ({error}): pip install -e '.[verl]' && "
                "pip install --no-deps verl==0.9.1"
            ) from None
        return VerlBackendConfig(**options)
    raise UserError(f"backend={group['name']}: no such training backend")


def _policy(config: Any, loaded: LoadedModel, server: InferenceService, run_dir: Path) -> Policy:
    """The training side over the module ``server`` serves (updated in place, then
    published): agl's torch backend, or verl's actor update."""
    from agl.backends.training.torch import TorchBackendConfig

    if isinstance(config, TorchBackendConfig):
        from agl.backends.training.embedded import EmbeddedPolicy
        from agl.backends.training.torch import TorchBackend

        return EmbeddedPolicy(TorchBackend(loaded.model, config), server.paused)
    from agl.backends.training.verl import VerlPolicy

    if config.on_ray:  # backend.ranks > 1: verl's FSDP workers on Ray
        from agl.backends.training.verl_ray import RayVerlPolicy

        return RayVerlPolicy(
            loaded.model,
            config,
            tokenizer=loaded.tokenizer,
            paused=server.paused,
            work_dir=run_dir / "verl",
        )
    return VerlPolicy(
        loaded.model,
        config,
        tokenizer=loaded.tokenizer,
        paused=server.paused,
        work_dir=run_dir / "verl",
    )


def _serve(
    options: dict[str, Any], loaded: LoadedModel, cfg: Any, run_dir: Path
) -> InferenceService:
    """The inference engine ``inference=...`` names, serving ``loaded`` (not yet started)."""
    settings = _options(options)
    max_context = cfg.model.get("max_context") or loaded.max_context
    try:
        if options["name"] == "embedded":
            from agl.backends.inference.embedded import EmbeddedServer

            return EmbeddedServer(
                loaded.model,
                loaded.tokenizer,
                loaded.name,
                host=settings["host"],
                port=settings["port"],
                max_batch_size=settings["max_batch_size"],
                max_context=max_context,
                seed=cfg.seed,
                num_threads=settings["torch_threads"],
            )
        if options["name"] == "vllm":
            from agl.backends.inference.vllm import VllmOptions, VllmServers

            settings["max_model_len"] = settings.get("max_model_len") or max_context
            return VllmServers(
                loaded.model, loaded.tokenizer, loaded.name, run_dir, VllmOptions(**settings)
            )
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise UserError(f"inference={options['name']}: {error}") from None
    raise UserError(f"inference={options['name']}: no such inference engine")


def _executor(
    options: dict[str, Any],
    harness: str,
    run_dir: Path,
    agent_gateway_url: str,
    grader: str | None = None,
) -> Executor:
    """The executor ``controller=...`` names; UserError (one line) if it cannot be had."""
    from agl.backends.execution import make_executor

    settings = {
        k: v
        for k, v in _options(options).items()
        if k not in ("poll_s", "reconcile_s", "agent_gateway_url")
    }
    try:
        return make_executor(
            options["name"],
            settings,
            harness=harness,
            run_dir=run_dir,
            agent_gateway_url=agent_gateway_url,
            extra_pythonpath=[str(ROOT)],
            base_dir=ROOT,
            grader=grader,
        )
    except ValueError as error:
        raise UserError(f"controller={options['name']}: {error}") from None


async def _until_first_done(main: Any, companion: asyncio.Task[Any]) -> Any:
    """Run ``main``; if ``companion`` (the controller) dies first, fail with its error."""
    main_task = asyncio.ensure_future(main)
    done, _ = await asyncio.wait({main_task, companion}, return_when=asyncio.FIRST_COMPLETED)
    if main_task in done:
        return main_task.result()
    main_task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await main_task
    error = companion.exception()
    raise RuntimeError(f"the rollout controller stopped: {error!r}")


def make_merge(
    group: dict[str, Any], decode: Callable[[Sequence[int]], str] | None = None
) -> MergeStrategy:
    """The merge strategy of a resolved ``merge`` config group, with its options;
    ``decode`` goes to the strategies that compare texts (stitch). ``agl.runs`` builds a
    finished run's strategy with this too, so what it explains is what was trained."""
    from agl.core.assemble import MergeStrategy
    from agl.core.registry import get

    return MergeStrategy(get("merge", group["name"]), _options(group), decode=decode)


def make_advantage(group: dict[str, Any]) -> Advantage:
    """The advantage function of a resolved ``advantage`` config group, its options bound."""
    from agl.core.registry import get

    return functools.partial(get("advantage", group["name"]), **_options(group))


def load_configured_model(group: dict[str, Any]) -> LoadedModel:
    """The model of a resolved ``model`` config group (ValueError, ModelUnavailable)."""
    from agl.backends.inference.models import load_model

    cache_dir = group.get("cache_dir")
    return load_model(
        group["name"],
        cache_dir=Path(cache_dir) if cache_dir else None,
        seed=group.get("seed", 0),
    )


def text_decode(tokenizer: Any) -> Callable[[Sequence[int]], str]:
    """The text of token ids as merge strategies compare it: special tokens kept."""
    return lambda ids: tokenizer.decode(list(ids), skip_special_tokens=False)


def _options(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "name"}


def _setup_logging(run_dir: Path, level: str) -> None:
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    to_file = logging.FileHandler(run_dir / "train.log")
    to_file.setLevel(logging.INFO)
    to_console = logging.StreamHandler(sys.stderr)
    to_console.setLevel(level.upper())
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    for handler in (to_file, to_console):
        handler.setFormatter(fmt)
        root.addHandler(handler)
    root.setLevel(logging.INFO)
    # One line per request at INFO: thousands per step.
    for chatty in ("httpx", "httpcore"):
        logging.getLogger(chatty).setLevel(logging.WARNING)


if __name__ == "__main__":
    main()
