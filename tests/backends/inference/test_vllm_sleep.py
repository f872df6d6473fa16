"""``inference.sleep_mode``: vLLM sleeps while the policy trains, then wakes for the
weights, then for the KV cache.

vLLM's sleep needs CUDA's memory pool, so on this CPU machine the replicas are
``tests.helpers.fake_vllm`` servers (real HTTP on loopback, 0.32's routes, recording
every call in order) and the policy is the real one ``agl.core.run.build.policy_for``
builds (the torch backend, and verl's in this process, on a tiny model, trained for
real). Proved:

- one update cycle (the policy's ``train``, then ``publish``) sends every replica
  exactly: pause -> sleep (level 1) -> [training] -> wake weights -> weight reload ->
  wake KV cache -> reset prefix cache -> (version) -> resume; the replicas sleep while
  the loss is computed;
- an ordinary pause (``paused()``, a ``publish`` with no training before it, a
  checkpoint load) never sleeps or wakes, and ``sleep_mode`` off never does;
- a training that raises leaves the replicas awake and resumed;
- ``sleep_mode`` for replicas that would run on CPU is refused in one line before any
  starts;
- conf/swe_gpu_collocated.yaml (not run: no GPU here) puts every replica and every
  training rank on the same 8 GPUs, with sleep mode and FSDP offload on, async.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from torch.distributed.tensor import DTensor

from agl.backends.inference.models import LoadedModel
from agl.backends.inference.vllm import VllmOptions, VllmServers, options_from
from agl.backends.inference.vllm_placement import place_replicas
from agl.backends.training.torch import TorchBackendConfig
from agl.backends.training.verl.config import VerlBackendConfig
from agl.backends.training.yielding import YieldingPolicy
from agl.core.contracts.samples import Sample
from agl.core.contracts.training import Policy
from agl.core.run.build import backend_config, inference_service, policy_for
from agl.core.trainer.loop import TrainerConfig
from agl.core.user_error import UserError
from tests.helpers.fake_vllm import FakeVllm, fake_vllm
from tests.helpers.torch_models import make_model, one_thread, random_batch, token_mean

__all__ = ["one_thread"]  # the autouse fixture: one torch thread in this module

CONF = Path(__file__).resolve().parents[3] / "conf"
NAME = "tiny"
REPLICAS = 2
PAUSE = "POST /pause?mode=wait"
SLEEP = "POST /sleep?level=1&mode=wait"
WAKE_WEIGHTS = "POST /wake_up?tags=weights"
RELOAD = "POST /collective_rpc reload_weights"
WAKE_KV = "POST /wake_up?tags=kv_cache"
RESET = "POST /reset_prefix_cache"
VERSION = "POST /update_weight_version"
RESUME = "POST /resume"


class Setup:
    """Fake replicas, the ``VllmServers`` attached to them and the policy over both."""

    def __init__(self, fakes: list[FakeVllm], servers: VllmServers, policy: Policy) -> None:
        self.fakes = fakes
        self.servers = servers
        self.policy = policy
        self.samples: list[Sample] = random_batch(random.Random(0), 4)
        self.advantages = [1.0 if i % 2 else -1.0 for i in range(len(self.samples))]
        self.during_training: list[tuple[list[str], set[str]]] = []

    def loss(self, samples: list[Sample]) -> list[list[float]]:
        """token_mean, noting what each replica was sent and what sleeps by then."""
        self.during_training = [(f.sequence(), set(f.asleep)) for f in self.fakes]
        return token_mean(samples)

    def train(self) -> dict[str, float]:
        return self.policy.train(self.samples, self.advantages, self.loss)

    def sequences(self) -> list[list[str]]:
        return [f.sequence() for f in self.fakes]

    def clear(self) -> None:
        for fake in self.fakes:
            fake.clear()


def setup(tmp_path: Path, sleep_mode: bool, backend: str = "torch") -> Iterator[Setup]:
    """``backend``: torch (CollocatedPolicy) or verl (VerlPolicy in this process, whose
    own pauses nest inside the sleep), as ``policy_for`` builds them."""
    config: Any = TorchBackendConfig(lr=1e-2)
    if backend == "verl":
        pytest.importorskip("verl", reason="backend=verl needs verl 0.9.1")
        config = VerlBackendConfig(lr=1e-2)
    with ExitStack() as stack:
        fakes = [stack.enter_context(fake_vllm(NAME)) for _ in range(REPLICAS)]
        model = make_model()
        options = VllmOptions(
            urls=[f"{f.url}/v1" for f in fakes],
            weights_dir=str(tmp_path / "weights"),
            weight_sync="file",  # the reload's call is one line of the sequence
            sleep_mode=sleep_mode,
        )
        servers = VllmServers(model, None, NAME, tmp_path, options, api_key="key")
        stack.enter_context(servers)
        loaded = LoadedModel(name=NAME, model=model, tokenizer=None, max_context=512)
        policy = policy_for(config, loaded, servers, tmp_path / "run")
        assert isinstance(policy, YieldingPolicy)  # VllmServers has a training() window
        stack.callback(policy.close)
        built = Setup(fakes, servers, policy)
        built.clear()
        yield built


@pytest.fixture
def sleeping(tmp_path: Path) -> Iterator[Setup]:
    yield from setup(tmp_path, sleep_mode=True)


@pytest.fixture(params=["torch", "verl"])
def sleeping_on(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Setup]:
    yield from setup(tmp_path, sleep_mode=True, backend=request.param)


@pytest.fixture
def awake(tmp_path: Path) -> Iterator[Setup]:
    yield from setup(tmp_path, sleep_mode=False)


def weights(model: Any) -> dict[str, list[float]]:
    """The module's parameters, whole (FSDP2 leaves DTensors), as comparable lists."""
    out = {}
    for name, p in model.named_parameters():
        tensor = p.detach()
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        out[name] = tensor.flatten().tolist()
    return out


def test_update_cycle_sleeps_while_training_then_wakes_weights_then_kv_cache(
    sleeping_on: Setup,
) -> None:
    cycle = sleeping_on
    before = weights(cycle.servers.model)
    cycle.train()
    assert weights(cycle.servers.model) != before  # it trained, for real
    # While the loss was computed every replica had drained and was asleep, all of it.
    assert cycle.during_training == [([PAUSE, SLEEP], {"weights", "kv_cache"})] * REPLICAS
    # Still asleep (and paused) until the update: nothing serves between the two.
    assert all(f.asleep == {"weights", "kv_cache"} and f.paused for f in cycle.fakes)

    cycle.servers.publish(1)
    # Two resets: the KV cache's wake empties the prefix cache, as publish's version step.
    expected = [PAUSE, SLEEP, WAKE_WEIGHTS, RELOAD, WAKE_KV, RESET, RESET, VERSION, RESUME]
    assert cycle.sequences() == [expected] * REPLICAS
    assert all(not f.asleep and not f.paused for f in cycle.fakes)

    # The next cycle sleeps again, from the same state.
    cycle.clear()
    cycle.train()
    cycle.servers.publish(2)
    assert cycle.sequences() == [expected] * REPLICAS


def test_an_ordinary_pause_never_sleeps(sleeping: Setup) -> None:
    with sleeping.servers.paused():
        pass
    sleeping.servers.publish(1)  # no training before it: nothing to wake
    expected_publish = [PAUSE, RELOAD, RESET, VERSION, RESUME]
    assert sleeping.sequences() == [[PAUSE, RESUME, *expected_publish]] * REPLICAS


def test_checkpoint_load_does_not_sleep(sleeping: Setup, tmp_path: Path) -> None:
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    sleeping.policy.save(folder)
    sleeping.policy.load(folder)  # the torch backend loads under paused()
    assert sleeping.sequences() == [[PAUSE, RESUME]] * REPLICAS


def test_sleep_mode_off_never_sleeps(awake: Setup) -> None:
    awake.train()
    awake.servers.publish(1)
    # The torch backend pauses around its own update; vLLM keeps its memory throughout.
    expected = [PAUSE, RESUME, PAUSE, RELOAD, RESET, VERSION, RESUME]
    assert awake.sequences() == [expected] * REPLICAS


def test_a_failed_training_leaves_the_replicas_awake_and_resumed(sleeping: Setup) -> None:
    def broken(samples: list[Sample]) -> list[list[float]]:
        raise RuntimeError("the loss failed")

    with pytest.raises(RuntimeError, match="the loss failed"):
        sleeping.policy.train(sleeping.samples, sleeping.advantages, broken)
    expected = [PAUSE, SLEEP, WAKE_WEIGHTS, WAKE_KV, RESET, RESUME]
    assert sleeping.sequences() == [expected] * REPLICAS
    assert all(not f.asleep and not f.paused for f in sleeping.fakes)


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_sleep_mode_where_vllm_would_run_on_cpu_is_refused_in_one_line(
    tmp_path: Path, device: str
) -> None:
    if device == "auto" and torch.cuda.is_available():
        pytest.skip("auto means a GPU on this machine")
    loaded = LoadedModel(name=NAME, model=make_model(), tokenizer=None, max_context=512)
    options = {"name": "vllm", "sleep_mode": True, "device": device, "python": "/nonexistent"}
    cfg = OmegaConf.create({"seed": 0, "model": {}})  # what inference_service reads
    with pytest.raises(UserError) as error:
        inference_service(options, loaded, cfg, tmp_path, "key")
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("inference=vllm: sleep_mode needs vLLM on a GPU")


def collocated_recipe(name: str = "swe_gpu_collocated") -> dict[str, Any]:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(
            config_name=name,
            overrides=[
                "model.path=/models/Qwen3.5-9B",
                "task.train_files=/data/swe/3-split/train.jsonl",
                "task.options.mirror=/data/swe/mirror",
            ],
        )
    assert not OmegaConf.missing_keys(cfg)
    options: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True)
    return options


def test_the_collocated_recipe_shares_every_gpu_between_rollout_and_training() -> None:
    options = collocated_recipe()
    inference, backend = options["inference"], options["backend"]
    assert inference["sleep_mode"] is True
    trainer = TrainerConfig(**options["trainer"])
    assert trainer.mode == "async"  # the paper's collocated async
    config = backend_config(backend, trainer.steps)
    assert config.param_offload and config.optimizer_offload
    # Replica i on GPU i of 8, training's ranks on the first `ranks` GPUs: the same 8.
    placed = place_replicas(
        inference["replicas"],
        [str(i) for i in range(8)],
        tensor_parallel_size=inference["tensor_parallel_size"],
        gpus=inference["gpus"],
        training_gpus=inference["training_gpus"],
    )
    assert [p.devices for p in placed] == [(str(i),) for i in range(8)]
    assert config.ranks == config.gpus_per_node == 8


@pytest.mark.parametrize("recipe", ["swe_gpu", "swe_gpu_collocated"])
def test_the_swe_gpu_recipes_inference_options_are_vllms(recipe: str, tmp_path: Path) -> None:
    """swe.yaml's max_batch_size (8, the embedded engine's on CPU) once reached vLLM's
    options as an unknown key: neither GPU recipe could start. It is vLLM's
    --max-num-seqs now, 64 in the GPU recipes."""
    options = options_from(collocated_recipe(recipe)["inference"], keys=("key_file",))
    options.device = "cuda"  # the recipes' GPU (sleep mode is refused for a CPU)
    args = VllmServers(None, None, "m", tmp_path, options, api_key=None)._args(8000, None)
    assert args[args.index("--max-num-seqs") + 1] == "64"
