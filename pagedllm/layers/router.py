"""The router of a mixture-of-experts layer: which ``top_k`` experts each token goes to, and with what weight.

``RouterSpec`` says how a family routes; ``Router`` is the gate's linear
layer (``[num_experts, hidden]``, Hugging Face's ``mlp.gate``) and
``route_logits`` the arithmetic, in float32 whatever the model's dtype, as
transformers' routers compute it (``softmax(..., dtype=torch.float)``):

- ``scoring="softmax"``, ``order="softmax_topk"``: probabilities over all
  experts, then the ``top_k`` largest (Qwen2/3-MoE, OLMoE, Mixtral); with
  ``renormalize`` the chosen ones divided by their sum (``norm_topk_prob``).
- ``scoring="softmax"``, ``order="topk_softmax"``: the ``top_k`` largest
  logits, then a softmax over those only (GraniteMoE, gpt-oss).
- ``scoring="sigmoid"``: ``sigmoid(logits)``; the choice ranks them plus the
  ``e_score_correction_bias`` where the spec has one (DeepSeek-V3-style), the
  weights are the uncorrected scores, renormalised (over their sum plus 1e-20,
  as transformers) where asked.

Then every weight is multiplied by ``routed_scaling_factor``. Ties in the
top-k are broken as ``torch.topk`` breaks them, since it is ``torch.topk``;
the slots of a token come in its order (largest first), the order the
block sums the experts' outputs in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.layers.custom_op import CustomOp
from pagedllm.layers.linear import Linear, QuantConfig, UnquantizedLinearMethod
from pagedllm.layers.quantization.packed_linear import PackedLinearMethod, packed_linear_available
from pagedllm.layers.quantization.quantized_linear import QuantizedLinearMethod

SCORINGS = ("softmax", "sigmoid")
ORDERS = ("softmax_topk", "topk_softmax")


@dataclass(frozen=True)
class RouterSpec:
    """How a mixture-of-experts layer routes a token (see the module docstring for each kind).

    ``bias``: the gate's linear layer has a bias (gpt-oss); ``correction_bias``:
    a per-expert ``e_score_correction_bias`` added to the sigmoid scores for the
    choice only.
    """

    num_experts: int
    top_k: int
    scoring: str = "softmax"
    order: str = "softmax_topk"
    renormalize: bool = False
    correction_bias: bool = False
    bias: bool = False
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.num_experts, bool) or not isinstance(self.num_experts, int) or self.num_experts < 1:
            raise ValueError(f"a router needs a positive number of experts, got {self.num_experts!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be between 1 and num_experts={self.num_experts}, got {self.top_k!r}")
        if self.scoring not in SCORINGS:
            raise ValueError(f"router scoring must be one of {SCORINGS}, got {self.scoring!r}")
        if self.order not in ORDERS:
            raise ValueError(f"router order must be one of {ORDERS}, got {self.order!r}")
        if self.scoring == "sigmoid" and self.order != "softmax_topk":
            raise ValueError("a sigmoid router scores every expert before its top-k: order must be 'softmax_topk'")
        if self.correction_bias and self.scoring != "sigmoid":
            raise ValueError("an e_score_correction_bias is applied to sigmoid scores only")
        if not isinstance(self.routed_scaling_factor, (int, float)) or not self.routed_scaling_factor > 0:
            raise ValueError(f"routed_scaling_factor must be positive, got {self.routed_scaling_factor!r}")


def route_logits(
    logits: torch.Tensor, spec: RouterSpec, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits`` ``[num_tokens, num_experts]`` -> (weights float32 ``[num_tokens, top_k]``, expert ids int64
    ``[num_tokens, top_k]``), each token's slots largest first."""
    logits = logits.float()
    if spec.scoring == "sigmoid":
        scores = torch.sigmoid(logits)
        choice = scores if correction_bias is None else scores + correction_bias.float()
        ids = torch.topk(choice, spec.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if spec.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    elif spec.order == "topk_softmax":
        top, ids = torch.topk(logits, spec.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1)
    else:
        probs = torch.softmax(logits, dim=-1)
        weights, ids = torch.topk(probs, spec.top_k, dim=-1)
        if spec.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    if spec.routed_scaling_factor != 1.0:
        weights = weights * spec.routed_scaling_factor
    return weights, ids


# RouterSpec's (scoring, order) -> the native op's kind (kernels/ops.cpp)
ROUTER_KINDS = {("softmax", "softmax_topk"): 0, ("softmax", "topk_softmax"): 1, ("sigmoid", "softmax_topk"): 2}


class RouterScores(CustomOp):
    """Logits ``[num_tokens, num_experts]`` -> (weights float32, expert ids int64), each ``[num_tokens, top_k]``,
    as ``spec`` routes: ``route_logits`` in torch, or ``torch.ops.pagedllm.moe_route`` natively.

    The native op gives ``route_logits``' bits on every variant of the kernels: it calls torch's own CPU
    kernels for the scores (softmax, sigmoid), the top-k and the renormalising sum, from C++ (their exp, their
    reduction order and their order among equal scores are torch's, which a softmax of our own could not
    promise to match). What it saves is the Python dispatch of each small op."""

    def __init__(self, spec: RouterSpec) -> None:
        super().__init__()
        self.spec = spec
        self.kind = ROUTER_KINDS[(spec.scoring, spec.order)]

    def forward_torch(
        self, logits: torch.Tensor, correction_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``route_logits``: torch ops one by one."""
        return route_logits(logits, self.spec, correction_bias)

    def forward_native(
        self, logits: torch.Tensor, correction_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One native call, ``route_logits``' bits."""
        spec = self.spec
        return self.native.moe_route(logits, spec.top_k, self.kind, spec.renormalize, correction_bias,
                                     float(spec.routed_scaling_factor))


class Router(Linear):
    """The gate ``[num_experts, hidden]`` (Hugging Face's ``mlp.gate``) and, for a corrected sigmoid router, its
    ``e_score_correction_bias`` ``[num_experts]``; ``route`` gives each token's experts and weights.

    Its weight is held as the quantization config says (a GGUF file's router is F32: llama.cpp's converter and
    quantizer keep it so), but in float32 under weight-only int8 / int4.
    """

    def __init__(self, spec: RouterSpec, hidden_size: int, quant_config: QuantConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__(hidden_size, spec.num_experts, bias=spec.bias, quant_config=quant_config, prefix=prefix)
        self.spec = spec
        # the logits' arithmetic: torch ops, or one native call with their bits (RouterScores, below)
        self.scores = RouterScores(spec)
        if isinstance(self.quant_method, QuantizedLinearMethod):
            self._keep_float()
        if spec.correction_bias:
            self.e_score_correction_bias = torch.nn.Parameter(torch.empty(spec.num_experts), requires_grad=False)

    def _keep_float(self) -> None:
        """Weight-only int8 / int4 leave the router in float32: its choices are what the experts compute, and
        transformers' router is never quantized (the packed panels where they build: a row alike in any batch)."""
        device = self.qweight.device
        del self._buffers["qweight"]
        self.weight = torch.nn.Parameter(torch.empty(self.out_features, self.in_features, device=device),
                                         requires_grad=False)
        self.quant_method = PackedLinearMethod() if packed_linear_available() else UnquantizedLinearMethod()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``x`` ``[num_tokens, hidden]`` -> (weights float32 ``[num_tokens, top_k]``, expert ids int64)."""
        bias = self.e_score_correction_bias if self.spec.correction_bias else None
        return self.scores(self(x), bias)

