"""Agents confined on this machine: the run's files and the other processes out of reach.

A local agent runs as the trainer's OS user (root, on many research machines), and its
model's shell tools with it: without more, a tool reads the gateway's store and admin
token from the run folder, or another process's environment and memory, and with them
sets any reward. ``confined(command, hidden)`` wraps an agent's command so that it runs

- in its own **PID namespace** (``unshare --pid --mount-proc``): ``/proc`` lists only the
  agent's own processes, so no other process's environment, memory or namespaces;
- in its own **mount namespace**, each ``hidden`` folder (the run folder) under an empty
  tmpfs no one may enter, except the ``kept`` folders inside it (an attempt's own
  workspace, agl/grading/), mounted back where they were: the tmpfs and the folders
  on the way may then be passed through but not listed;
- with **every capability dropped** and ``no_new_privs`` (``setpriv``): even uid 0 cannot
  unmount the tmpfs, mount anything, trace a process or regain a privilege through a
  setuid program.

Without root it first enters a user namespace mapped to its own user (``--user
--map-root-user``). The network is the machine's: the agent reaches the gateway on
loopback (a NetworkPolicy is the Kubernetes executor's answer to egress). The harness
inherits its pipes and file descriptors as before, so workers, logs and the report-key
pipe work unchanged; process-group signals reach it from outside the namespace.

``python -m agl.backends.execution.confine --hide=DIR ... --keep=DIR ... -- COMMAND ...``
is the namespace's first process: it mounts the tmpfs (and the kept folders), runs
``COMMAND`` under ``setpriv`` as its child (the first process of a PID namespace ignores
signals it does not handle, and reaps orphans), and exits with the command's status
(128 + N for a signal N).
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

# An empty, tiny filesystem with mode 000: listing or entering it is refused. Over a
# kept folder's path, 0111: passing through works, listing does not (no capabilities,
# so not even root may read a folder without its r bit).
_SEALED = 0o000
_PASSAGE = 0o111
DROP_PRIVILEGES = (
    "--no-new-privs",
    "--inh-caps=-all",
    "--ambient-caps=-all",
    "--bounding-set=-all",
)


def _unshare() -> list[str]:
    prefix = ["unshare"]
    if os.geteuid() != 0:
        prefix += ["--user", "--map-root-user"]
    return [
        *prefix,
        "--mount",
        "--pid",
        "--fork",
        "--kill-child",
        "--mount-proc",
        "--propagation",
        "private",
    ]


def confined(
    command: Sequence[str], hidden: Sequence[Path], kept: Sequence[Path] = ()
) -> list[str]:
    """``command`` (an argv) run confined, with ``hidden`` folders out of its sight but for
    the ``kept`` folders inside them."""
    options = [f"--hide={Path(d).resolve()}" for d in hidden]
    options += [f"--keep={Path(d).resolve()}" for d in kept]
    return [*_unshare(), sys.executable, "-m", __name__, *options, "--", *command]


@functools.cache
def unavailable() -> str | None:
    """Why agents cannot be confined here (a missing tool, namespaces refused), or None.
    Tried once per process, with a real confined ``true``."""
    for tool in ("unshare", "setpriv"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (util-linux)"
    probe = subprocess.run(
        confined(["true"], []), capture_output=True, text=True, timeout=60, check=False
    )
    if probe.returncode != 0:
        reason = (probe.stderr.strip().splitlines() or [f"exit code {probe.returncode}"])[-1]
        return f"namespaces are not available: {reason}"
    return None


def hide(folder: str, kept: Sequence[str]) -> None:
    """A tmpfs over ``folder``; each of ``kept`` (folders inside it) bound back in place."""
    if not os.path.isdir(folder):
        return  # nothing there to hide yet; nothing made later is visible either way
    inside = [k for k in kept if os.path.commonpath([folder, k]) == folder and k != folder]
    cover(folder, inside, _PASSAGE if inside else _SEALED, size="4k")


def cover(folder: str, kept: Sequence[str], mode: int, size: str | None = None) -> None:
    """A fresh tmpfs of ``mode`` over ``folder``, with ``kept`` (folders inside it) bound
    back in place and the folders on their way made passages (entered, not listed)."""
    # Opened before the tmpfs covers them; a mount from the descriptor finds them after.
    handles = {k: os.open(k, os.O_PATH | os.O_DIRECTORY) for k in kept}
    options = f"mode={mode:o}" + (f",size={size}" if size else "")
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "agl-hidden", folder],
            check=True,
            stdin=subprocess.DEVNULL,
        )
        for path, fd in handles.items():
            os.makedirs(path, exist_ok=True)
            relative = Path(os.path.relpath(path, folder))
            for parent in relative.parents[:-1]:  # the folders on the way, not the tmpfs
                os.chmod(Path(folder) / parent, _PASSAGE)
            # --no-canonicalize: resolved, /proc/self/fd/N would name the covered path.
            subprocess.run(
                ["mount", "--no-canonicalize", "--bind", f"/proc/self/fd/{fd}", path],
                check=True,
                stdin=subprocess.DEVNULL,
                pass_fds=(fd,),
            )
    finally:
        for fd in handles.values():
            os.close(fd)


_USAGE = (
    "usage: python -m agl.backends.execution.confine [--hide=DIR ...] [--keep=DIR ...] -- COMMAND"
)


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--" not in args:
        sys.exit(_USAGE)
    split = args.index("--")
    options, command = args[:split], args[split + 1 :]
    if not command or any(not o.startswith(("--hide=", "--keep=")) for o in options):
        sys.exit(_USAGE)
    hidden = [o.removeprefix("--hide=") for o in options if o.startswith("--hide=")]
    kept = [o.removeprefix("--keep=") for o in options if o.startswith("--keep=")]
    try:
        for folder in hidden:
            hide(folder, kept)
    except (OSError, subprocess.CalledProcessError) as error:
        sys.exit(f"agl confine: cannot hide the run's folders: {error}")
    # Signals sent to the group reach the command itself; this first process only waits
    # (a handler, not SIG_IGN: an ignored signal would stay ignored in the command).
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: None)
    # close_fds=False: the command keeps what it was given (its pipes, the report key's).
    child = subprocess.Popen(["setpriv", *DROP_PRIVILEGES, "--", *command], close_fds=False)
    code = child.wait()
    sys.exit(128 - code if code < 0 else code)


if __name__ == "__main__":
    main()
