"""Float32 linear layers through our own packed-panel kernel (CPU).

The weight ``[out, in]`` is reordered once at load into column panels
(``kernels/packed_linear.c`` draws the layout) and the plain copy is
dropped, so memory does not grow. The kernel keeps an 8-row (6 with AVX2)
x one-panel tile of sums in registers and, while it computes one panel, prefetches the next
one into L2; at the row counts a decode step has (8-64) that is where oneDNN's
packed matmul loses time waiting on memory. Measured on SmolLM2's shapes
(BENCHMARKS.md, "Packed-panel linear layers"): 1.17-1.56x oneDNN from 1 to
64 rows and even with it at 256-1024, so ``EngineConfig.linear_backend="auto"`` takes it for float32 on
the CPU when the native kernels build.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from pagedllm.kernels import load_kernels
from pagedllm.layers.linear import Linear, LinearMethod, apply_linear_method, replace_parameter


def packed_linear_available() -> bool:
    """Whether the native kernel library (and so this linear) builds here."""
    return load_kernels() is not None


def _library():  # noqa: ANN202
    lib = load_kernels()
    if lib is None:
        from pagedllm.kernels import kernels_failure

        raise ValueError(f"linear_backend='packed' needs the native CPU kernels, which cannot be built here: "
                         f"{kernels_failure()}")
    return lib


@functools.cache
def _panel_width() -> int:
    """Output columns per panel in this build of the kernels (48 with AVX-512, 16 with AVX2)."""
    return _library().packed_linear_panel()


def _float32_rows(x: torch.Tensor, in_features: int, what: str) -> torch.Tensor:
    """``x`` ``[..., in]`` as contiguous float32 CPU rows ``[num_rows, in]``; ``what`` names the layer in errors."""
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"{what} takes float32 activations on the CPU, got {x.dtype} on {x.device}")
    if x.shape[-1] != in_features:
        raise ValueError(f"input has {x.shape[-1]} features, the weight expects {in_features}")
    rows = x.reshape(-1, in_features)
    return rows if rows.is_contiguous() else rows.contiguous()


def _float32_weight(weight: torch.Tensor) -> torch.Tensor:
    """A 2-D weight as a contiguous float32 CPU tensor, what the packing kernels read."""
    if weight.dim() != 2:
        raise ValueError(f"expected a 2-D weight, got shape {tuple(weight.shape)}")
    return weight.detach().to(device="cpu", dtype=torch.float32).contiguous()


def pack_weight_panels(weight: torch.Tensor) -> torch.Tensor:
    """A float32 ``[out, in]`` weight as ``[num_panels, in, panel]`` column panels (zero-padded)."""
    lib = _library()
    w = _float32_weight(weight)
    out_features, in_features = w.shape
    panel = _panel_width()
    num_panels = (out_features + panel - 1) // panel
    packed = torch.empty(num_panels, in_features, panel, dtype=torch.float32)  # [num_panels, in, panel]
    lib.packed_linear_pack(w.data_ptr(), out_features, in_features, packed.data_ptr())
    return packed


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """``x @ W.T + bias`` for float32 ``x`` ``[..., in]`` and a weight packed by ``pack_weight_panels``."""
    lib = _library()
    num_panels, in_features, panel = packed.shape
    # the kernel trusts the buffer's size: a weight packed for another panel
    # width (another CPU) or fewer outputs would be read past its end
    if panel != _panel_width() or num_panels * panel < out_features or in_features < 1:
        raise ValueError(
            f"packed weight {tuple(packed.shape)} does not fit this build's {_panel_width()}-column "
            f"panels and {out_features} outputs; pack it here with pack_weight_panels"
        )
    if not packed.is_contiguous() or packed.dtype != torch.float32:
        raise ValueError("packed weight must be a contiguous float32 tensor")
    rows = _float32_rows(x, in_features, "packed linear")
    out = torch.empty(rows.shape[0], out_features, dtype=torch.float32)  # [num_rows, out_features]
    lib.packed_linear_f32(
        rows.data_ptr(), rows.shape[0], in_features, packed.data_ptr(),
        None if bias is None else bias.data_ptr(), out_features, out.data_ptr(), torch.get_num_threads(),
    )
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


def use_packed_linear(model: nn.Module) -> int:
    """Give every linear layer of ``model`` float32 packed panels; returns how many.

    A tied LM head gets its own packed copy; the embedding keeps its rows.
    """
    _library()
    return apply_linear_method(model, PackedLinearMethod())


# --- bfloat16 weights --------------------------------------------------------


@functools.cache
def _panel_width_bf16() -> int:
    """Output columns per bf16 panel in this build of the kernels."""
    return _library().packed_linear_bf16_panel()


def panel_width(dtype: torch.dtype) -> int:
    """Output columns per panel this build packs float32 or bfloat16 weights into."""
    if dtype == torch.float32:
        return _panel_width()
    if dtype == torch.bfloat16:
        return _panel_width_bf16()
    raise ValueError(f"packed panels hold float32 or bfloat16 weights, not {dtype}")


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
    lib = _library()
    w = _float32_weight(weight)
    out_features, in_features = w.shape
    panel = _panel_width_bf16()
    num_panels = (out_features + panel - 1) // panel
    # [num_panels, in / 2 (k pairs), panel, 2]
    packed = torch.empty(num_panels, (in_features + 1) // 2, panel, 2, dtype=torch.bfloat16)
    lib.packed_linear_bf16_pack(w.data_ptr(), out_features, in_features, packed.data_ptr())
    return packed


def packed_linear_bf16(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int, in_features: int
) -> torch.Tensor:
    """``bf16(x) @ W.T + bias`` in float32 for float32 ``x`` ``[..., in]`` and a weight from ``pack_weight_panels_bf16``."""
    lib = _library()
    num_panels, num_pairs, panel, _ = packed.shape
    if (
        panel != _panel_width_bf16() or num_panels * panel < out_features or num_pairs != (in_features + 1) // 2
        or in_features < 1
    ):
        raise ValueError(f"packed bf16 weight {tuple(packed.shape)} does not fit {out_features}x{in_features}")
    if not packed.is_contiguous() or packed.dtype != torch.bfloat16:
        raise ValueError("packed weight must be a contiguous bfloat16 tensor")
    rows = _float32_rows(x, in_features, "the bf16 packed linear")
    out = torch.empty(rows.shape[0], out_features, dtype=torch.float32)  # [num_rows, out_features]
    status = lib.packed_linear_bf16(
        rows.data_ptr(), rows.shape[0], in_features, packed.data_ptr(),
        None if bias is None else bias.data_ptr(), out_features, out.data_ptr(), torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("packed_linear_bf16: no memory for the bf16 copy of the activations")
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


def use_packed_linear_bf16(model: nn.Module) -> int:
    """Give every linear layer of ``model`` bf16 packed panels; returns how many."""
    _library()
    return apply_linear_method(model, PackedBF16LinearMethod())
