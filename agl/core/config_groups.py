"""A run's resolved config groups (``merge``, ``advantage``, ``model``) → what they name:
the merge strategy, the advantage function, the model, and its tokenizer's text of token
ids. Below both of their users: ``agl.train`` builds a run with these
(``agl.core.run.build`` builds the rest), and the tools that read a finished run
(``agl.core.run_folder``: the viewer, ``python -m agl.rollouts``) rebuild its strategies
with the same functions, so what they explain is what was trained — without importing
the code that builds a run.

Strategies, models and the trainer's types are imported when a function runs: importing
this module loads neither torch nor a strategy.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agl.backends.inference.models import LoadedModel
    from agl.core.contracts.strategies import Advantage
    from agl.core.trainer.assemble import MergeStrategy
    from agl.core.trainer.calls import TokenText


def group_options(group: dict[str, Any]) -> dict[str, Any]:
    """A config group's options: all it says but the ``name`` that chose it."""
    return {k: v for k, v in group.items() if k != "name"}


def make_merge(
    group: dict[str, Any], decode: Callable[[Sequence[int]], str] | None = None
) -> MergeStrategy:
    """The merge strategy of a resolved ``merge`` config group, with its options;
    ``decode`` goes to the strategies that compare texts (stitch)."""
    from agl.core.trainer.assemble import MergeStrategy
    from agl.strategies.registry import get

    return MergeStrategy(get("merge", group["name"]), group_options(group), decode=decode)


def make_advantage(group: dict[str, Any]) -> Advantage:
    """The advantage function of a resolved ``advantage`` config group, its options bound."""
    from agl.strategies.registry import get

    return functools.partial(get("advantage", group["name"]), **group_options(group))


def load_configured_model(group: dict[str, Any]) -> LoadedModel:
    """The model of a resolved ``model`` config group (ValueError, ModelUnavailable)."""
    from agl.backends.inference.models import load_model
    from agl.backends.inference.pretrained import PretrainedOptions
    from agl.backends.inference.server.tools import tool_parser

    pretrained = None
    if group["name"] == "hf":
        keys = {f.name for f in dataclasses.fields(PretrainedOptions)}
        pretrained = PretrainedOptions(**{k: v for k, v in group.items() if k in keys})
    parser = group.get("tool_parser", "hermes")
    tool_parser(parser)  # an unknown name is refused before anything loads
    cache_dir = group.get("cache_dir")
    loaded = load_model(
        group["name"],
        cache_dir=Path(cache_dir) if cache_dir else None,
        seed=group.get("seed", 0),
        pretrained=pretrained,
        served_name=group.get("served_name"),
    )
    loaded.tool_parser = parser
    return loaded


def text_decode(tokenizer: Any) -> TokenText:
    """The text of token ids as merge strategies compare it: special tokens kept; the
    validity check also knows which ids are special."""
    from agl.core.trainer.calls import TokenText

    # What skip_special_tokens skips: every added token marked special, registered as a
    # named special (eos, pad) or not (<tool_call>, <think>, ...).
    added = getattr(tokenizer, "added_tokens_decoder", {})
    special = {i for i, token in added.items() if getattr(token, "special", False)}
    return TokenText(
        lambda ids: tokenizer.decode(list(ids), skip_special_tokens=False),
        frozenset(special | set(tokenizer.all_special_ids)),
    )
