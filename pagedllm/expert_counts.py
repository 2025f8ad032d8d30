"""A mixture of experts' routing counts as plain data, and the summary ``pagedllm bench`` prints of them.

``runner/expert_load.py`` copies the counts out of the model; the server's
metrics (``clients/metrics.py``) and the benchmark read them as this data,
without importing the runner.
"""

from __future__ import annotations

from dataclasses import dataclass


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
