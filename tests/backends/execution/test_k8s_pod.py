"""The controller's say over an agent's pod (``controller.image``, ``image_field``,
``resources``, ``node_selector``, ``tolerations``, ``image_pull_secrets``): each rendered
into the Job's pod spec, a bad value refused in one line; and the egress policy's reach
into the gateway's namespace when agents run in another."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import orjson
import pytest
import yaml
from kubernetes import client as k8s

from agl.backends.execution.k8s.config import EgressConfig, GradingConfig, K8sExecutorConfig
from agl.backends.execution.k8s.executor import K8sExecutor
from agl.backends.execution.k8s.manifests import egress_policy, job_manifest, load_template
from agl.backends.execution.k8s.naming import job_name
from agl.core.contracts.execution import Launch
from agl.testing.k8s.api_server import ApiServer

REPO = Path(__file__).resolve().parents[3]
TEMPLATE = """\
kind: Job
spec:
  template:
    spec:
      nodeSelector: {pool: cpu}
      tolerations: [{key: spot, operator: Exists, effect: NoSchedule}]
      containers:
        - name: agent
          image: agl:template
          command: [python, -m, agl.agent, "x:run"]
          resources:
            requests: {cpu: 100m, memory: 256Mi}
            limits: {cpu: "1", memory: 1Gi}
"""
SETTINGS: dict[str, Any] = {
    "image": "registry.example/agl:2",
    "image_field": "image_name",
    "resources": {"requests": {"cpu": 2}, "limits": {"memory": "8Gi", "nvidia.com/gpu": "1"}},
    "node_selector": {"kubernetes.io/arch": "amd64", "pool": "agents"},
    "tolerations": [
        {"key": "dedicated", "operator": "Equal", "value": "agl", "effect": "NoSchedule"}
    ],
    "image_pull_secrets": ["registry-key"],
}


def _job(config: K8sExecutorConfig, input_value: Any, template: str = TEMPLATE) -> dict[str, Any]:
    env = {"OPENAI_API_KEY": "sk", "AGL_INPUT": orjson.dumps(input_value).decode()}
    return job_manifest(
        template,
        "agl-r-1",
        Launch("r", 1, 30.0, env, report_key="rk"),
        namespace="agl-agents",
        labels={},
        default_deadline_s=3600,
        ttl_after_finished_s=600,
        grader=config.grader,
        grading=config.grading,
        pod=config.pod,
    )


def _pod(job: dict[str, Any]) -> dict[str, Any]:
    pod: dict[str, Any] = job["spec"]["template"]["spec"]
    return pod


def test_the_settings_are_rendered_into_the_pod_spec() -> None:
    config = K8sExecutorConfig(template=TEMPLATE, **SETTINGS)
    pod = _pod(_job(config, {"instance_id": "a", "image_name": "swesmith/task-a:1"}))
    (agent,) = pod["containers"]
    assert agent["image"] == "swesmith/task-a:1"  # the task's own
    assert agent["resources"] == {  # merged per key, numbers as quantities
        "requests": {"cpu": "2", "memory": "256Mi"},
        "limits": {"cpu": "1", "memory": "8Gi", "nvidia.com/gpu": "1"},
    }
    assert pod["nodeSelector"] == {"pool": "agents", "kubernetes.io/arch": "amd64"}
    assert pod["tolerations"] == [
        {"key": "spot", "operator": "Exists", "effect": "NoSchedule"},
        *SETTINGS["tolerations"],
    ]
    assert pod["imagePullSecrets"] == [{"name": "registry-key"}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    unavailable = ApiServer.available()
    if unavailable is not None:
        pytest.skip(unavailable)
    with ApiServer(tmp_path_factory.mktemp("k8s")) as server:
        yield server


def test_the_api_server_keeps_every_setting_of_a_launched_job(cluster: ApiServer) -> None:
    """The executor's Job on the real API server: a field it did not know would be
    dropped (and refused outright under strict field validation)."""
    namespace = f"t-{uuid.uuid4().hex[:8]}"
    config = K8sExecutorConfig(
        template=TEMPLATE,
        namespace=namespace,
        kubeconfig=str(cluster.kubeconfig),
        agent_gateway_url="http://agl-gateway.agl.svc:8000",
        **SETTINGS,
    )
    env = {"OPENAI_API_KEY": "sk", "AGL_INPUT": orjson.dumps({"image_name": "t/a:1"}).decode()}

    async def launch() -> None:
        executor = K8sExecutor(config)
        await executor.start()
        try:
            await executor.launch(Launch("r", 1, 30.0, env, report_key="rk"))
        finally:
            await executor.close()

    asyncio.run(launch())
    with cluster.api_client() as api:
        batch = k8s.BatchV1Api(api)
        name = job_name("agl", "r", 1)
        response = batch.read_namespaced_job(name, namespace, _preload_content=False)
        stored = orjson.loads(response.data)
        pod = stored["spec"]["template"]["spec"]
        assert pod["containers"][0]["image"] == "t/a:1"
        assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert pod["nodeSelector"]["kubernetes.io/arch"] == "amd64"
        assert pod["tolerations"][-1] == SETTINGS["tolerations"][0]
        assert pod["imagePullSecrets"] == [{"name": "registry-key"}]
        body = _job(config, {"image_name": "t/a:1"})
        body["metadata"].update(name="strict", namespace=namespace)
        batch.create_namespaced_job(namespace, body, field_validation="Strict")


@pytest.mark.parametrize(
    ("input_value", "image"),
    [
        ({"image_name": ""}, "registry.example/agl:2"),  # empty: the configured image
        ({"instance_id": "a"}, "registry.example/agl:2"),  # missing: the same
        ("not a mapping", "registry.example/agl:2"),
        (None, "registry.example/agl:2"),
    ],
)
def test_a_task_without_an_image_gets_the_configured_one(input_value: Any, image: str) -> None:
    config = K8sExecutorConfig(template=TEMPLATE, **SETTINGS)
    assert _pod(_job(config, input_value))["containers"][0]["image"] == image


def test_empty_settings_leave_the_template_as_it_is() -> None:
    plain = _job(K8sExecutorConfig(template=TEMPLATE), {"image_name": "ignored"})
    rendered = yaml.safe_load(TEMPLATE)["spec"]["template"]["spec"]
    pod = _pod(plain)
    assert pod["containers"][0]["image"] == "agl:template"  # no image_field: not read
    assert pod["containers"][0]["resources"] == rendered["containers"][0]["resources"]
    assert pod["nodeSelector"] == rendered["nodeSelector"]
    assert pod["tolerations"] == rendered["tolerations"]
    assert "imagePullSecrets" not in pod


def test_a_graded_tasks_grader_runs_in_the_tasks_image_with_the_same_resources() -> None:
    """SWE-smith: each task's image holds its repository and tests; the grader, a copy of
    the harness's container, runs the tests in it."""
    grading = yaml.safe_load((REPO / "conf/controller/swe_k8s.yaml").read_text())["grading"]
    config = K8sExecutorConfig(
        template=load_template("conf/swe/job.yaml", REPO),
        grader="experiments.swe.grader:grade",
        grading=GradingConfig(**grading),
        **SETTINGS,
    )
    pod = _pod(_job(config, {"instance_id": "a", "image_name": "swesmith/a:1"}, config.template))
    (harness,), (grader,) = pod["initContainers"], pod["containers"]
    assert harness["image"] == grader["image"] == "swesmith/a:1"
    assert grader["resources"] == harness["resources"]
    assert harness["resources"]["limits"]["memory"] == "8Gi"
    with_image = K8sExecutorConfig(
        template=config.template,
        grader=config.grader,
        grading=GradingConfig(**{**grading, "image": "agl-grader:1"}),
        **SETTINGS,
    )
    pod = _pod(_job(with_image, {"image_name": "swesmith/a:1"}, config.template))
    assert pod["initContainers"][0]["image"] == "swesmith/a:1"
    assert pod["containers"][0]["image"] == "agl-grader:1"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"image": "has space"}, "image: 'has space' is not an image name"),
        ({"image_field": ""}, "image_field: '' is not an input key"),
        ({"resources": {"limit": {"cpu": "1"}}}, "resources.limit: only requests and limits"),
        ({"resources": {"limits": {"cpu": "lots"}}}, "resources.limits.cpu: 'lots' is not a"),
        ({"resources": {"limits": {"cpu": True}}}, "resources.limits.cpu: True is not a"),
        ({"resources": {"limits": {"bad name!": "1"}}}, "'bad name!' is not a resource name"),
        ({"resources": ["cpu"]}, "resources: ['cpu'] is not a mapping"),
        ({"node_selector": {"-bad": "x"}}, "node_selector: '-bad' is not a label key"),
        ({"node_selector": {"pool": "a b"}}, "node_selector.pool: 'a b' is not a label value"),
        ({"node_selector": {"pool": 3}}, "node_selector.pool: 3 is not a label value"),
        ({"tolerations": {"key": "a"}}, "tolerations: a list"),
        ({"tolerations": [{"key": "a", "operator": "In"}]}, "operator 'In' is Equal or Exists"),
        ({"tolerations": [{"key": "a", "effect": "Never"}]}, "effect 'Never' is one of"),
        ({"tolerations": [{"value": "x"}]}, "without a key, the operator is Exists"),
        ({"tolerations": [{"key": "a", "operator": "Exists", "value": "x"}]}, "takes no value"),
        ({"tolerations": [{"key": "a", "tolerationSeconds": 5}]}, "with NoExecute"),
        ({"tolerations": [{"key": "a", "colour": "red"}]}, "is not a toleration (keys:"),
        ({"image_pull_secrets": "key"}, "image_pull_secrets: a list of Secret names"),
        ({"image_pull_secrets": ["Not_A_Name"]}, "'Not_A_Name' is not a Secret's name"),
    ],
)
def test_a_bad_setting_is_one_clear_line(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as caught:
        K8sExecutorConfig(template=TEMPLATE, **change)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_a_bad_image_in_a_task_fails_its_attempt_in_one_line() -> None:
    config = K8sExecutorConfig(template=TEMPLATE, image_field="image_name")
    with pytest.raises(ValueError, match=r"^the input's image_name: \['a'\] is not an image name$"):
        _job(config, {"image_name": ["a"]})


def test_the_settings_come_from_the_command_line_and_a_records_image_reaches_its_job(
    tmp_path: Path,
) -> None:
    """``agl.train``'s way: Hydra's overrides of conf/controller/swe_k8s.yaml, the task's
    columns taking a SWE-smith record's ``image_name`` into the rollout's input, and the
    executor the run builds."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from agl.core.datasets import map_columns
    from agl.core.run.build import executor_for

    overrides = [
        "controller=swe_k8s",
        "task.train_files=x.jsonl",
        "task.options.mirror=/data/swe/mirror",
        "+task.columns.image_name=image_name",
        "controller.image_field=image_name",
        "controller.node_selector={pool: agents}",
        "controller.resources={limits: {memory: 8Gi}}",
        "controller.tolerations=[{key: dedicated, operator: Exists, effect: NoSchedule}]",
        "controller.image_pull_secrets=[registry-key]",
    ]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="swe", overrides=overrides)
    options = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True))
    executor = executor_for(
        options["controller"],
        cfg.task.harness,
        tmp_path,
        "http://agl-gateway.agl.svc:8000",
        cfg.task.grader,
    )
    asyncio.run(executor.close())
    assert isinstance(executor, K8sExecutor)
    config = executor.config
    assert config.namespace == "agl-agents"
    record = {
        "instance_id": "a",
        "repo": "r",
        "problem_statement": "p",
        "FAIL_TO_PASS": ["t"],
        "PASS_TO_PASS": [],
        "image_name": "swesmith/a:1",
        "patch": "never",
    }
    (input_value,) = map_columns([record], options["task"]["columns"], "x.jsonl")
    assert "patch" not in input_value
    pod = _pod(_job(config, input_value, load_template(config.template, REPO)))
    for container in pod["initContainers"] + pod["containers"]:
        assert container["image"] == "swesmith/a:1"
        assert container["resources"]["limits"]["memory"] == "8Gi"
    assert pod["nodeSelector"] == {"pool": "agents"}
    assert pod["tolerations"] == [
        {"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}
    ]
    assert pod["imagePullSecrets"] == [{"name": "registry-key"}]


def test_the_shipped_controller_settings_are_accepted() -> None:
    """conf/controller/k8s.yaml's keys are the config's fields, and its values valid."""
    settings = yaml.safe_load((REPO / "conf/controller/k8s.yaml").read_text())
    settings.pop("name")
    settings.pop("poll_s")
    settings.pop("reconcile_s")
    settings.pop("agent_gateway_url")
    config = K8sExecutorConfig(**settings)
    assert config.pod.image is None and not config.pod.tolerations
    for name in ("swe_k8s", "general_k8s"):
        assert yaml.safe_load((REPO / f"conf/controller/{name}.yaml").read_text())["namespace"] == (
            "agl-agents"
        )


def test_agents_in_their_own_namespace_reach_the_gateway_in_its() -> None:
    def to_gateway(namespace: str, url: str, egress: EgressConfig) -> dict[str, Any]:
        policy = egress_policy("p", namespace, {}, egress, url)
        peer: dict[str, Any] = policy["spec"]["egress"][0]["to"][-1]
        return peer

    gateway = {"matchLabels": {"app.kubernetes.io/name": "agl-gateway"}}
    in_agl = {"matchLabels": {"kubernetes.io/metadata.name": "agl"}}
    for url in ("http://agl-gateway.agl.svc:8000", "http://agl-gateway.agl.svc.cluster.local"):
        peer = to_gateway("agl-agents", url, EgressConfig())
        assert peer == {"podSelector": gateway, "namespaceSelector": in_agl}
    # The same namespace, or a URL naming none: the agents' own namespace.
    assert to_gateway("agl", "http://agl-gateway.agl.svc:8000", EgressConfig()) == {
        "podSelector": gateway
    }
    assert to_gateway("agl-agents", "http://agl-gateway:8000", EgressConfig()) == {
        "podSelector": gateway
    }
    # Said outright, it wins over the URL.
    explicit = EgressConfig(gateway_namespace="serving")
    assert to_gateway("agl-agents", "http://10.0.0.9:8000", explicit) == {
        "podSelector": gateway,
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "serving"}},
    }
