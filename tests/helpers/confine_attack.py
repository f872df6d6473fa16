"""What a confined agent's tool tries against the trainer (issue 43, C1), for
tests/backends/execution/test_confine.py: run as a command harness
(``python -m tests.helpers.confine_attack ROOT RUN HOME``) or a Python harness
(``tests.helpers.confine_attack:run``, input ``{"args": [...]}``).

Each try prints ``name: done`` or ``name: refused``; ``uid`` and ``cmdline`` print what
they saw. The tries: a ``.pth`` file in every site folder of the interpreter (the next
interpreter start would run it, with the privileges of whoever starts it), a change to
agl's own code, ``/proc/sys/kernel/core_pattern`` (a program the kernel runs as root on
a crash), ``/etc/passwd``, a listing of the trainer's caches, the run folder (the store,
the admin token), and the first process's command line (what a sandbox hides).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping

from agl.agent import AgentContext

PROBE = "agl-confine-attack.pth"
SCRIPT = r"""
root="$1"; run="$2"; home="$3"
for d in $(python -c 'import site, sys; print(" ".join(site.getsitepackages() + [sys.prefix]))'); do
  echo '# a harmless stand-in for "import os; os.system(...)"' > "$d/PROBE" 2>/dev/null \
    && echo "pth $d: done" || echo "pth $d: refused"
done
try() { if sh -c "$2" 2>/dev/null; then echo "$1: done"; else echo "$1: refused"; fi; }
try code "echo '# tampered' >> '$root/agl/__init__.py'"
try core "echo '|/tmp/x' > /proc/sys/kernel/core_pattern"
try passwd "echo 'x::0:0::/:/bin/sh' >> /etc/passwd"
ls "$home/.cache" >/dev/null 2>&1 && echo "cache: done" || echo "cache: refused"
ls "$run" >/dev/null 2>&1 && echo "run: done" || echo "run: refused"
echo "uid: $(id -u)"
echo "cmdline: $(tr '\000' ' ' < /proc/1/cmdline)"
echo "env: $(env | grep -c -E 'WANDB|SECRET|TOKEN')"
""".replace("PROBE", PROBE)


def attack(args: list[str]) -> str:
    done = subprocess.run(
        ["sh", "-c", SCRIPT, "attack", *args], capture_output=True, text=True, check=False
    )
    return done.stdout


async def run(env: Mapping[str, str]) -> None:
    agent = AgentContext.from_env(env)
    print(attack(list(agent.input["args"])), flush=True)  # the worker's log
    await agent.finish(reward=0.0)


def main() -> None:
    sys.stdout.write(attack(sys.argv[1:]))


if __name__ == "__main__":
    main()
