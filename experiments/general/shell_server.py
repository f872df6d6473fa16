"""The command server inside an attempt's sandbox (``experiments.general.sandbox``).

It runs as the sandbox's unprivileged user, in the sandbox's namespaces, started with
``python -I`` from this file's text: the standard library only, nothing from the
workspace. One JSON request a line on stdin, one JSON answer a line on stdout:

- ``{"op": "run", "command": str, "timeout": s, "limit": bytes}``: ``bash -c command`` in
  the workspace, stdout and stderr together, stdin empty; at most ``limit`` bytes of
  output kept (the rest read and dropped, so a chatty command cannot fill the memory);
  after ``timeout`` seconds its process group is killed. Answers ``{"exit", "output",
  "truncated", "timed_out"}``.
- ``{"op": "read", "path": str, "limit": bytes}``: a regular file's text (a link is not
  followed). Answers ``{"text", "truncated"}``.
- ``{"op": "write", "path": str, "text": str}``: a file made or replaced (its folders
  made; a link is not followed). Answers ``{}``.

A request that fails answers ``{"error": message}``: what the agent would see from the
shell. Relative paths are the workspace's.
"""

import contextlib
import json
import os
import selectors
import signal
import stat
import subprocess
import sys
import time

CHUNK = 65536
IDLE_S = 0.05  # once the command has exited, output that stops this long is all


def run(command, timeout, limit):
    process = subprocess.Popen(
        ["bash", "-c", command],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    kept, truncated, timed_out = bytearray(), False, False
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            if not selector.select(min(left, IDLE_S)):
                if process.poll() is not None:  # done; anything it left running is cut off
                    break
                continue
            chunk = os.read(process.stdout.fileno(), CHUNK)
            if not chunk:  # every writer closed: the command and what it left running
                break
            room = limit - len(kept)
            truncated = truncated or len(chunk) > room
            kept += chunk[: max(0, room)]
    try:  # the command itself, if it closed its output and went on
        code = process.wait(timeout=0 if timed_out else max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        timed_out = True
    # what it left running dies with it (a daemon dies with the sandbox)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.stdout.close()
    if timed_out:
        code = process.wait()
    return {
        "exit": code,
        "output": kept.decode("utf-8", "replace"),
        "truncated": truncated,
        "timed_out": timed_out,
    }


def read(path, limit):
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path}: not a regular file")
        data = file.read(limit + 1)
    return {"text": data[:limit].decode("utf-8", "replace"), "truncated": len(data) > limit}


def write(path, text):
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as file:
        file.write(text)
    return {}


def answer(request):
    op = request.get("op")
    if op == "run":
        return run(str(request["command"]), float(request["timeout"]), int(request["limit"]))
    if op == "read":
        return read(str(request["path"]), int(request["limit"]))
    if op == "write":
        return write(str(request["path"]), str(request["text"]))
    return {"error": f"unknown op {op!r}"}


def undumpable():
    """No other process of the sandbox's user may open this one's /proc files: its pipe to
    the harness stays the harness's (PR_SET_DUMPABLE = 0; a command run from here is
    dumpable again after its exec)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)


def main():
    undumpable()
    for line in sys.stdin:
        try:
            reply = answer(json.loads(line))
        except (OSError, ValueError, KeyError, TypeError) as error:
            reply = {"error": str(error)}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
