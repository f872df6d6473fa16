"""The trajectory viewer: read-only HTML pages over the gateway's store, at ``/ui``.

``/ui`` lists a run's rollouts (filter, sort, 50 a page), ``/ui/rollouts/{id}`` shows one
(input, status history, every call, rewards, events, how its calls became samples, its
agent's log), ``/ui/groups/{id}`` a group side by side with its advantages. Server-made
HTML and one stylesheet: no script, no build step. The admin token opens it
(``/ui/login``); see :mod:`agl.ui.session`.
"""

from __future__ import annotations

from agl.ui.pages import router
from agl.ui.run import find_run_folder

__all__ = ["find_run_folder", "router"]
