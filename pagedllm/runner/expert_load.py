"""Expert load: how many tokens each expert of a mixture-of-experts model's layers was routed, read when asked.

Each ``MoEBlock`` adds its step's per-expert counts (the ``bincount`` its
grouping computes anyway) into an int64 buffer, and counts its forward
passes: one tensor add per layer per step, nothing read back. ``ExpertLoad``
finds those blocks and copies their counts out only when a reader asks (a
``/metrics`` scrape, the end of a benchmark), so the step never waits on it.
Under tensor parallelism the router is whole on every rank and every rank
chooses alike: rank 0's counts (this process's) are the model's. Captured
decode steps do not run mixture-of-experts models today (their grouping
reads the counts into Python, ``runner/capture/captured_decode.py``); the
counts are tensors, so a traced step would keep them.

The counts come out as ``pagedllm.expert_counts.ExpertCounts`` (plain data).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.expert_counts import ExpertCounts
from pagedllm.layers.fused_moe import MoEBlock


class ExpertLoad:
    """The routing counts of ``model``'s sparse layers (``model.model.layers[i].mlp`` a ``MoEBlock``)."""

    def __init__(self, model: nn.Module) -> None:
        self.blocks: list[tuple[int, MoEBlock]] = [
            (i, layer.mlp) for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, MoEBlock)
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
