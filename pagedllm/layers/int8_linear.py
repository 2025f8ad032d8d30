"""Weight-only int8 linear layers (``EngineConfig.quantization="int8"``).

Each output channel ``n`` keeps int8 weights and one float32 scale::

    scale[n] = max_k |W[n, k]| / 127        q[n, k] = round(W[n, k] / scale[n])
    y[m, n]  = scale[n] * sum_k x[m, k] * q[n, k]  (+ bias[n])

Decoding a few sequences reads every weight once per step and does little
arithmetic with it, so its speed is set by memory bandwidth; int8 weights are
a quarter of the float32 bytes. Those calls (at most ``SMALL_BATCH_ROWS``
rows) go to the native kernel in ``kernels/int8_linear.cpp``. Larger
calls (prefills, big decode batches) are compute-bound, and float32 GEMM
(the packed-panel kernel or oneDNN) is faster there than any int8 path torch offers on
these CPUs, so they multiply by the dequantized weights ``q * scale``, kept
as a float32 copy: the same numbers, so a sequence's tokens barely depend on
its batch (only the summation order differs). The copy means int8 buys
small-batch speed, not memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import kernels_available, load_kernels
from pagedllm.layers.linear import Linear, LinearMethod, apply_linear_method, replace_parameter
from pagedllm.layers.onednn_linear import onednn_linear, pack_weight
from pagedllm.layers.packed_linear import pack_weight_panels, packed_linear

# rows at or below which the int8 kernel beats float32 GEMM on the bytes it
# saves, measured on the 2-vCPU EPYC for SmolLM2's layer shapes: the kernel
# alone matches oneDNN at 8 rows; with the whole decode step in one native call
# (the former fused decoder; now runner/step_program.py), 8 sequences decoded
# at 444 tok/s against 309 layer by layer, 16 at 429 against 486 (BENCHMARKS.md)
SMALL_BATCH_ROWS = 8

# how each float32 backend stores the dequantized copy
_DENSE_PACKERS = {"torch": lambda w: w, "onednn": pack_weight, "packed": pack_weight_panels}


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel: (q ``[N, K]`` int8, scale ``[N]`` float32)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # [N]
    q = torch.round(w / scale.unsqueeze(1)).clamp(-127, 127).to(torch.int8)  # [N, K]
    return q, scale


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ (q * scale).T + bias`` through the native int8 kernel, for float32 ``x`` ``[..., in]``."""
    lib = load_kernels()
    if lib is None:
        from pagedllm.kernels import kernels_failure

        raise ValueError(f"the int8 kernel cannot be built here: {kernels_failure()}")
    out_features, in_features = qweight.shape
    out = lib.int8_linear(x.reshape(-1, in_features).contiguous(), qweight, scales, bias)  # [num_rows, out_features]
    return out.view(*x.shape[:-1], out_features)


class Int8LinearMethod(LinearMethod):
    """int8 weights with per-output-channel scales; a few rows go to the int8 kernel, more to float32 GEMM.

    ``dense_backend`` ("packed", "onednn" or "torch") is the float32 layout of
    the dequantized copy that calls of more than ``SMALL_BATCH_ROWS`` rows
    multiply by.
    """

    name = "int8"
    row_limits = (SMALL_BATCH_ROWS,)

    def __init__(self, dense_backend: str = "torch") -> None:
        if dense_backend not in _DENSE_PACKERS:
            raise ValueError(f"dense_backend must be one of {sorted(_DENSE_PACKERS)}, got {dense_backend!r}")
        self.dense_backend = dense_backend

    def process_weights_after_loading(self, layer: Linear) -> None:
        q, scale = quantize_per_channel(layer.weight)
        replace_parameter(layer, "qweight", q.contiguous())  # [out_features, in_features] int8
        replace_parameter(layer, "scales", scale.contiguous())  # [out_features] float32
        # [out_features, in_features] float32: q * scale, for calls with many rows,
        # in the layout of the float32 linear backend that multiplies by it
        dequantized = (q.float() * scale.unsqueeze(1)).contiguous()
        replace_parameter(layer, "dequantized", _DENSE_PACKERS[self.dense_backend](dequantized))
        replace_parameter(layer, "weight", None)
        replace_parameter(layer, "bias", None if layer.bias is None else layer.bias.detach().float().contiguous())

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            raise ValueError(f"int8 linear layers compute in float32, got {x.dtype}")
        num_rows = x.numel() // layer.in_features
        if load_kernels() is not None and num_rows <= SMALL_BATCH_ROWS:
            return int8_linear(x, layer.qweight, layer.scales, layer.bias)
        if self.dense_backend == "packed":
            return packed_linear(x, layer.dequantized, layer.bias, layer.out_features)
        if self.dense_backend == "onednn":
            return onednn_linear(x, layer.dequantized, layer.bias)
        return F.linear(x, layer.dequantized, layer.bias)


def quantize_model_int8(model: nn.Module, dense_backend: str = "torch") -> int:
    """Give every linear layer of ``model`` int8 weights; returns how many.

    ``dense_backend`` ("packed", "onednn" or "torch") multiplies calls with
    more than ``SMALL_BATCH_ROWS`` rows by the dequantized weights.

    A tied LM head is quantized as a separate copy: the embedding table keeps
    its float32 rows for lookups.
    """
    if not kernels_available():
        from pagedllm.kernels import kernels_failure

        raise ValueError(f"quantization='int8' needs the native CPU kernels, which cannot be built here: {kernels_failure()}")
    return apply_linear_method(model, Int8LinearMethod(dense_backend))
