"""GGUF tensor types with no kernel here, dequantized at load to bfloat16 rather than float32.

llama.cpp writes many more types than the GGUF kernels read in their blocks
(``gguf_linear.GGUF_KERNEL_TYPES``): the i-quants IQ1_S to IQ3_S, the ternary
TQ1_0 / TQ2_0, Q8_K... A file with such tensors still loads: the loader
dequantizes them with the ``gguf`` package and rounds the values to bfloat16
(``loader/gguf_loader.py``: ``GGUFWeights.half``), and the layers holding them
keep that 2-byte copy, not a float32 one:

    Linear        -> the bf16 linear method (``packed_linear.PackedBF16LinearMethod``: bf16 k-pair panels,
                     float32 activations rounded to bf16 in the kernel, float32 sums), as dtype="bfloat16"
    token table   -> ``DequantizedEmbeddingMethod``: the table in bfloat16, rows widened to float32 on
                     lookup; a tied LM head multiplies that table with the bf16 linear method

Why bfloat16 and this method: the dequantized values of a 1.5-4 bit type are
coarse already, bf16's 8 bits of mantissa round them by at most 2^-9 of their
size; bf16 keeps float32's range (float16 saturates at 65504); and the packed
bf16 kernel is the fastest 2-byte product here, measured 5.2x (1 row) and 3.2x
(64 rows) the GGUF kernel's BF16 blocks on a 2048x2048 weight (AVX512-BF16,
2026-12-06). Where it has no vector code (neither AVX512-BF16 nor AVX2) oneDNN's
bf16 takes it; with neither, the tensors stay float32 (torch's bf16 matmul
measured ~300x slower than float32 on such a CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.linear import LinearMethod, replace_parameter
from pagedllm.layers.parallel import EmbeddingMethod
from pagedllm.layers.quantization.gguf_linear import GGUF_KERNEL_TYPES
from pagedllm.layers.quantization.onednn_linear import (
    OneDnnLinearMethod,
    onednn_available,
    onednn_bf16_supported,
)
from pagedllm.layers.quantization.packed_linear import (
    PackedBF16LinearMethod,
    packed_linear_bf16_native,
)


def has_gguf_kernel(ggml_type: int) -> bool:
    """Whether the GGUF kernels read ``ggml_type``'s blocks (else it is dequantized at load)."""
    return ggml_type in GGUF_KERNEL_TYPES


def dequantized_linear_method() -> LinearMethod | None:
    """The 2-byte linear method tensors of a type with no kernel take; None where this CPU has no fast one
    (they stay float32)."""
    if packed_linear_bf16_native():
        return PackedBF16LinearMethod()
    if onednn_available() and onednn_bf16_supported():
        return OneDnnLinearMethod(torch.bfloat16)
    return None


class DequantizedEmbeddingMethod(EmbeddingMethod):
    """A token table of a GGUF type with no kernel, held in bfloat16; rows come out float32.

    Args:
        head_method: the bf16 linear method a tied LM head multiplies this table with.
    """

    name = "gguf-dequantized-bf16"

    def __init__(self, head_method: LinearMethod) -> None:
        self.head_method = head_method

    def tied_head_method(self) -> LinearMethod:
        return self.head_method

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        # the loader's values are bf16 already (GGUFWeights.half): exact
        replace_parameter(layer, "weight", layer.weight.detach().to(torch.bfloat16).contiguous())

    def embedding(self, layer: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, layer.weight).float()
