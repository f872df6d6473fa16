"""Each vLLM replica's GPUs (``agl/backends/inference/vllm_placement.py``, rendered by
``VllmServers``), on CPU: no vLLM starts here.

- Training takes the first ``training_gpus`` visible GPUs; replica ``i`` the next
  ``tensor_parallel_size`` (or the ids ``inference.gpus[i]`` names): no GPU twice, none
  of training's.
- A replica's placement becomes its ``CUDA_VISIBLE_DEVICES``, ``--tensor-parallel-size``
  and ``--gpu-memory-utilization``; on a machine without CUDA (this one) nothing
  GPU-specific.
- A placement that cannot be met is one line, raised by ``start()`` before anything is
  written or started.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from agl.backends.inference.models import load_model
from agl.backends.inference.vllm import VllmOptions, VllmServers
from agl.backends.inference.vllm_placement import (
    PlacementError,
    ReplicaPlacement,
    place_replicas,
    visible_gpus,
)

EIGHT = [str(i) for i in range(8)]
KEY = "placement-test-key"


def _devices(placements: list[ReplicaPlacement]) -> list[tuple[str, ...]]:
    return [p.devices for p in placements]


def test_replicas_take_the_gpus_after_trainings() -> None:
    """swe_gpu's node: 4 training ranks on 0-3, 4 replicas on 4-7."""
    placed = place_replicas(4, EIGHT, training_gpus=4)
    assert _devices(placed) == [("4",), ("5",), ("6",), ("7",)]
    two = place_replicas(2, EIGHT, tensor_parallel_size=2, training_gpus=4)
    assert _devices(two) == [("4", "5"), ("6", "7")]
    assert _devices(place_replicas(8, EIGHT)) == [(g,) for g in EIGHT]  # training elsewhere
    # the node's own numbering: the trainer sees 2,3,6,7 (CUDA_VISIBLE_DEVICES)
    assert _devices(place_replicas(2, ["2", "3", "6", "7"], training_gpus=2)) == [("6",), ("7",)]


def test_a_placement_renders_as_env_and_flags() -> None:
    gpu = ReplicaPlacement(("4", "5"), tensor_parallel_size=2, gpu_memory_utilization=0.85)
    assert gpu.env() == {"CUDA_VISIBLE_DEVICES": "4,5"}
    assert gpu.args() == ["--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.85"]
    cpu = ReplicaPlacement(())
    assert cpu.env() == {} and cpu.args() == []
    assert ReplicaPlacement((), tensor_parallel_size=2).args() == ["--tensor-parallel-size", "2"]


def test_explicit_gpus_per_replica() -> None:
    placed = place_replicas(
        2, EIGHT, tensor_parallel_size=2, gpus=[[6, 7], ["4", 5]], training_gpus=4
    )
    assert _devices(placed) == [("6", "7"), ("4", "5")]
    assert _devices(place_replicas(2, EIGHT, gpus=[7, 3])) == [("7",), ("3",)]


@pytest.mark.parametrize(
    ("replicas", "options", "words"),
    [
        (5, {"training_gpus": 4}, r"5 vLLM replica\(s\) x tensor_parallel_size 1 need 5 GPUs"),
        (2, {"tensor_parallel_size": 4, "training_gpus": 1}, "need 8 GPUs.*training takes"),
        (2, {"gpus": [[4]]}, r"lists 1 replica\(s\)' GPUs; inference.replicas is 2"),
        (1, {"gpus": [[4]], "tensor_parallel_size": 2}, "has 1 GPU.*tensor_parallel_size is 2"),
        (2, {"gpus": [5, 5]}, "GPU 5 is given to two replicas"),
        (1, {"gpus": [9]}, "GPU 9 is not visible here"),
        (1, {"gpus": [1], "training_gpus": 4}, "GPU 1 is training's"),
        (1, {"tensor_parallel_size": 0}, "tensor_parallel_size must be at least 1"),
        (1, {"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization must be in \(0, 1\]"),
    ],
)
def test_a_placement_that_cannot_be_met_is_one_line(
    replicas: int, options: dict[str, Any], words: str
) -> None:
    with pytest.raises(PlacementError, match=words) as error:
        place_replicas(replicas, EIGHT, **options)
    assert "\n" not in str(error.value)


def test_without_gpus_nothing_is_placed() -> None:
    assert _devices(place_replicas(3, [], training_gpus=1)) == [(), (), ()]
    with pytest.raises(PlacementError, match="none is visible"):
        place_replicas(1, [], gpus=[0])


def test_visible_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,6")
    assert visible_gpus("cpu") == []
    assert visible_gpus("cuda") == ["2", "3", "6"]  # listed: the trainer's torch may lack CUDA
    assert visible_gpus("auto", cuda_count=3) == ["2", "3", "6"]
    assert visible_gpus("auto", cuda_count=0) == []  # a list but no CUDA: a CPU run
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert visible_gpus("auto", cuda_count=2) == ["0", "1"]
    with pytest.raises(PlacementError, match=r"inference\.device=cuda, but no GPU"):
        visible_gpus("cuda", cuda_count=0)
    with pytest.raises(PlacementError, match=r"auto\|cpu\|cuda"):
        visible_gpus("tpu")


def _servers(tmp_path: Path, **options: Any) -> VllmServers:
    tiny = load_model("tiny")
    return VllmServers(
        tiny.model, tiny.tokenizer, "tiny", tmp_path, VllmOptions(**options), api_key=KEY
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_on_this_cpu_machine_nothing_gpu_specific_is_rendered(tmp_path: Path) -> None:
    servers = _servers(tmp_path, replicas=2, training_gpus=1)
    (placement, _) = place_replicas(2, visible_gpus(servers.options.device), training_gpus=1)
    args = servers._args(8000, None, placement)
    assert "--gpu-memory-utilization" not in args and "--tensor-parallel-size" not in args
    env = servers._env(0, placement)
    assert env.get("CUDA_VISIBLE_DEVICES") == servers._env(0).get("CUDA_VISIBLE_DEVICES")


def test_a_replica_gets_its_own_gpus_whatever_options_env_says(tmp_path: Path) -> None:
    servers = _servers(tmp_path, env={"CUDA_VISIBLE_DEVICES": "0"}, extra_args=["--x"])
    placement = ReplicaPlacement(("6", "7"), tensor_parallel_size=2, gpu_memory_utilization=0.5)
    args = servers._args(8000, None, placement)
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    assert args[args.index("--gpu-memory-utilization") + 1] == "0.5"
    assert args[-1] == "--x"  # extra_args last: a recipe's own flags win
    assert servers._env(1, placement)["CUDA_VISIBLE_DEVICES"] == "6,7"


def test_start_refuses_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2 visible GPUs, training takes 1, 2 replicas want 2 each: one line, no model
    folder written, no replica started (its log would exist)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    servers = _servers(
        tmp_path,
        python=sys.executable,
        device="cuda",
        replicas=2,
        tensor_parallel_size=2,
        training_gpus=1,
    )
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"need 4 GPUs, but this node has 2 visible") as error:
        servers.start()
    assert "\n" not in str(error.value)
    assert not servers.weights_dir.exists()
    assert not list(tmp_path.rglob("replica-*.log"))
    assert time.monotonic() - started < 10
