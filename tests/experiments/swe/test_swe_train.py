"""``python -m agl.train --config-name swe`` end to end on tasks the pipeline made: the
policy drives mini-swe-agent through the proxy, its commands run in the sandbox, the
grader runs the task's tests, and the trainer steps on the rewards it posted; on the
local controller, and as Kubernetes Jobs on the test API server (``controller=swe_k8s``:
the harness as each Job's init container, the grader after it). The tiny model (random
weights, fast) stands in for SmolLM2 here: this checks the wiring, not learning."""

from __future__ import annotations

import json
import sqlite3
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir

from agl.grading import GRADE_EVENT
from agl.sandbox.launch import unavailable
from agl.testing.k8s.api_server import ApiServer
from agl.testing.k8s.node import NodeSimulator
from agl.train import CONF, train
from experiments.swe import pipeline
from tests.helpers import swe_tasks

REPO = Path(__file__).resolve().parents[3]

needs_namespaces = pytest.mark.skipif(
    unavailable() is not None, reason=f"no namespaces here: {unavailable()}"
)


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Eight candidate bugs in one project, made (once per run: swe_tasks), filtered and
    split by the pipeline."""
    data = swe_tasks.copy_made(tmp_path_factory, tmp_path_factory.mktemp("swe") / "swe")
    for argv in (
        [*swe_tasks.MAKE, "--out", str(data)],  # made: skipped
        ["filter", "--out", str(data)],
        ["split", "--test", "1", "--out", str(data)],
    ):
        assert pipeline.main(argv) == 0, argv
    return data


def _train(tasks: Path, run: Path, *extra: str, steps: int = 2) -> list[dict[str, Any]]:
    split = tasks / pipeline.SPLIT
    overrides = [
        "model=tiny",
        f"task.train_files={split / 'train.jsonl'}",
        f"task.val_files={split / 'test.jsonl'}",
        f"task.options.mirror={tasks / pipeline.MIRROR}",
        "task.options.step_limit=2",
        "task.sampling.max_tokens=48",
        f"trainer.steps={steps}",
        "trainer.groups_per_step=2",
        "trainer.group_size=2",
        # validation once, before the first step (a rollout graded like the others): an
        # interval past the last step adds none after it
        f"trainer.val_every={steps + 1}",
        "trainer.val_size=1",
        "logging.wandb=false",
        "logging.progress=false",
        *extra,
    ]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="swe", overrides=overrides)
    return train(cfg, run)


def _grades_and_calls(run: Path) -> tuple[list[dict[str, Any]], int]:
    with sqlite3.connect(run / "gateway" / "gateway.db") as db:
        grades = [
            json.loads(d)
            for (d,) in db.execute("SELECT data FROM events WHERE type = ?", (GRADE_EVENT,))
        ]
        calls = db.execute("SELECT count(*) FROM events WHERE type = 'model_request'").fetchone()
    return grades, calls[0]


def _tests_ran(grades: list[dict[str, Any]]) -> None:
    for grade in grades:  # the real tests ran: a random policy fixes nothing
        assert grade["resolved"] is False and grade["fail_to_pass"][1] > 0
        assert grade["pass_to_pass"][1] > 0


@pytest.mark.slow
@needs_namespaces
def test_a_short_run_trains_on_the_graders_rewards(tasks: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    history = _train(tasks, run)
    steps = [row for row in history if "reward/mean" in row]
    assert [row["step"] for row in steps] == [1, 2]
    for row in steps:
        assert row["rollouts/finished"] == 4 and row["rollouts/failed"] == 0
    assert any("val/reward" in row for row in history)
    grades, calls = _grades_and_calls(run)
    assert len(grades) >= 8  # every rollout trained on was graded
    _tests_ran(grades)
    assert calls >= 9  # mini-swe-agent asked the policy through the proxy


@pytest.mark.slow
@needs_namespaces
def test_the_cpu_scale_config_runs_mini_cpu_yaml_on_cpu_tasks(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """conf/swe_cpu.yaml with toolz's CPU-scale tasks and no warm-up (random weights: the
    wiring, not learning): mini-swe-agent runs with mini_cpu.yaml, the grader grades."""
    made = swe_tasks.toolz_cpu_made(tmp_path_factory)
    tasks = made / pipeline.MAKE / "instances.jsonl"
    overrides = [
        f"task.train_files={tasks}",
        f"task.val_files={tasks}",
        f"task.options.mirror={made / pipeline.MIRROR}",
        "task.warmup=null",
        "task.warmup_pins=null",
        "task.sampling.max_tokens=32",
        "task.options.step_limit=2",
        "trainer.steps=1",
        "trainer.groups_per_step=2",
        "trainer.group_size=2",
        "trainer.val_every=2",
        "trainer.val_size=1",
        "logging.wandb=false",
        "logging.progress=false",
    ]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="swe_cpu", overrides=overrides)
    run = tmp_path / "run"
    history = train(cfg, run)
    (step,) = [row for row in history if "reward/mean" in row]
    assert step["rollouts/finished"] == 4 and step["rollouts/failed"] == 0
    grades, calls = _grades_and_calls(run)
    assert len(grades) >= 4 and calls >= 4
    _tests_ran(grades)
    with sqlite3.connect(run / "gateway" / "gateway.db") as db:
        (data,) = db.execute("SELECT data FROM events WHERE type = 'model_request'").fetchone()
    system = json.loads(data)["messages"][0]["content"]
    assert system.startswith("Fix the bug with shell commands")  # mini_cpu.yaml's


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    unavailable_here = ApiServer.available()
    if unavailable_here is not None:
        pytest.skip(unavailable_here)
    with ApiServer(tmp_path_factory.mktemp("k8s")) as server:
        yield server


@pytest.mark.slow
@needs_namespaces
def test_a_step_through_kubernetes_jobs_grades_each_attempt_in_its_job(
    tasks: Path, cluster: ApiServer, tmp_path: Path
) -> None:
    """conf/controller/swe_k8s.yaml with the test's paths: each Job runs the harness, then
    the grader (python -m agl.grading) on what it left; the node runs both as processes."""
    namespace = f"t-{uuid.uuid4().hex[:8]}"
    # conf/swe/job.yaml's container, with this machine's interpreter and checkout.
    job = {
        "kind": "Job",
        "spec": {
            "template": {
                "spec": {
                    "containers": [
                        {
                            "name": "harness",
                            "image": "agl-swe:test",
                            "workingDir": str(REPO),
                            "command": [sys.executable, "-m", "experiments.swe.harness"],
                        }
                    ]
                }
            }
        },
    }
    (tmp_path / "job.yaml").write_text(json.dumps(job) + "\n")
    selector = "app.kubernetes.io/managed-by=agl"
    with NodeSimulator(cluster.api_client, namespace, selector, log_dir=tmp_path / "pods") as node:
        run = tmp_path / "run"
        history = _train(
            tasks,
            run,
            "controller=swe_k8s",
            f"controller.kubeconfig={cluster.kubeconfig}",
            f"controller.namespace={namespace}",
            f"controller.template={tmp_path / 'job.yaml'}",
            f"controller.grading.command=[{sys.executable},-m,agl.grading]",
            "controller.relist_s=5",
            steps=1,
        )
    (step,) = [row for row in history if "reward/mean" in row]
    assert step["rollouts/finished"] == 4 and step["rollouts/failed"] == 0
    assert step["train/tokens_trained"] > 0
    grades, calls = _grades_and_calls(run)
    assert len(grades) >= 4  # each attempt graded, in its Job
    _tests_ran(grades)
    assert calls >= 4
    assert len(node.started) == len(set(node.started)) >= 5  # 4 rollouts and validation


def test_the_gpu_recipe_composes_into_configs_agl_accepts() -> None:
    """conf/swe_gpu.yaml (not run here): Qwen by model=hf on vLLM and verl, the agents as
    Jobs with their grader, the paper's rollout-level advantage and loss; every group's
    options are ones its config takes."""
    from omegaconf import OmegaConf

    from agl.backends.execution.k8s.config import K8sExecutorConfig
    from agl.core.run.build import backend_config
    from agl.core.run.tasks import TaskConfig
    from agl.core.trainer.loop import TrainerConfig

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(
            config_name="swe_gpu",
            overrides=[
                "model.path=/models/Qwen3.5-9B",
                "task.train_files=/data/swe/3-split/train.jsonl",
                "task.options.mirror=/data/swe/mirror",
            ],
        )
    assert not OmegaConf.missing_keys(cfg)
    options: Any = OmegaConf.to_container(cfg, resolve=True)
    chosen = [options[g]["name"] for g in ("model", "inference", "backend", "controller")]
    assert chosen == ["hf", "vllm", "verl", "k8s"]
    assert (options["advantage"]["name"], options["loss"]["name"]) == ("rollout", "rollout_mean")
    trainer = TrainerConfig(**options["trainer"])
    backend = backend_config(options["backend"], trainer.steps)
    assert backend.ranks == 8 and backend.param_dtype == "bf16"
    task = TaskConfig(**options["task"])
    controller = {
        k: v
        for k, v in options["controller"].items()
        if k not in ("name", "poll_s", "reconcile_s", "agent_gateway_url")
    }
    k8s = K8sExecutorConfig(agent_gateway_url="http://gw:8000", grader=task.grader, **controller)
    assert k8s.grader == "experiments.swe.grader:grade" and k8s.template == "conf/swe/job.yaml"
