"""``agl COMMAND [ARGS ...]``: agl's commands under one name.

``agl train ...`` is ``python -m agl.train ...``, word for word: each command runs its
module as ``python -m`` would (``runpy``, with ``sys.argv`` set to the command's
arguments), so its options, its help, its errors and its exit status are the module's
own, and every ``python -m`` form keeps working beside it. Nothing is imported before
the command is known: ``agl --help`` answers at once, and ``agl train`` pays for torch
only when it runs.
"""

from __future__ import annotations

import runpy
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version

PROG = "agl"

# command: (module run as ``python -m``, what it does)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("agl.train", "one training run, or a Hydra sweep (-m)"),
    "serve": ("agl.serve", "the embedded inference server (OpenAI-compatible)"),
    "gateway": ("agl.gateway", "the API gateway and recording proxy, as a service"),
    "controller": ("agl.controller", "the rollout controller, as a service"),
    "rollouts": ("agl.rollouts", "list, show, export and scan a gateway's rollouts"),
    "report": ("agl.report", "plots and a table comparing run folders"),
    "study": ("agl.study", "a study: settings x paired seeds, with its report"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [
        f"usage: {PROG} COMMAND [ARGS ...]   ({PROG} COMMAND --help for a command's options)",
        "",
        "commands:",
        *(f"  {name:<{width}}  {about}" for name, (_, about) in COMMANDS.items()),
        "",
        f"  {PROG} --version   the installed version",
        "",
        "Each command is its module's `python -m` form: `agl train X` = `python -m agl.train X`.",
    ]
    return "\n".join(lines) + "\n"


def installed_version() -> str:
    try:
        return version("agl")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        sys.stdout.write(usage())
        return
    if args[0] in ("-V", "--version"):
        sys.stdout.write(f"{PROG} {installed_version()}\n")
        return
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        known = ", ".join(COMMANDS)
        sys.stderr.write(f"{PROG}: unknown command {name!r}; choose one of: {known}\n")
        raise SystemExit(2)
    module = COMMANDS[name][0]
    sys.argv = [f"{PROG} {name}", *rest]
    # run_module finds a package's __main__ itself (agl.rollouts, agl.study)
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
