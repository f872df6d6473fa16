"""The Kubernetes executor's pure parts: names, labels, the template, the Job the
controller owns, the NetworkPolicy, reading outcomes, the creation rate limit."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from agl.backends.execution.k8s.config import EgressConfig, GradingConfig, K8sExecutorConfig
from agl.backends.execution.k8s.job_state import job_outcome
from agl.backends.execution.k8s.manifests import (
    KEY_ENV,
    REPORT_ENV,
    egress_policy,
    job_manifest,
    load_template,
    own_job,
    render_job,
)
from agl.backends.execution.k8s.naming import job_name, rollout_label
from agl.backends.execution.k8s.pacing import TokenBucket
from agl.core.contracts.execution import Launch

DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
LABEL_VALUE = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
ROLLOUT_IDS = st.text(
    st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=300
)
TEMPLATE = """\
kind: Job
metadata:
  labels: {team: rl}
spec:
  backoffLimit: 6
  template:
    spec:
      restartPolicy: OnFailure
      containers:
        - name: agent
          image: agl:test
          command: [python, -c, "print({{ input.n | tojson }})"]
          env:
            - {name: OPENAI_API_KEY, value: leaked}
            - {name: KEEP, value: "1"}
"""


@given(ROLLOUT_IDS, st.integers(1, 100))
def test_job_names_are_dns_labels_unique_per_attempt(rollout_id: str, attempt: int) -> None:
    name = job_name("agl", rollout_id, attempt)
    assert len(name) <= 63 and DNS_LABEL.fullmatch(name)
    assert name == job_name("agl", rollout_id, attempt)
    assert name != job_name("agl", rollout_id, attempt + 1)
    assert name != job_name("agl", rollout_id + "x", attempt)
    assert name != job_name("other", rollout_id, attempt)


@given(ROLLOUT_IDS)
def test_rollout_labels_are_valid_label_values(rollout_id: str) -> None:
    label = rollout_label(rollout_id)
    assert len(label) <= 63 and LABEL_VALUE.fullmatch(label)


def test_a_valid_rollout_id_is_its_own_label() -> None:
    assert rollout_label("s3-g12-r4") == "s3-g12-r4"


def render(**variables: object) -> dict:
    return render_job(TEMPLATE, {"input": {"n": 7}, **variables})


def test_the_template_renders_with_the_input() -> None:
    job = render()
    assert job["apiVersion"] == "batch/v1"
    assert job["spec"]["template"]["spec"]["containers"][0]["command"][-1] == "print(7)"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("kind: Job\nspec: {{ oops }}\n", "'oops' is undefined"),
        ("kind: Pod\nspec: {}\n", "kind is 'Pod'"),
        ("kind: Job\nspec: {template: {spec: {containers: []}}}\n", "containers is empty"),
        ("- a\n- b\n", "does not render to a mapping"),
        ("kind: Job\nspec: [\n", "Job template:"),
    ],
)
def test_a_bad_template_is_one_clear_line(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as caught:
        render_job(text, {})
    assert "\n" not in str(caught.value)


def test_the_controller_owns_its_fields_over_the_template() -> None:
    env = {"OPENAI_API_KEY": "sk-attempt", "OPENAI_BASE_URL": "http://gw/x", "KEEP": "2"}
    job = own_job(
        render(),
        name="agl-r-1",
        namespace="ns",
        labels={"app.kubernetes.io/managed-by": "agl"},
        annotations={"agl.dev/rollout-id": "r"},
        env=env,
        active_deadline_s=30,
        ttl_after_finished_s=600,
    )
    assert (job["metadata"]["name"], job["metadata"]["namespace"]) == ("agl-r-1", "ns")
    assert job["metadata"]["labels"] == {"team": "rl", "app.kubernetes.io/managed-by": "agl"}
    spec = job["spec"]
    assert (spec["backoffLimit"], spec["activeDeadlineSeconds"]) == (0, 30)
    pod = spec["template"]
    assert pod["metadata"]["labels"]["agl.dev/role"] == "agent"
    assert pod["spec"]["restartPolicy"] == "Never"
    assert pod["spec"]["automountServiceAccountToken"] is False
    (container,) = pod["spec"]["containers"]
    by_name = {e["name"]: e for e in container["env"]}
    assert by_name[KEY_ENV] == {
        "name": KEY_ENV,
        "valueFrom": {"secretKeyRef": {"name": "agl-r-1", "key": "api-key"}},
    }
    assert by_name[REPORT_ENV] == {
        "name": REPORT_ENV,
        "valueFrom": {"secretKeyRef": {"name": "agl-r-1", "key": "report-key"}},
    }
    assert by_name["KEEP"]["value"] == "2"  # ours wins over the template's
    assert by_name["OPENAI_BASE_URL"]["value"] == "http://gw/x"
    assert "sk-attempt" not in str(job) and "leaked" not in str(job)
    assert len(container["env"]) == len(by_name)


def _graded(template: str = TEMPLATE, **grading: object) -> dict:
    env = {"OPENAI_API_KEY": "sk-attempt", "AGL_INPUT": '{"n": 7}', "AGL_ROLLOUT_ID": "r"}
    return job_manifest(
        template,
        "agl-r-1",
        Launch("r", 1, 30.0, env, report_key="rk-attempt"),
        namespace="ns",
        labels={},
        default_deadline_s=3600,
        ttl_after_finished_s=600,
        grader="tests.grading:grade",
        grading=GradingConfig(**grading),  # type: ignore[arg-type]
    )


def _secrets(container: dict) -> set[str]:
    return {e["name"] for e in container["env"] if "valueFrom" in e}


def test_a_graded_job_runs_the_harness_then_the_grader_each_with_its_key_alone() -> None:
    job = _graded()
    pod = job["spec"]["template"]["spec"]
    (harness,) = pod["initContainers"]
    (grader,) = pod["containers"]
    # The harness holds the model key, the grader the report key; neither holds both.
    assert _secrets(harness) == {KEY_ENV} and _secrets(grader) == {REPORT_ENV}
    harness_env = {e["name"]: e.get("value") for e in harness["env"]}
    grader_env = {e["name"]: e.get("value") for e in grader["env"]}
    assert harness_env["AGL_GRADED"] == "1" and harness_env["AGL_WORKSPACE"] == "/agl/workspace"
    assert grader_env["AGL_WORKSPACE"] == "/agl/workspace" and "AGL_GRADED" not in grader_env
    assert grader_env["AGL_GRADE_TIMEOUT_S"] == "30" and grader_env["KEEP"] == "1"
    assert harness["command"][-1] == "print(7)"
    assert grader["command"] == ["python", "-m", "agl.grading", "tests.grading:grade"]
    assert grader["image"] == harness["image"] and grader["name"] == "grader"
    # One emptyDir, written by the harness, read-only for the grader.
    assert pod["volumes"] == [{"name": "agl-workspace", "emptyDir": {}}]
    assert harness["volumeMounts"] == [{"name": "agl-workspace", "mountPath": "/agl/workspace"}]
    assert grader["volumeMounts"] == [
        {"name": "agl-workspace", "mountPath": "/agl/workspace", "readOnly": True}
    ]
    # The grader gets the attempt's time anew, after the harness: the Job twice it.
    assert job["spec"]["activeDeadlineSeconds"] == 60
    assert "sk-attempt" not in str(job) and "rk-attempt" not in str(job)


def test_the_grader_keeps_the_harness_mounts_and_gets_its_own() -> None:
    template = TEMPLATE.replace(
        "          env:\n",
        "          volumeMounts: [{name: data, mountPath: /data}]\n"
        "          securityContext: {runAsUser: 1000}\n"
        "          env:\n",
    )
    tests = {"name": "tests", "mountPath": "/tests", "readOnly": True}
    job = _graded(template, image="grader:1", mounts=[tests], workspace="/w")
    pod = job["spec"]["template"]["spec"]
    (harness,), (grader,) = pod["initContainers"], pod["containers"]
    assert [m["name"] for m in harness["volumeMounts"]] == ["data", "agl-workspace"]
    assert [m["name"] for m in grader["volumeMounts"]] == ["data", "agl-workspace", "tests"]
    assert grader["securityContext"] == {"runAsUser": 1000} and grader["image"] == "grader:1"
    assert harness["image"] == "agl:test"


def test_a_graded_template_with_two_containers_is_refused() -> None:
    two = TEMPLATE + "        - {name: sidecar, image: s, command: [sleep, '1']}\n"
    with pytest.raises(ValueError, match="one container, its harness"):
        _graded(two)


def test_templates_come_from_a_file_inline_text_or_a_mapping(tmp_path: Path) -> None:
    (tmp_path / "job.yaml").write_text(TEMPLATE)
    assert load_template("job.yaml", tmp_path) == TEMPLATE
    assert load_template(TEMPLATE) == TEMPLATE
    assert render_job(load_template({"kind": "Job", "spec": render()["spec"]}), {})["kind"] == "Job"
    with pytest.raises(ValueError, match="No such file"):
        load_template("missing.yaml", tmp_path)


def test_the_egress_policy_allows_the_gateway_dns_and_the_allow_list_only() -> None:
    egress = EgressConfig(allow=["10.1.0.0/16"])
    policy = egress_policy("p", "ns", {"agl.dev/role": "agent"}, egress, "http://agl-gateway:8000")
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Egress"]
    gateway, dns, extra = spec["egress"]
    assert gateway == {
        "to": [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "agl-gateway"}}}],
        "ports": [{"protocol": "TCP", "port": 8000}],
    }
    assert {p["port"] for p in dns["ports"]} == {53}
    assert extra == {"to": [{"ipBlock": {"cidr": "10.1.0.0/16"}}]}
    ip = egress_policy("p", "ns", {}, EgressConfig(dns=False), "https://10.0.0.9")
    assert ip["spec"]["egress"][0]["to"][0] == {"ipBlock": {"cidr": "10.0.0.9/32"}}
    assert ip["spec"]["egress"][0]["ports"] == [{"protocol": "TCP", "port": 443}]
    with pytest.raises(ValueError, match="not a CIDR"):
        egress_policy("p", "ns", {}, EgressConfig(allow=["nope"]), "")


def test_outcomes_are_read_from_the_conditions() -> None:
    assert job_outcome({}) == (False, None)
    complete = {"status": {"conditions": [{"type": "Complete", "status": "True"}]}}
    assert job_outcome(complete) == (True, None)
    failed = {
        "status": {
            "conditions": [
                {"type": "FailureTarget", "status": "True"},
                {"type": "Failed", "status": "True", "reason": "DeadlineExceeded", "message": "m"},
            ]
        }
    }
    assert job_outcome(failed) == (True, "Job failed (DeadlineExceeded): m")
    pending = {"status": {"conditions": [{"type": "Failed", "status": "False"}]}}
    assert job_outcome(pending) == (False, None)


def test_the_config_checks_its_values() -> None:
    with pytest.raises(ValueError, match="instance"):
        K8sExecutorConfig(template="x", instance="Not_OK")
    with pytest.raises(ValueError, match="positive"):
        K8sExecutorConfig(template="x", create_qps=0)
    config = K8sExecutorConfig(template="x", egress={"allow": ["1.2.3.0/24"]})
    assert config.egress.allow == ["1.2.3.0/24"]


def test_the_token_bucket_spaces_creations_at_its_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [0.0]
    bucket = TokenBucket(rate=10.0, burst=2, clock=lambda: now[0])
    slept: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    async def main() -> None:
        monkeypatch.setattr(asyncio, "sleep", fake_sleep)
        for _ in range(5):
            await bucket.take()

    asyncio.run(main())
    assert slept == pytest.approx([0.1, 0.1, 0.1])  # 2 at once, then one per 1/rate


def test_the_coding_agents_job_runs_its_grader_with_the_harness_privileges() -> None:
    """conf/swe/job.yaml under conf/controller/swe_k8s.yaml: the grader runs the tests in
    the same sandbox as the agent's commands, so it needs the same securityContext."""
    repo = Path(__file__).resolve().parents[3]
    grading = yaml.safe_load((repo / "conf" / "controller" / "swe_k8s.yaml").read_text())
    template = load_template("conf/swe/job.yaml", repo)
    job = _graded(template, **grading["grading"])
    pod = job["spec"]["template"]["spec"]
    (harness,), (grader,) = pod["initContainers"], pod["containers"]
    assert harness["command"] == ["python", "-m", "experiments.swe.harness"]
    assert grader["securityContext"] == harness["securityContext"]
    assert "SYS_ADMIN" in grader["securityContext"]["capabilities"]["add"]
    assert pod["enableServiceLinks"] is False
