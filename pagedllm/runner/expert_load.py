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

``load_summary`` is plain arithmetic over the counts (what ``pagedllm bench``
prints).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

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


@dataclass(frozen=True)
class ExpertCounts:
    """``tokens[j][e]``: tokens layer ``layers[j]`` routed to expert ``e`` (a token counts once per expert it
    chose, so a row sums to tokens x top_k); ``num_steps``: forward passes counted."""

    layers: tuple[int, ...]
    tokens: tuple[tuple[int, ...], ...]
    num_steps: int

    def by_expert(self) -> list[int]:
        """Each expert's tokens summed over the layers."""
        return [sum(col) for col in zip(*self.tokens)] if self.tokens else []

    def layer_imbalance(self) -> list[float]:
        """Per layer: its busiest expert's tokens over the mean expert's (1.0: even; 0.0: no tokens yet)."""
        out = []
        for row in self.tokens:
            mean = sum(row) / len(row)
            out.append(max(row) / mean if mean else 0.0)
        return out


def load_summary(counts: ExpertCounts) -> dict[str, float]:
    """Tokens per expert per step: ``mean`` over every (layer, expert), ``max`` the busiest (layer, expert)'s,
    ``imbalance`` = max / mean; zeros before any step."""
    if not counts.tokens or not counts.num_steps:
        return {"mean": 0.0, "max": 0.0, "imbalance": 0.0, "num_steps": counts.num_steps}
    cells = [n for row in counts.tokens for n in row]
    mean = sum(cells) / len(cells) / counts.num_steps
    peak = max(cells) / counts.num_steps
    return {"mean": round(mean, 3), "max": round(peak, 3), "imbalance": round(peak / mean, 3) if mean else 0.0,
            "num_steps": counts.num_steps}
