"""Make vLLM's CPU build run its AVX2 variant on an AVX-512 machine (``run.py --isa avx2``).

``run.py`` puts this folder on PYTHONPATH, so every Python process of the run
(vLLM's engine-core child included) imports it at start. vLLM picks its
kernel library (``_C`` for AVX512-BF16, ``_C_AVX512``, ``_C_AVX2``) and its
attention paths from ``torch.cpu._is_avx512_supported()`` and its siblings,
which read the hardware: those answer False here. torch's own kernels
(``ATEN_CPU_CAPABILITY``), oneDNN (``ONEDNN_MAX_CPU_ISA``) and MKL
(``MKL_ENABLE_INSTRUCTIONS``) are held to AVX2 by the environment ``run.py``
sets.
"""

import torch.cpu


def _no() -> bool:
    return False


torch.cpu._is_avx512_supported = _no
torch.cpu._is_avx512_bf16_supported = _no
torch.cpu._is_amx_tile_supported = _no
torch.cpu._is_amx_fp16_supported = _no
