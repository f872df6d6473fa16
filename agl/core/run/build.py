"""What a run is made of, built from its composed config: the training backend and policy,
the inference service and the executor. ``agl.train`` runs them. The merge and advantage
strategies and the model come from ``agl.core.config_groups``, which the tools that read
a finished run use too, so what they explain is what was trained.

Every function raises :class:`UserError` (one line) for a config it cannot honour.
"""

from __future__ import annotations

import importlib.util
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agl.core.config_groups import group_options
from agl.core.repository import ROOT
from agl.core.user_error import UserError

if TYPE_CHECKING:
    from agl.backends.inference.models import LoadedModel
    from agl.backends.inference.service import InferenceService
    from agl.backends.training.verl.ray import RayVerlPolicy
    from agl.core.contracts.execution import Executor
    from agl.core.contracts.training import Policy


def backend_config(group: dict[str, Any], steps: int) -> Any:
    """The training backend's config from ``backend=...`` for a run of ``steps``
    (TypeError, ValueError)."""
    options = group_options(group)
    options["total_training_steps"] = steps  # the lr schedule's length, as verl's trainer
    options["betas"] = tuple(options.get("betas", (0.9, 0.999)))
    if group["name"] == "torch":
        from agl.backends.training.torch import TorchBackendConfig

        options.pop("torch_threads", None)
        return TorchBackendConfig(**options)
    if group["name"] == "verl":
        # The config is plain Python; verl itself is imported only when the policy is built,
        # after the model and the services started: check it is there before all that.
        if importlib.util.find_spec("verl") is None:
            raise UserError(
                "backend=verl needs verl 0.9.1, which is not installed: "
                "pip install -e '.[verl]' && pip install --no-deps verl==0.9.1"
            )
        from agl.backends.training.verl.config import VerlBackendConfig

        return VerlBackendConfig(**options)
    raise UserError(f"backend={group['name']}: no such training backend")


def policy_for(config: Any, loaded: LoadedModel, server: InferenceService, run_dir: Path) -> Policy:
    """The training side over the module ``server`` serves (updated in place, then
    published): agl's torch backend, or verl's actor update; each update inside the
    server's ``training()`` where it has one (vLLM's sleep mode frees its GPU memory)."""
    policy = _training_side(config, loaded, server, run_dir)
    window = getattr(server, "training", None)
    if window is None:
        return policy
    from agl.backends.training.yielding import YieldingPolicy

    return YieldingPolicy(policy, window)


def _training_side(
    config: Any, loaded: LoadedModel, server: InferenceService, run_dir: Path
) -> Policy:
    from agl.backends.training.torch import TorchBackendConfig

    if isinstance(config, TorchBackendConfig):
        from agl.backends.training.collocated import CollocatedPolicy
        from agl.backends.training.torch import TorchBackend

        return CollocatedPolicy(TorchBackend(loaded.model, config), server.paused)
    from agl.backends.training.verl.policy import VerlPolicy

    if config.on_ray:  # backend.ranks > 1: verl's FSDP workers on Ray
        from agl.backends.training.verl.ray import RayVerlPolicy

        ray_policy = RayVerlPolicy(
            loaded.model,
            config,
            tokenizer=loaded.tokenizer,
            paused=server.paused,
            work_dir=run_dir / "verl",
            weights_from=loaded.weights_from,
            trust_remote_code=loaded.trust_remote_code,
        )
        _publish_from_rank_zero(ray_policy, server)
        return ray_policy
    return VerlPolicy(
        loaded.model,
        config,
        tokenizer=loaded.tokenizer,
        paused=server.paused,
        work_dir=run_dir / "verl",
    )


def _publish_from_rank_zero(policy: RayVerlPolicy, server: InferenceService) -> None:
    """vLLM with ``weight_sync=distributed``: verl's rank 0 broadcasts the weights to the
    replicas itself, so no step gathers a full state dict through Ray into the trainer's
    module (``ray.RayWeightSource``). The embedded engine, or ``weight_sync=file``, serve
    or write the trainer's module: the policy keeps loading the weights into it."""
    from agl.backends.inference.vllm import VllmServers

    if isinstance(server, VllmServers) and server.options.weight_sync == "distributed":
        server.publish_from(policy.weight_source())


def inference_key(options: dict[str, Any]) -> str:
    """The key this run's inference requires on every call, which only the trainer and its
    gateway hold (never an agent): the one in the file ``inference.key_file`` names (the
    key attached vLLM replicas were started with), else a new random one per run."""
    key_file = options.get("key_file")
    if not key_file:
        return secrets.token_urlsafe(32)
    from agl.core.gateway.upstream import read_key_file

    try:
        return read_key_file(key_file)
    except OSError as error:
        raise UserError(f"inference.key_file={key_file}: {error.strerror}") from None
    except ValueError as error:  # it names the file
        raise UserError(f"inference.key_file: {error}") from None


def inference_service(
    options: dict[str, Any], loaded: LoadedModel, cfg: Any, run_dir: Path, api_key: str
) -> InferenceService:
    """The inference engine ``inference=...`` names, serving ``loaded`` (not yet started)
    to the holders of ``api_key`` only (``inference_key``)."""
    settings = {k: v for k, v in group_options(options).items() if k != "key_file"}
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
                tool_parser=loaded.tool_parser,
                api_key=api_key,
                kv_cache_gib=settings.get("kv_cache_gib"),
            )
        if options["name"] == "vllm":
            from agl.backends.inference.vllm import VllmOptions, VllmServers

            settings["max_model_len"] = settings.get("max_model_len") or max_context
            settings["tool_parser"] = loaded.tool_parser  # the model's format, as embedded
            settings["trust_remote_code"] = loaded.trust_remote_code
            return VllmServers(
                loaded.model,
                loaded.tokenizer,
                loaded.name,
                run_dir,
                VllmOptions(**settings),
                api_key=api_key,
            )
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise UserError(f"inference={options['name']}: {error}") from None
    raise UserError(f"inference={options['name']}: no such inference engine")


def executor_for(
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
        for k, v in group_options(options).items()
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
