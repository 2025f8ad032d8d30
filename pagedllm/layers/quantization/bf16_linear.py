"""bfloat16 on the CPU: bf16 matmuls inside a float32 model.

``dtype="bfloat16"`` on the CPU does not run the whole model in bf16. Every
weight is rounded to bf16 once at load (the same values vLLM's bf16 model
holds), but only the linear layers compute with bf16 operands; what lies
between them stays float32:

    x (float32) --round to bf16--> [ bf16 x bf16 products, float32 sums ] --> y (float32)
         |                                    linear layer
    residual stream, RMSNorm, RoPE, SiLU, softmax: float32 (our native kernels)
    KV cache: bfloat16 by default (kv_cache_dtype="auto" follows dtype)

Why: on a CPU with AVX512-BF16 a bf16 dot product does twice the
multiply-adds of a float32 FMA and reads half the weight bytes, and that is
where the time goes (BENCHMARKS.md, "bfloat16 on the CPU"); the elementwise
work gains nothing from bf16, and keeping it in float32 keeps its rounding
out of the residual stream. On a GPU ``dtype="bfloat16"`` is a plain bf16
model. Memory: the linear weights take half their float32 bytes; the
embedding table and the norms stay float32 copies of their bf16 values
(SmolLM2: 113 MB of embedding, beside the LM head's own 57 MB bf16 panels).

Three implementations, picked by ``EngineConfig.linear_backend``:
"packed" (``PackedBF16LinearMethod``, our kernel: it rounds the float32 input
itself and writes float32, no extra copies), "onednn" (``OneDnnLinearMethod`` with
bf16 weights, with a rounding copy before and a widening copy after) and
"torch" (``TorchBF16LinearMethod`` below: ``F.linear`` on bf16 tensors, the same
copies).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.layers.linear import Linear, LinearMethod, replace_parameter


class TorchBF16LinearMethod(LinearMethod):
    """A bf16 weight through ``F.linear``; float32 in and out."""

    name = "torch_bf16"

    def process_weights_after_loading(self, layer: Linear) -> None:
        replace_parameter(layer, "weight", layer.weight.detach().to(torch.bfloat16).contiguous())
        bias = None if layer.bias is None else layer.bias.detach().to(torch.bfloat16).contiguous()
        replace_parameter(layer, "bias", bias)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            raise ValueError(f"bf16 linear layers take float32 activations, got {x.dtype}")
        return F.linear(x.to(torch.bfloat16), layer.weight, layer.bias).float()
