"""The paper's static filters over SWE-smith instances (Section 4.3.1), pure functions.

Of the 59,136 published records the paper found 18,033 with an empty problem statement,
1,265 whose problem branch is missing from the image, and some whose tests take
thousands of runs (python-jsonschema: over 7,000); it removes all three kinds. Each
filter here is ``Instance -> reason | None``; ``apply`` keeps an instance only when no
filter names a reason, and says for each one removed which filter removed it (the first
that did: the report counts every instance once).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from experiments.swe.instances import Instance

Filter = Callable[[Instance], "str | None"]

EMPTY_STATEMENT = "empty problem statement"
MISSING_BRANCH = "problem branch missing"
TOO_MANY_TESTS = "too many tests"


def empty_statement(instance: Instance) -> str | None:
    """An instance whose problem statement is empty or whitespace: the agent would be
    asked to fix a bug no one described."""
    return None if instance.problem_statement.strip() else EMPTY_STATEMENT


def missing_branch(branches: Mapping[str, Iterable[str]]) -> Filter:
    """An instance whose branch its repository (or image) lacks: the agent's checkout
    would fail. ``branches`` maps a repository to the branches it holds; a repository
    it does not name holds none."""
    held = {repo: frozenset(names) for repo, names in branches.items()}

    def check(instance: Instance) -> str | None:
        if instance.branch in held.get(instance.repo, frozenset()):
            return None
        return f"{MISSING_BRANCH}: {instance.branch!r} not in {instance.repo!r}"

    return check


def too_many_tests(limit: int = 200) -> Filter:
    """An instance whose reward runs more than ``limit`` tests (FAIL_TO_PASS and
    PASS_TO_PASS together): its reward costs more than its rollout."""
    if limit < 1:
        raise ValueError("the test limit is at least 1")

    def check(instance: Instance) -> str | None:
        count = len(set(instance.tests))
        return f"{TOO_MANY_TESTS}: {count} > {limit}" if count > limit else None

    return check


@dataclass(frozen=True)
class Removed:
    instance_id: str
    reason: str

    @property
    def kind(self) -> str:
        """The reason without its details (the report's count key)."""
        return self.reason.split(":", 1)[0]


def apply(
    instances: Sequence[Instance], filters: Sequence[Filter]
) -> tuple[list[Instance], list[Removed]]:
    """The instances every filter keeps, in order, and the others with the first
    filter's reason."""
    kept: list[Instance] = []
    removed: list[Removed] = []
    for instance in instances:
        reason = next((r for f in filters if (r := f(instance)) is not None), None)
        if reason is None:
            kept.append(instance)
        else:
            removed.append(Removed(instance.instance_id, reason))
    return kept, removed
