"""Where and with what an agent's pod runs: its image (the configured one, or a task's
own, named in the rollout's input), its containers' resources, and its node selector,
tolerations and image pull secrets; checked as made (ValueError, one line), set over the
rendered template's values by :meth:`PodSettings.apply`.

Invariants: settings left empty change nothing of the template; a task's image replaces
only the first container's (the agent's; a graded task's harness, whose copy the grader
is, so the grader runs in the same image unless ``grading.image`` says otherwise)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# The API's formats (k8s.io/apimachinery: resource.Quantity, validation.IsQualifiedName,
# IsValidLabelValue, IsDNS1123Subdomain): checked here so that a bad value is one line at
# start, not a refused Job per attempt.
_QUANTITY = re.compile(r"(\d+(\.\d*)?|\.\d+)([KMGTPE]i|[numkMGTPE]|[eE][+-]?\d+)?")
_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_QUALIFIED = re.compile(rf"([a-z0-9.-]{{1,253}}/)?{_NAME}")
_LABEL_VALUE = re.compile(rf"({_NAME})?")
_IMAGE = re.compile(r"\S+")
_EFFECTS = ("", "NoSchedule", "PreferNoSchedule", "NoExecute")
_TOLERATION_KEYS = {"key", "operator", "value", "effect", "tolerationSeconds"}


def _subdomain(value: object) -> bool:
    return isinstance(value, str) and len(value) <= 253 and bool(_SUBDOMAIN.fullmatch(value))


def _qualified(value: object) -> bool:
    if not isinstance(value, str) or not _QUALIFIED.fullmatch(value):
        return False
    prefix, _, _ = value.rpartition("/")
    return not prefix or _subdomain(prefix)


def _image(value: object, what: str) -> str:
    if not isinstance(value, str) or not _IMAGE.fullmatch(value):
        raise ValueError(f"{what}: {value!r} is not an image name")
    return value


def _resources(value: Mapping[str, Any]) -> dict[str, dict[str, str]]:
    if not isinstance(value, Mapping):
        raise ValueError(f"resources: {value!r} is not a mapping of requests and limits")
    out: dict[str, dict[str, str]] = {}
    for section, amounts in value.items():
        if section not in ("requests", "limits") or not isinstance(amounts, Mapping):
            raise ValueError(f"resources.{section}: only requests and limits, each a mapping")
        checked = out[section] = {}
        for name, amount in amounts.items():
            # A number from YAML (cpu: 2) is the quantity it spells.
            text = str(amount) if isinstance(amount, int | float | str) else ""
            if isinstance(amount, bool) or not _QUANTITY.fullmatch(text):
                raise ValueError(f"resources.{section}.{name}: {amount!r} is not a quantity")
            if not _qualified(name):
                raise ValueError(f"resources.{section}: {name!r} is not a resource name")
            checked[str(name)] = text
    return out


def _node_selector(value: Mapping[str, Any]) -> dict[str, str]:
    if not isinstance(value, Mapping):
        raise ValueError(f"node_selector: {value!r} is not a mapping of labels")
    for key, label in value.items():
        if not _qualified(key):
            raise ValueError(f"node_selector: {key!r} is not a label key")
        if not isinstance(label, str) or not _LABEL_VALUE.fullmatch(label):
            raise ValueError(f"node_selector.{key}: {label!r} is not a label value")
    return dict(value)


def _toleration(value: object) -> dict[str, Any]:
    if not isinstance(value, Mapping) or not set(value) <= _TOLERATION_KEYS:
        keys = ", ".join(sorted(_TOLERATION_KEYS))
        raise ValueError(f"tolerations: {value!r} is not a toleration (keys: {keys})")
    item = dict(value)
    operator = item.get("operator", "Equal")
    if operator not in ("Equal", "Exists"):
        raise ValueError(f"tolerations: operator {operator!r} is Equal or Exists")
    if item.get("effect", "") not in _EFFECTS:
        raise ValueError(f"tolerations: effect {item['effect']!r} is one of {_EFFECTS[1:]}")
    if operator == "Exists" and item.get("value"):
        raise ValueError(f"tolerations: {item!r}: operator Exists takes no value")
    if not item.get("key") and operator != "Exists":
        raise ValueError(f"tolerations: {item!r}: without a key, the operator is Exists")
    if item.get("key") and not _qualified(item["key"]):
        raise ValueError(f"tolerations: {item['key']!r} is not a taint key")
    seconds = item.get("tolerationSeconds")
    whole = isinstance(seconds, int) and not isinstance(seconds, bool)
    if seconds is not None and (not whole or item.get("effect") != "NoExecute"):
        raise ValueError(f"tolerations: {item!r}: tolerationSeconds is whole, with NoExecute")
    return item


@dataclass(frozen=True)
class PodSettings:
    """The controller's say over an agent pod besides the template (``K8sExecutorConfig``)."""

    image: str | None = None  # the agent's image; None: the template's
    image_field: str | None = None  # the rollout input's key naming a task's own image
    resources: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: Sequence[Mapping[str, Any]] = ()  # kept as a tuple
    image_pull_secrets: Sequence[str] = ()  # kept as a tuple

    def __post_init__(self) -> None:
        if self.image is not None:
            _image(self.image, "image")
        if self.image_field is not None and not (
            isinstance(self.image_field, str) and self.image_field
        ):
            raise ValueError(f"image_field: {self.image_field!r} is not an input key")
        object.__setattr__(self, "resources", _resources(self.resources))
        object.__setattr__(self, "node_selector", _node_selector(self.node_selector))
        if isinstance(self.tolerations, str | Mapping):
            raise ValueError("tolerations: a list of tolerations")
        object.__setattr__(self, "tolerations", tuple(_toleration(t) for t in self.tolerations))
        if isinstance(self.image_pull_secrets, str | Mapping):
            raise ValueError("image_pull_secrets: a list of Secret names")
        for name in self.image_pull_secrets:
            if not _subdomain(name):
                raise ValueError(f"image_pull_secrets: {name!r} is not a Secret's name")
        object.__setattr__(self, "image_pull_secrets", tuple(self.image_pull_secrets))

    def image_for(self, input_value: Any) -> str | None:
        """The image of an attempt with this input: the task's own where ``image_field``
        names a non-empty value in it, else ``image`` (None: the template's)."""
        if self.image_field and isinstance(input_value, Mapping):
            own = input_value.get(self.image_field)
            if own not in (None, ""):
                return _image(own, f"the input's {self.image_field}")
        return self.image

    def apply(self, pod_spec: dict[str, Any], input_value: Any) -> None:
        """These settings over the rendered template's pod spec, in place (before the
        executor adds a grader: its container is a copy of the first)."""
        containers = [c for c in pod_spec["containers"] if isinstance(c, dict)]
        image = self.image_for(input_value)
        if image is not None and containers:
            containers[0]["image"] = image
        for container in containers if self.resources else ():
            resources = container.get("resources")
            if not isinstance(resources, dict):
                resources = container["resources"] = {}
            for section, amounts in self.resources.items():
                current = resources.get(section)
                resources[section] = {**(current if isinstance(current, dict) else {}), **amounts}
        if self.node_selector:
            selector = pod_spec.get("nodeSelector") or {}
            pod_spec["nodeSelector"] = {**selector, **self.node_selector}
        if self.tolerations:
            current = list(pod_spec.get("tolerations") or [])
            pod_spec["tolerations"] = current + [
                dict(t) for t in self.tolerations if dict(t) not in current
            ]
        if self.image_pull_secrets:
            current = list(pod_spec.get("imagePullSecrets") or [])
            names = {s.get("name") for s in current if isinstance(s, dict)}
            pod_spec["imagePullSecrets"] = current + [
                {"name": n} for n in self.image_pull_secrets if n not in names
            ]
