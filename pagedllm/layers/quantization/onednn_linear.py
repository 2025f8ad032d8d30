"""Linear layers through oneDNN with weights packed once at load (CPU; float32 or bf16 weights).

``F.linear`` on the CPU goes to MKL's sgemm, which re-reads the weight in
its plain ``[out, in]`` layout at every call and, on AMD CPUs, takes a
generic code path. oneDNN (bundled with torch as ``mkldnn``) can reorder a
weight once into the blocked layout its JIT-compiled kernels stream
through; measured here, a 64-row decode batch over SmolLM2's layers ran
2.5x faster and single-row calls 3x faster (BENCHMARKS.md, "Linear
layers"). The packed weight replaces the plain one, so memory does not grow.

``EngineConfig.linear_backend`` picks it: "auto" (oneDNN on the CPU in
float32 when torch was built with it), "onednn" or "torch" (``F.linear``).
"""

from __future__ import annotations

import torch

from pagedllm.layers.linear import Linear, LinearMethod, replace_parameter


def onednn_available() -> bool:
    """Whether torch has oneDNN and its packed-weight linear op."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_bf16_supported() -> bool:
    """Whether oneDNN can run bf16 matmuls on this CPU (torch asks the CPU's features)."""
    return onednn_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_weight(weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A ``[out, in]`` weight in ``dtype`` (float32 or bfloat16) reordered into oneDNN's layout (an opaque tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(dtype).contiguous(), None)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` for ``x`` ``[..., in]`` against a packed weight."""
    rows = x.reshape(-1, x.shape[-1])
    if not rows.is_contiguous():
        rows = rows.contiguous()
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")  # [num_rows, out]
    return out.view(*x.shape[:-1], out.shape[-1])


class OneDnnLinearMethod(LinearMethod):
    """The weight only in oneDNN's packed layout; float32 in and out.

    ``weight_dtype=torch.bfloat16`` packs the weight in bf16 and rounds each
    input to bf16 for the matmul, then widens the result back to float32
    (what ``dtype="bfloat16"`` means on the CPU, see ``runner/model_loader.py``).
    """

    def __init__(self, weight_dtype: torch.dtype = torch.float32) -> None:
        if weight_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"oneDNN linear layers pack float32 or bfloat16 weights, got {weight_dtype}")
        if not onednn_available():
            raise ValueError("linear_backend='onednn' needs a torch build with oneDNN (mkldnn)")
        if weight_dtype == torch.bfloat16 and not onednn_bf16_supported():
            # oneDNN's bf16 reorder needs AVX512BW/VL/DQ or AVX-NE-CONVERT; it would raise deep inside torch
            raise ValueError(
                "linear_backend='onednn' with dtype='bfloat16' needs a CPU with AVX-512 (BW/VL/DQ) or "
                "AVX-NE-CONVERT; this one has neither: use linear_backend='packed' (or 'auto')"
            )
        self.weight_dtype = weight_dtype
        self.name = "onednn" if weight_dtype == torch.float32 else "onednn_bf16"

    def process_weights_after_loading(self, layer: Linear) -> None:
        replace_parameter(layer, "packed_weight", pack_weight(layer.weight, self.weight_dtype))
        replace_parameter(layer, "weight", None)
        bias = None if layer.bias is None else layer.bias.detach().to(self.weight_dtype).contiguous()
        replace_parameter(layer, "bias", bias)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            raise ValueError(f"oneDNN linear layers take float32 activations, got {x.dtype}")
        if self.weight_dtype == torch.float32:
            return onednn_linear(x, layer.packed_weight, layer.bias)
        return onednn_linear(x.to(self.weight_dtype), layer.packed_weight, layer.bias).float()
