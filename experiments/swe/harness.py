"""The coding task's harness: mini-swe-agent, unmodified, on one SWE task.

A command harness (``conf/task/swe.yaml``: one process per attempt, in the attempt's own
workspace; the reward is the grader's, ``experiments.swe.grader``). It checks the task's
branch out of the mirror into ``<workspace>/repo`` (a copy with no history), then runs
mini-swe-agent as its ``mini`` command does: the config file
(``experiments/swe/mini.yaml``) with the attempt's values merged over it (the proxy's
address and key, the task, the workspace, what the sandbox hides), then its own
``get_model``, ``get_environment`` and ``get_agent``. The agent talks to the model
through the attempt's proxy; each of its commands runs in the coding task's jail
(``experiments.swe.sandbox``) as a uid the attempt holds, where nothing of the machine is
in sight but the system's programs, pytest and the checkout.

The input is the task's record (``instance_id``, ``repo``, ``problem_statement``, the
test lists) with the task's options: ``mirror`` (the pipeline's mirror folder: absolute,
or relative to agl's checkout), ``config`` (mini-swe-agent's config file: ``mini.yaml``,
or ``mini_cpu.yaml`` for the CPU-scale tasks of ``experiments.swe.cpu``), ``step_limit``,
``command_timeout_s``, the sampling (``temperature``, ``top_p``, ``max_tokens``), and two
for the safeguards' control experiment (tests/experiments/swe/test_swe_hacks.py): ``leaky``
leaves the checkout as a git repository whose history holds the unbugged code (as
SWE-smith's images do),
and ``sandbox: false`` runs the commands with mini-swe-agent's own ``LocalEnvironment``
(the whole machine and the harness's environment in reach). The harness prints one JSON
line: the agent's exit status and its model calls; when a command reached one of the
jail's limits, it says which on stderr and exits with ``LIMIT_EXIT``, so the attempt
fails as the agent's doing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from agl.agent import ENV_WORKSPACE, WORKSPACES, AgentContext
from agl.agent.harness import DEFAULT_MODEL
from agl.sandbox.uids import give, lease
from experiments.swe import mirror
from experiments.swe.environment import SANDBOX_LIMIT
from experiments.swe.sandbox import ROOT, check_available, check_project

CONFIGS = ("mini.yaml", "mini_cpu.yaml")  # mini-swe-agent's config files, beside this one
REPO = "repo"  # the checkout's folder in the workspace
TRAJECTORY = "trajectory.json"
LIMIT_EXIT = 3  # the harness's exit code when a command reached one of the jail's limits

# mini-swe-agent unattended and offline: no global config folder of the user's, no cost
# to track, no retry of a failed call (the gateway's answer is the answer); and, for a
# config that names a litellm model, no price list download.
MSWEA_ENV = {
    "MSWEA_SILENT_STARTUP": "1",
    "MSWEA_COST_TRACKING": "ignore_errors",
    "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "1",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
}


def attempt_config(
    agent: AgentContext, row: dict[str, Any], workspace: Path, uid: int | None
) -> dict[str, Any]:
    """What the attempt sets over the config file (``mini -c key=value``)."""
    kwargs: dict[str, Any] = {"api_base": agent.base_url, "api_key": agent.api_key}
    for key in ("temperature", "top_p", "max_tokens"):
        if key in row:
            kwargs[key] = row[key]
    hidden = [str(p) for p in hidden_from_agents(mirror_root(row), workspace)]
    agent_part: dict[str, Any] = {"output_path": str(workspace / TRAJECTORY)}
    if "step_limit" in row:
        agent_part["step_limit"] = int(row["step_limit"])
    environment: dict[str, Any] = {"cwd": str(workspace / REPO), "hidden": hidden, "uid": uid}
    if row.get("sandbox", True) is False:
        environment = {"cwd": str(workspace / REPO), "environment_class": "local"}
    if "command_timeout_s" in row:
        environment["timeout"] = int(row["command_timeout_s"])
    return {
        "agent": agent_part,
        "environment": environment,
        "model": {"model_name": f"openai/{agent.model or DEFAULT_MODEL}", "model_kwargs": kwargs},
    }


def leaky_checkout(root: Path, repo: str, branch: str, dest: Path) -> None:
    """A checkout as a git repository: the base committed, then the bug (its history
    holds the fix: ``git diff HEAD~1``)."""
    mirror.checkout(root, repo, None, dest)
    diff = (mirror.repo_folder(root, repo) / mirror.BRANCHES / (branch + mirror.DIFF)).read_text()
    identity = ["-c", "user.name=swe", "-c", "user.email=swe@localhost"]

    def git(*args: str) -> None:
        subprocess.run(["git", *identity, *args], cwd=dest, check=True, capture_output=True)

    git("init", "-q")
    git("add", "-A")
    git("commit", "-q", "-m", "upstream")
    mirror.apply_diff(dest, diff)
    git("commit", "-q", "-a", "-m", "a change")


def hidden_from_agents(root: Path, workspace: Path) -> list[Path]:
    """What a task's commands are refused (sealed where it would be, so a reach for it
    shows in the audit; none of it is in their jail anyway): the pipeline's folder (the
    mirror's base, the records with their patches), the run's folder (the store, other
    workspaces: the local executor's layout is <run>/workspaces/<attempt>; a Kubernetes
    Job's workspace is a volume of its pod's, with no run folder around it) and agl's
    checkout (data and runs kept there)."""
    workspace = workspace.resolve()
    run = [workspace.parent.parent] if workspace.parent.name == WORKSPACES else []
    return [root.resolve().parent, *run, ROOT]


def mirror_root(row: dict[str, Any]) -> Path:
    """The task's mirror: ``mirror`` as given, or under agl's checkout when relative (a
    warm-up pin then records no path of one machine)."""
    return ROOT / row["mirror"]  # an absolute path stays itself


def config_file(row: dict[str, Any]) -> Path:
    name = row.get("config", CONFIGS[0])
    if name not in CONFIGS:
        raise ValueError(f"task.options.config is one of {list(CONFIGS)}, not {name!r}")
    return Path(__file__).with_name(name)


def run(agent: AgentContext, workspace: Path) -> dict[str, Any]:
    """One attempt: the checkout, then mini-swe-agent to its end."""
    for key, value in MSWEA_ENV.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MSWEA_GLOBAL_CONFIG_DIR", str(workspace / ".mswea"))
    from minisweagent.agents import get_agent
    from minisweagent.config import get_config_from_spec
    from minisweagent.environments import get_environment
    from minisweagent.models import get_model
    from minisweagent.utils.serialize import recursive_merge

    row = dict(agent.input)
    spec = config_file(row)
    root = mirror_root(row)
    sandboxed = row.get("sandbox", True) is not False
    if sandboxed:
        check_available()
        base = mirror.repo_folder(root, row["repo"]) / mirror.BASE
        check_project(mirror.read_project(root, row["repo"]).modules(base))
    checkout = workspace / REPO
    if row.get("leaky"):
        leaky_checkout(root, row["repo"], row["instance_id"], checkout)
    else:
        mirror.checkout(root, row["repo"], row["instance_id"], checkout)
    with lease() as uid:
        if sandboxed:
            give(checkout, uid)  # the jail's user's: it may write there
        extra = attempt_config(agent, row, workspace, uid)
        config = recursive_merge(get_config_from_spec(spec), extra)
        model = get_model(config=config["model"])
        environment = get_environment(config["environment"], default_type="local")
        coder = get_agent(model, environment, config["agent"], default_type="default")
        result = coder.run(row.get("problem_statement") or "")
    return {
        "exit_status": result.get("exit_status"),
        "model_calls": coder.n_calls,
        "reason": result.get("reason"),
    }


def main() -> None:
    agent = AgentContext.from_env(os.environ)
    workspace = Path(os.environ[ENV_WORKSPACE])
    outcome = run(agent, workspace)
    sys.stdout.write(json.dumps(outcome) + "\n")
    if outcome["exit_status"] == SANDBOX_LIMIT:
        sys.stderr.write(f"the attempt ended: {outcome['reason']}\n")
        sys.exit(LIMIT_EXIT)


if __name__ == "__main__":
    main()
