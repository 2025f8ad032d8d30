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
from pagedllm.layers.linear_swap import replace_linear_layers
from pagedllm.layers.onednn_linear import onednn_linear, pack_weight
from pagedllm.layers.packed_linear import pack_weight_panels, packed_linear

# rows at or below which the int8 kernel beats float32 GEMM on the bytes it
# saves, measured on the 2-vCPU EPYC for SmolLM2's layer shapes: the kernel
# alone matches oneDNN at 8 rows; with the whole step fused
# (runner/fused_decode.py), 8 sequences decode at 444 tok/s fused against 309
# layer by layer, 16 at 429 fused against 486 (BENCHMARKS.md)
SMALL_BATCH_ROWS = 8

# how each float32 backend stores the dequantized copy
_DENSE_PACKERS = {"torch": lambda w: w, "onednn": pack_weight, "packed": pack_weight_panels}


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel: (q ``[N, K]`` int8, scale ``[N]`` float32)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # [N]
    q = torch.round(w / scale.unsqueeze(1)).clamp(-127, 127).to(torch.int8)  # [N, K]
    return q, scale


class Int8Linear(nn.Module):
    """A linear layer whose weights are int8 with per-output-channel scales."""

    def __init__(self, linear: nn.Linear, dense_backend: str = "torch") -> None:
        super().__init__()
        q, scale = quantize_per_channel(linear.weight)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("qweight", q.contiguous())  # [out_features, in_features] int8
        self.register_buffer("scales", scale.contiguous())  # [out_features] float32
        bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
        self.register_buffer("bias", bias)
        # [out_features, in_features] float32: q * scale, for calls with many rows,
        # in the layout of the float32 linear backend that multiplies by it
        dequantized = (q.float() * scale.unsqueeze(1)).contiguous()
        if dense_backend not in _DENSE_PACKERS:
            raise ValueError(f"dense_backend must be one of {sorted(_DENSE_PACKERS)}, got {dense_backend!r}")
        self.dense_backend = dense_backend
        self.register_buffer("dequantized", _DENSE_PACKERS[dense_backend](dequantized))
        # the op (torch.ops.pagedllm.int8_linear), None where the kernels cannot be built
        ops = load_kernels()
        self._kernel = None if ops is None else ops.int8_linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if x.dtype != torch.float32:
            raise ValueError(f"Int8Linear computes in float32, got {x.dtype}")
        if self._kernel is None or rows.shape[0] > SMALL_BATCH_ROWS:
            if self.dense_backend == "packed":
                return packed_linear(x, self.dequantized, self.bias, self.out_features)
            if self.dense_backend == "onednn":
                return onednn_linear(x, self.dequantized, self.bias)
            return F.linear(x, self.dequantized, self.bias)
        out = self._kernel(rows.contiguous(), self.qweight, self.scales, self.bias)  # [num_rows, out_features]
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights"


def quantize_model_int8(model: nn.Module, dense_backend: str = "torch") -> int:
    """Replace every ``nn.Linear`` in ``model`` with ``Int8Linear``; returns how many.

    ``dense_backend`` ("packed", "onednn" or "torch") multiplies calls with
    more than ``SMALL_BATCH_ROWS`` rows by the dequantized weights.

    A tied LM head is quantized as a separate copy: the embedding table keeps
    its float32 rows for lookups.
    """
    if not kernels_available():
        from pagedllm.kernels import kernels_failure

        raise ValueError(f"quantization='int8' needs the native CPU kernels, which cannot be built here: {kernels_failure()}")
    return replace_linear_layers(model, lambda linear: Int8Linear(linear, dense_backend))
