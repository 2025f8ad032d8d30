"""Float32 linear layers through our own packed-panel kernel (CPU).

The weight ``[out, in]`` is reordered once at load into column panels
(``kernels/packed/packed_linear.cpp`` draws the layout) and the plain copy is
dropped, so memory does not grow. The kernel keeps an 8-row (6 with AVX2)
x one-panel tile of sums in registers and, while it computes one panel, prefetches the next
one into L2; at the row counts a decode step has (8-64) that is where oneDNN's
packed matmul loses time waiting on memory. Measured on SmolLM2's shapes
(BENCHMARKS.md, "Packed-panel linear layers"): 1.17-1.56x oneDNN from 1 to
64 rows and even with it at 256-1024, so ``EngineConfig.linear_backend="auto"`` takes it for float32 on
the CPU when the native kernels build.
"""

from __future__ import annotations

import torch

from pagedllm.kernels import kernels_available, load_kernels
from pagedllm.layers.linear import Linear, LinearMethod, replace_parameter


def packed_linear_available() -> bool:
    """Whether the native kernel library (and so this linear) builds here."""
    return kernels_available()


def _library():  # noqa: ANN202 (torch's op namespace)
    """``torch.ops.pagedllm``; ValueError naming the reason when the kernels cannot be built here."""
    ops = load_kernels()
    if ops is None:
        from pagedllm.kernels import kernels_failure

        raise ValueError(f"linear_backend='packed' needs the native CPU kernels, which cannot be built here: "
                         f"{kernels_failure()}")
    return ops


def _float32_rows(x: torch.Tensor, in_features: int) -> torch.Tensor:
    """``x`` ``[..., in]`` as contiguous rows ``[num_rows, in]`` (the op checks dtype and device)."""
    if x.shape[-1] != in_features:
        raise ValueError(f"input has {x.shape[-1]} features, the weight expects {in_features}")
    rows = x.reshape(-1, in_features)
    return rows if rows.is_contiguous() else rows.contiguous()


def _float32_weight(weight: torch.Tensor) -> torch.Tensor:
    """A weight as a contiguous float32 CPU tensor, what the packing ops read (they check it is 2-D)."""
    return weight.detach().to(device="cpu", dtype=torch.float32).contiguous()


def pack_weight_panels(weight: torch.Tensor) -> torch.Tensor:
    """A float32 ``[out, in]`` weight as ``[num_panels, in, panel]`` column panels (zero-padded)."""
    return _library().pack_panels(_float32_weight(weight))  # [num_panels, in, panel]


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """``x @ W.T + bias`` for float32 ``x`` ``[..., in]`` and a weight packed by ``pack_weight_panels``."""
    # the op checks that the buffer covers out_features in this build's panel width
    rows = _float32_rows(x, packed.shape[1] if packed.dim() == 3 else x.shape[-1])
    out = _library().packed_linear(rows, packed, bias, out_features)  # [num_rows, out_features]
    return out.view(*x.shape[:-1], out_features)


class PackedLinearMethod(LinearMethod):
    """Float32 weights in column panels (``pack_weight_panels``); the plain copy is dropped."""

    name = "packed"

    def process_weights_after_loading(self, layer: Linear) -> None:
        _library()
        replace_parameter(layer, "packed_weight", pack_weight_panels(layer.weight))
        replace_parameter(layer, "weight", None)
        replace_parameter(layer, "bias", None if layer.bias is None else layer.bias.detach().float().contiguous())

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, layer.packed_weight, layer.bias, layer.out_features)


# --- bfloat16 weights --------------------------------------------------------


_BF16_ISAS = {2: "avx512_bf16", 1: "avx2", 0: "scalar"}


def packed_linear_bf16_isa() -> str:
    """How this build of the bf16 kernel multiplies: "avx512_bf16" (the bf16 dot
    instruction), "avx2" (bf16 widened to float32 in registers, FMA) or "scalar"."""
    return _BF16_ISAS[int(_library().packed_linear_bf16_native())]


def packed_linear_bf16_native() -> bool:
    """Whether this build runs the bf16 kernel in vector code (AVX512-BF16 or AVX2), not the scalar loop."""
    return packed_linear_bf16_isa() != "scalar"


def pack_weight_panels_bf16(weight: torch.Tensor) -> torch.Tensor:
    """A ``[out, in]`` weight rounded to bf16 as ``[num_panels, ceil(in / 2), panel, 2]`` k-pair panels."""
    # [num_panels, ceil(in / 2) k pairs, panel, 2] bfloat16
    return _library().pack_panels_bf16(_float32_weight(weight))


def packed_linear_bf16(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int, in_features: int
) -> torch.Tensor:
    """``bf16(x) @ W.T + bias`` in float32 for float32 ``x`` ``[..., in]`` and a weight from ``pack_weight_panels_bf16``."""
    # in_features is the caller's claim about the packed buffer: the op checks the buffer
    # against the activations' width, so a claim it does not match is refused first
    if packed.dim() != 4 or packed.shape[1] != (in_features + 1) // 2:
        raise ValueError(f"packed bf16 weight {tuple(packed.shape)} does not fit {out_features}x{in_features}")
    rows = _float32_rows(x, in_features)
    out = _library().packed_linear_bf16(rows, packed, bias, out_features)  # [num_rows, out_features]
    return out.view(*x.shape[:-1], out_features)


class PackedBF16LinearMethod(LinearMethod):
    """bfloat16 weights in k-pair panels, float32 activations in and out.

    What ``dtype="bfloat16"`` means on the CPU (see ``runner/model_loader.py``):
    the matmuls multiply bf16 values (AVX512-BF16, or AVX2 widening them in
    registers) and sum in float32; the bias, if any, is the checkpoint's
    value rounded to bf16 and added in float32.
    """

    name = "packed_bf16"

    def process_weights_after_loading(self, layer: Linear) -> None:
        _library()
        replace_parameter(layer, "packed_weight", pack_weight_panels_bf16(layer.weight))
        replace_parameter(layer, "weight", None)
        bias = None if layer.bias is None else layer.bias.detach().to(torch.bfloat16).float().contiguous()
        replace_parameter(layer, "bias", bias)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return packed_linear_bf16(x, layer.packed_weight, layer.bias, layer.out_features, layer.in_features)
