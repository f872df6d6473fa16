"""The run folder behind the gateway's store: its config says how calls were merged and
advantages computed, and its tokenizer spells tokens; agents' logs lie under it."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def find_run_folder(run_dir: str, ui_run: str) -> Path | None:
    """``ui_run`` if given, else the parent of the gateway's ``run_dir`` when it holds a
    run's ``config.yaml`` (``python -m agl.train`` puts the store in ``<run>/gateway``)."""
    if ui_run:
        return Path(ui_run)
    parent = Path(run_dir).resolve().parent
    return parent if (parent / "config.yaml").is_file() else None


class RunFolder:
    """The run, loaded on first use and kept: ``agl.core.run_folder`` builds a tokenizer, which the
    gateway should neither import nor load unless someone opens the viewer."""

    def __init__(self, folder: Path | None) -> None:
        self.folder = folder
        self.problem: str | None = None
        self._info: Any = None
        self._loaded = False
        self._lock = threading.Lock()  # pages load it from worker threads

    def info(self) -> Any:
        """The ``agl.core.run_folder.RunInfo``, or None (no folder, or one that does not load:
        ``problem`` says why)."""
        with self._lock:
            if not self._loaded and self.folder is not None:
                from agl.core.run_folder import RunFolderError, load_run

                try:
                    self._info = load_run(self.folder)
                except RunFolderError as error:
                    self.problem = str(error)
                    log.warning("viewer: run folder %s: %s", self.folder, error)
                self._loaded = True
            return self._info
