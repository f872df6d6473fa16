"""Files and folders only their owner can read: the gateway's ``run_dir`` (0700) and what
it keeps there (0600): the store, which holds the attempt-key signing secret, its SQLite
``-wal``/``-shm``/``-journal`` files, and the admin token.

The modes are set explicitly, not left to the umask: under the usual 022 a new file is
0644, readable by every local user, who could then sign keys for any rollout.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

log = logging.getLogger(__name__)

DIR_MODE = 0o700
FILE_MODE = 0o600

# SQLite makes these beside a database, with the database file's mode.
SQLITE_SIDECARS = ("-wal", "-shm", "-journal")


def private_dir(path: Path) -> None:
    """Make ``path`` a folder of mode 0700, creating it (and missing parents) if needed;
    one that exists with a looser mode is tightened, with a warning."""
    existed = path.is_dir()
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    _set_mode(path, DIR_MODE, warn=existed)


def private_file(path: Path) -> None:
    """Make ``path`` a file of mode 0600, creating it empty if missing; one that exists
    with a looser mode is tightened, with a warning."""
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    except FileExistsError:
        _set_mode(path, FILE_MODE, warn=True)
    else:
        os.fchmod(descriptor, FILE_MODE)  # a umask such as 0277 narrows past 0600
        os.close(descriptor)


def private_sqlite(path: Path) -> None:
    """A SQLite database and the files SQLite keeps beside it, all 0600: the database is
    made 0600 before SQLite opens it, so the files SQLite creates take that mode too."""
    private_file(path)
    for suffix in SQLITE_SIDECARS:
        sidecar = path.with_name(path.name + suffix)
        if sidecar.exists():
            _set_mode(sidecar, FILE_MODE, warn=True)


def _set_mode(path: Path, mode: int, *, warn: bool) -> None:
    current = stat.S_IMODE(path.stat().st_mode)
    if current == mode:
        return
    try:
        os.chmod(path, mode)
    except PermissionError:
        # Not ours to change (say a volume's root owned by root, with the gateway in its
        # group): say so rather than refuse to start on it.
        log.warning("%s has mode %03o and is not ours to change; make it %03o", path, current, mode)
        return
    if warn and current & ~mode:
        log.warning("%s had mode %03o, open to other users: now %03o", path, current, mode)
