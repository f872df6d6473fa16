"""What a sandbox is made of: the spec its first process reads (``agl/sandbox/entry.py``)
and the limits it runs under. Plain data, checked as it is made."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Literal

View = Literal["jail", "host"]


@dataclass(frozen=True)
class Limits:
    """What one sandbox may use. ``processes``, ``memory_mib`` and ``disk_mib`` are the
    sandbox's together (its init counts them, and ends it past one); ``file_mib`` (one
    file's size), ``open_files`` and the address space (``memory_mib``) are each
    process's, enforced by the kernel. ``disk_mib`` counts the writable paths the sandbox
    shares with the machine; its scratch folders are a tmpfs of ``scratch_mib`` besides."""

    processes: int = 256
    memory_mib: int = 2048
    disk_mib: int = 1024
    file_mib: int = 256
    open_files: int = 1024

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"sandbox limit {name} must be a whole number >= 1, not {value!r}")


@dataclass(frozen=True)
class Bind:
    """A path of the machine's seen at ``target`` in a jail (the same path by default)."""

    source: str
    target: str = ""
    writable: bool = False

    def __post_init__(self) -> None:
        _absolute(self.source)
        if self.target:
            _absolute(self.target)


@dataclass(frozen=True)
class Spec:
    """One sandboxed command: what it sees (``view``: a ``jail`` of ``binds``, or the
    ``host``'s tree read-only), what is hidden within that (``hidden``, with ``kept`` and
    ``writable`` paths inside hidden folders bound back), the programs replaced by a
    refusal, who it runs as, its environment and folder, and its limits."""

    view: View
    argv: tuple[str, ...]
    cwd: str
    env: Mapping[str, str]
    binds: tuple[Bind, ...] = ()
    hidden: tuple[str, ...] = ()
    kept: tuple[str, ...] = ()
    writable: tuple[str, ...] = ()
    refuse: Mapping[str, str] = field(default_factory=dict)  # program's path -> message
    uid: int | None = None  # None: as it is (an unprivileged trainer's user namespace)
    gid: int | None = None
    limits: Limits | None = None
    scratch_mib: int = 256
    output_limit: int | None = None  # bytes of merged output passed on; None: not read
    pass_fds: tuple[int, ...] = ()
    network: bool = False  # the machine's network; else none at all

    def __post_init__(self) -> None:
        if self.view not in ("jail", "host"):
            raise ValueError(f"a sandbox's view is 'jail' or 'host', not {self.view!r}")
        if not self.argv:
            raise ValueError("a sandbox needs a command")
        for path in (self.cwd, *self.hidden, *self.kept, *self.writable, *self.refuse):
            _absolute(path)
        if (self.uid is None) != (self.gid is None):
            raise ValueError("a sandbox's uid and gid are given together")
        if self.view == "host" and self.binds:
            raise ValueError("binds are a jail's; the host view shows the machine's tree")

    def dumps(self) -> bytes:
        data = asdict(self)
        data["binds"] = [[b.source, b.target or b.source, b.writable] for b in self.binds]
        data["env"] = dict(self.env)
        data["refuse"] = dict(self.refuse)
        return json.dumps(data).encode()


def _absolute(path: str) -> None:
    if not os.path.isabs(path):
        raise ValueError(f"a sandbox's paths are absolute, not {path!r}")
