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
import logging
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

from agl.core.repository import CONF, ROOT
from agl.core.user_error import UserError

__all__ = ["CONF", "ROOT", "check_choices", "main", "train"]

GROUPS = ("merge", "advantage", "loss", "model", "task", "backend", "inference", "controller")

log = logging.getLogger("agl.train")


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
    if hydra_cfg.mode is not None and hydra_cfg.mode.name == "MULTIRUN":
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


def train(cfg: Any, run_dir: Path, sweep: str | None = None) -> list[dict[str, Any]]:
    """Run one experiment described by the composed config ``cfg``; answers its metrics."""
    from omegaconf import OmegaConf

    run_dir.mkdir(parents=True, exist_ok=True)
    _setup_logging(run_dir, cfg.logging.level)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    return asyncio.run(_run(cfg, run_dir, sweep))


async def _run(cfg: Any, run_dir: Path, sweep: str | None) -> list[dict[str, Any]]:
    import torch
    from omegaconf import OmegaConf

    from agl.backends.inference.models import ModelUnavailable, default_cache_dir
    from agl.core.client import AsyncGatewayClient, fast_http_client
    from agl.core.config_groups import (
        load_configured_model,
        make_advantage,
        make_merge,
        text_decode,
    )
    from agl.core.contracts.records import ModelEndpoint
    from agl.core.controller.reconcile import Controller
    from agl.core.datasets import DatasetError
    from agl.core.run.build import (
        backend_config,
        executor_for,
        inference_key,
        inference_service,
        policy_for,
    )
    from agl.core.run.console import Progress, summary
    from agl.core.run.services import ChildGateway
    from agl.core.run.task_services import ChildService
    from agl.core.run.tasks import Task, TaskConfig
    from agl.core.run.tracking import Tracker
    from agl.core.trainer.assemble import FinishedRollout
    from agl.core.trainer.loop import Trainer, TrainerConfig
    from agl.core.trainer.trajectories import COLUMNS, trajectory_rows
    from agl.strategies.registry import get

    started = time.monotonic()
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise UserError(f"set {', '.join(missing)} (on the command line: key=value)")
    options = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True))
    torch.manual_seed(cfg.seed)
    try:
        trainer_config = TrainerConfig(**options["trainer"])
        backend_config = backend_config(options["backend"], trainer_config.steps)
        merge = make_merge(options["merge"])
        advantage = make_advantage(options["advantage"])
        loss = get("loss", cfg.loss.name)
        task = Task(TaskConfig(**options["task"]), ROOT, seed=cfg.seed)
        task.check_length(trainer_config.steps, trainer_config.groups_per_step)
    except DatasetError as error:  # it names the file
        raise UserError(str(error)) from None
    except (TypeError, ValueError, KeyError) as error:
        raise UserError(f"bad configuration: {error}") from None
    try:
        loaded = load_configured_model(options["model"])
    except (ValueError, ModelUnavailable) as error:
        raise UserError(str(error)) from None
    torch.set_num_threads(cfg.backend.torch_threads)
    merge = replace(merge, decode=text_decode(loaded.tokenizer))  # stitch compares texts
    # Only the gateway and the trainer hold it: an agent's model call that skips the
    # gateway (unrecorded, past the admission gate and the rate limit) is refused.
    key = inference_key(options["inference"])
    with contextlib.ExitStack() as stack:
        try:
            gateway = ChildGateway(
                run_dir / "gateway",
                cfg.gateway.host,
                cfg.gateway.port,
                cfg.gateway.sampling_seed,
                inference_key=key,
            )
        except OSError as error:
            raise UserError(str(error)) from None
        gateway.start()
        stack.callback(gateway.stop)
        log.info("trajectory viewer: %s/ui (admin token in %s)", gateway.url, gateway.token_file)
        for spec in task.services:
            service = ChildService(spec, run_dir / "services")
            stack.callback(service.stop)
            try:
                service.start()
            except (OSError, RuntimeError, TimeoutError) as error:
                raise UserError(str(error)) from None
            task.service_urls[f"{spec.name}_url"] = service.url
            log.info("task service %s: %s", spec.name, service.url)
        if not cfg.resume:
            warm = task.warm_up(
                loaded.model,
                loaded.tokenizer,
                cache_dir=default_cache_dir().parent / "warmup",
                model_key=f"{loaded.name}:{cfg.model.get('seed', 0)}",
            )
            if warm is not None:
                loaded.weights_from = None  # no longer the weights at model.path
            if warm:
                log.info("warm-up: %s", warm)
        server = inference_service(options["inference"], loaded, cfg, run_dir, key)
        stack.callback(server.close)
        try:
            server.start()
        except (OSError, RuntimeError) as error:
            raise UserError(f"inference={cfg.inference.name}: {error}") from None
        try:
            policy = policy_for(backend_config, loaded, server, run_dir)
        except ValueError as error:  # a layout the cluster cannot place, say
            raise UserError(f"backend={cfg.backend.name}: {error}") from None
        if close_policy := getattr(policy, "close", None):
            stack.callback(close_policy)  # verl's workers (and a Ray it started)
        agent_gateway_url = cfg.controller.get("agent_gateway_url") or gateway.url
        executor = executor_for(
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
            group=cfg.logging.get("wandb_group") or sweep,
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

        trajectories = cfg.logging.get("wandb_trajectories", 0) if cfg.logging.wandb else 0

        def on_rollouts(step: int, mode: str, rollouts: list[FinishedRollout]) -> None:
            if trajectories:
                rows = trajectory_rows(
                    rollouts,
                    merge,
                    limit=trajectories,
                    key=f"{mode}:{step}",
                    text_chars=cfg.logging.get("wandb_text_chars", 4000),
                    dedup_rule=trainer_config.dedup,
                )
                tracker.log_table(step, f"{mode}/trajectories", COLUMNS, rows)

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
            on_rollouts=on_rollouts,
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
