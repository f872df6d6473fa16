"""Where agl's checkout lies: its root (the folder of ``experiments/``, which an agent's
``PYTHONPATH`` gets) and the Hydra configs under it (``conf/``). At the bottom, since the
run's composition root, ``agl.train`` and the experiments that read their own configs
(``conf/swe/``) all find them the same way."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
