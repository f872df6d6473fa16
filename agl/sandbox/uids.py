"""A user id per sandbox: one that owns nothing on the machine and no other sandbox runs
as while it is held.

A root trainer runs each sandbox's command as its own uid, taken from a range no one
else uses (``AGL_SANDBOX_UIDS=first:count``, default 2,147,000,000 and the 65,536 after
it: above the ranges that systems and container runtimes hand out). The kernel counts
processes per uid, so with a uid of its own a sandbox's process limit is its own, and
nothing one sandbox leaves (a file in a folder anyone may write, a process) belongs to
the user of the next. A uid is held by an exclusive lock on a file of root's
(``/run/agl-sandbox-uids/<uid>``, else under the temporary folder), so processes of any
number of trainers on the machine never share one; the lock goes with its holder, also
when it is killed.

Without root there is no other uid to run as: ``lease`` answers None and the sandbox
runs as the trainer's user in a user namespace (``agl.sandbox.launch``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

RANGE_ENV = "AGL_SANDBOX_UIDS"
DEFAULT_RANGE = (2_147_000_000, 65_536)


class NoFreeUid(RuntimeError):
    """Every uid of the range is held."""


def uid_range() -> tuple[int, int]:
    """(first, count) of the sandboxes' uids; ValueError (one line) for a bad setting."""
    value = os.environ.get(RANGE_ENV)
    if not value:
        return DEFAULT_RANGE
    first, _, count = value.partition(":")
    try:
        span = (int(first), int(count))
    except ValueError:
        raise ValueError(f"{RANGE_ENV}={value!r}: want FIRST:COUNT, two whole numbers") from None
    if span[0] < 1000 or span[1] < 1 or span[0] + span[1] > 2**32 - 2:
        raise ValueError(f"{RANGE_ENV}={value!r}: want uids from 1000 to 2^32 - 2")
    return span


def _lock_folder() -> Path:
    for parent in (Path("/run"), Path(tempfile.gettempdir())):
        folder = parent / "agl-sandbox-uids"
        with contextlib.suppress(FileExistsError, PermissionError):
            folder.mkdir(mode=0o700)
        try:
            info = folder.lstat()
        except OSError:
            continue
        # A folder someone else made could let them hold or fake the locks.
        if stat.S_ISDIR(info.st_mode) and info.st_uid == 0 and info.st_mode & 0o077 == 0:
            return folder
    raise NoFreeUid("no folder of root's for the sandboxes' uid locks (/run, the temp folder)")


@contextlib.contextmanager
def lease() -> Iterator[int | None]:
    """A uid no other sandbox holds, held until the block ends; None without root."""
    if os.geteuid() != 0:
        yield None
        return
    first, count = uid_range()
    folder = _lock_folder()
    start = secrets.randbelow(count)
    for step in range(count):
        uid = first + (start + step) % count
        fd = os.open(folder / str(uid), os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            yield uid
        finally:
            os.close(fd)
        return
    raise NoFreeUid(f"all {count} sandbox uids from {first} are held")


def give(folder: Path, uid: int | None) -> None:
    """``folder`` and everything in it made ``uid``'s (its own group's too): the one place
    a sandbox run as ``uid`` may write. Links are changed, not followed. None: nothing to
    do (an unprivileged trainer's sandboxes run as its own user)."""
    if uid is None:
        return
    for path, dirs, files in os.walk(folder):
        os.chown(path, uid, uid)
        for name in dirs + files:
            os.lchown(os.path.join(path, name), uid, uid)
