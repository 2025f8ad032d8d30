"""A mixture of experts' last step: each token's ``top_k`` expert outputs weighted and summed, in slot order.

``SlotSum`` takes the experts' outputs back in (token, slot) order ``y``
``[num_tokens, top_k, hidden]`` and the router's ``weights`` ``[num_tokens,
top_k]``::

    out[t] = w[t, 0] * y[t, 0] + w[t, 1] * y[t, 1] + ... + w[t, top_k - 1] * y[t, top_k - 1]
             (+ sigmoid(gate[t]) * shared[t], or + shared[t]: a shared expert, where the family has one)

summed left to right, each product rounded before it is added, so a row's
sum depends on that row only (batch invariance). In torch that is a loop of
``2 * top_k`` small ops; natively (``torch.ops.pagedllm.moe_slot_sum``,
``kernels/elementwise/elementwise.cpp``) one pass, and one node of a
captured decode step's native program instead of a Python call and a
program boundary per slot. The two give the same bits for the slots' sum.
"""

from __future__ import annotations

import torch

from pagedllm.layers.custom_op import CustomOp


class SlotSum(CustomOp):
    """``forward(y, weights, shared, gate)`` -> ``[num_tokens, hidden]`` in ``y``'s dtype (see the module docstring);
    ``shared`` ``[num_tokens, hidden]`` or None, ``gate`` ``[num_tokens, 1]`` (logits) or None."""

    def forward_torch(self, y: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None = None,
                      gate: torch.Tensor | None = None) -> torch.Tensor:
        """The loop over slots, then the shared expert."""
        w = weights.to(y.dtype)
        out = y[:, 0] * w[:, :1]
        for slot in range(1, y.shape[1]):  # a fixed order: a row's sum never depends on the other rows
            out.add_(y[:, slot] * w[:, slot : slot + 1])
        if shared is not None:
            out.add_(shared if gate is None else torch.sigmoid(gate) * shared)
        return out

    def forward_native(self, y: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None = None,
                       gate: torch.Tensor | None = None) -> torch.Tensor:
        """One native pass (float32 rows)."""
        return self.native.moe_slot_sum(y.contiguous(), weights.contiguous(), shared, gate)
