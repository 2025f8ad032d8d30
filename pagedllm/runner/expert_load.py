"""Expert load: how many tokens each expert of a mixture-of-experts model's layers was routed, read when asked.

Each ``MoEBlock`` (and each Gemma 4 layer, which holds its experts beside
its dense MLP) adds its step's per-expert counts (the fixed-size count its
grouping computes anyway, ``fused_moe.count_routing``) into an int64
buffer, and counts its forward passes: one tensor add per layer per step,
nothing read back. ``ExpertLoad`` finds those counters and copies them out
only when a reader asks (a ``/metrics`` scrape, the end of a benchmark), so
the step never waits on it. Under tensor parallelism the router is whole on
every rank and every rank chooses alike: rank 0's counts (this process's)
are the model's. The counts are tensors, so captured decode steps keep them.

The counts come out as ``pagedllm.expert_counts.ExpertCounts`` (plain data).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.expert_counts import ExpertCounts


def _counter(layer: nn.Module) -> nn.Module | None:
    """The module of ``layer`` that counts its routing (``fused_moe.register_expert_counters``): its MLP when
    that is a ``MoEBlock``, the layer itself when it holds its experts (Gemma 4); None for a dense layer."""
    for module in (getattr(layer, "mlp", None), layer):
        if module is not None and isinstance(getattr(module, "expert_tokens", None), torch.Tensor):
            return module
    return None


class ExpertLoad:
    """The routing counts of ``model``'s sparse layers (``model.model.layers[i]``: a ``MoEBlock`` MLP, or a layer
    holding its own experts, as Gemma 4's)."""

    def __init__(self, model: nn.Module) -> None:
        self.blocks: list[tuple[int, nn.Module]] = [
            (i, counter) for i, layer in enumerate(model.model.layers) if (counter := _counter(layer)) is not None
        ]
        self.reset()

    @property
    def layers(self) -> list[int]:
        """The sparse layers' indices, in order."""
        return [i for i, _ in self.blocks]

    def reset(self) -> None:
        """Start counting from zero (after loading, calibration, a benchmark's warm-up)."""
        for _, block in self.blocks:
            block.expert_tokens.zero_()
            block.num_forwards.zero_()

    def counts(self) -> ExpertCounts:
        """The counts now, copied out: one row per sparse layer."""
        if not self.blocks:
            return ExpertCounts((), (), 0)
        tokens = torch.stack([block.expert_tokens for _, block in self.blocks]).tolist()
        return ExpertCounts(tuple(self.layers), tuple(tuple(row) for row in tokens),
                            int(self.blocks[0][1].num_forwards.item()))
