#!/usr/bin/env bash
# Installs the agent harnesses tests/harnesses/test_real_harnesses.py runs through the proxy:
# - Codex CLI, Claude Code, OpenCode and Qwen Code from npm, at the exact versions of
#   package-lock.json, into tests/harnesses/node_modules (needs Node >= 20 and npm);
# - the OpenHands SDK into tests/harnesses/.venv, a venv of its own: it needs Python
#   >= 3.12 (agl supports 3.11). Its packages are pinned in openhands-requirements.txt.
# Both folders are git-ignored. Running it again brings them back to the pinned versions.
set -euo pipefail
cd "$(dirname "$0")"

# Not `npm ci`: the lock was made against a registry mirror that lacks some other
# platforms' optional binaries, and ci refuses a lock without them. install keeps every
# locked version and writes nothing back (--no-save). The postinstall scripts of Claude
# Code and OpenCode put their native binary in place (allowScripts in package.json).
npm install --no-save --no-audit --no-fund

# A Python >= 3.12: $AGL_PYTHON312, else python3.13/python3.12 on PATH, else pyenv's.
# Each candidate is tried: a pyenv shim is on PATH even where its version is not active.
new_enough() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; }
python=""
for candidate in ${AGL_PYTHON312:-} python3.13 python3.12 \
    "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.1[23]*/bin/python; do
    if new_enough "$candidate"; then python="$candidate"; break; fi
done
if [ -z "$python" ]; then
    echo "install.sh: OpenHands needs Python >= 3.12; set AGL_PYTHON312 to one" >&2
    exit 1
fi
"$python" -m venv .venv
.venv/bin/pip install --quiet --disable-pip-version-check -r openhands-requirements.txt
