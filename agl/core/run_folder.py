"""What a run folder (``python -m agl.train ... hydra.run.dir=DIR``) tells the tools that
look at its rollouts afterwards (``python -m agl.rollouts``, the gateway's viewer): its
resolved config, its strategy choices, and the merge strategy, advantage function and
tokenizer it trained with — built by the same functions ``agl.train`` uses
(``agl.core.config_groups``), so what they explain is what was trained. It reads a run;
the code that builds one (``agl.core.run``) is the entry points' alone.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from agl.core.config_groups import load_configured_model, make_advantage, make_merge, text_decode
from agl.core.contracts.strategies import Advantage
from agl.core.trainer.assemble import MergeStrategy
from agl.strategies.registry import get

log = logging.getLogger(__name__)

# What ``choices`` names, and where the config says it.
CHOICES = {
    "merge": ("merge", "name"),
    "advantage": ("advantage", "name"),
    "loss": ("loss", "name"),
    "mode": ("trainer", "mode"),
    "model": ("model", "name"),
    "task": ("task", "name"),
}


class RunFolderError(Exception):
    """A folder that is not a readable run folder; the message is one line."""


@dataclass
class RunInfo:
    folder: Path
    config: dict[str, Any]  # the resolved config.yaml
    choices: dict[str, str]  # merge, advantage, loss, mode, model, task: the option names
    # The tokenizer, loaded on first use (from threads: the viewer's pages).
    _tokenizer: Any = field(default=None, init=False, repr=False, compare=False)
    _tokenizer_loaded: bool = field(default=False, init=False, repr=False, compare=False)
    _lock: threading.Lock = field(
        default_factory=threading.Lock, init=False, repr=False, compare=False
    )

    def merge(self) -> MergeStrategy:
        """The run's merge strategy with its options, and the tokenizer's decode where the
        model loads (stitch needs it)."""
        tokenizer = self.tokenizer()
        decode = None if tokenizer is None else text_decode(tokenizer)
        return make_merge(self.config["merge"], decode)

    def advantage(self) -> Advantage:
        return make_advantage(self.config["advantage"])

    def decode_token(self) -> Callable[[int], str] | None:
        """One token id's text, decoded alone (special tokens kept); None without a
        tokenizer."""
        tokenizer = self.tokenizer()
        if tokenizer is None:
            return None
        decode = text_decode(tokenizer)
        return lambda token: decode([token])

    def tokenizer(self) -> Any | None:
        """The run's tokenizer, loaded once; None (and a logged reason) when its model
        cannot be loaded here. ``load_model`` builds the model with it: the tiny one in
        milliseconds, a converted one from its cache folder."""
        with self._lock:
            if not self._tokenizer_loaded:
                self._tokenizer = self._load_tokenizer()
                self._tokenizer_loaded = True
            return self._tokenizer

    def _load_tokenizer(self) -> Any | None:
        from agl.backends.inference.models import ModelUnavailable

        try:
            return load_configured_model(self.config["model"]).tokenizer
        except (ValueError, ModelUnavailable, OSError, ImportError) as error:
            log.warning("run %s: no tokenizer, tokens show as ids: %s", self.folder, error)
            return None


def load_run(folder: str | Path) -> RunInfo:
    """The run in ``folder``; RunFolderError when it has no readable ``config.yaml``."""
    folder = Path(folder)
    path = folder / "config.yaml"
    if not path.is_file():
        raise RunFolderError(f"{folder} is not a run folder: it has no config.yaml")
    try:
        config = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise RunFolderError(f"{path} cannot be read: {first}") from None
    if not isinstance(config, dict):
        raise RunFolderError(f"{path} is not a run's config: not a mapping")
    choices = {}
    for choice, (group, key) in CHOICES.items():
        section = config.get(group)
        if not isinstance(section, dict) or key not in section:
            raise RunFolderError(f"{path} is not a run's config: it has no {group}.{key}")
        choices[choice] = str(section[key])
    for kind in ("merge", "advantage"):
        try:  # a strategy this installation lacks: said now, not at every use
            get(kind, choices[kind])
        except ValueError as error:
            raise RunFolderError(f"{path}: {error}") from None
    return RunInfo(folder=folder, config=config, choices=choices)
