"""Rotary position embeddings: inverse frequencies (with Llama 3 or linear scaling) and cos/sin tables."""

from __future__ import annotations

import math

import torch
from torch import nn


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """RoPE inverse frequencies ``[head_dim // 2]``, with Llama 3 or linear scaling if asked."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return inv_freq
    if kind == "linear":
        # positions divided by `factor`, folded into the frequencies (transformers does the same)
        return inv_freq / scaling["factor"]
    # Llama 3: long wavelengths are slowed by `factor`, short ones kept,
    # the band between interpolated smoothly
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(in_band, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with a cos/sin table for every position.

    ``cos_sin`` looks the step's positions up once; every layer then applies
    the same pair. Rotate-half is written as a roll by half the head and a
    sign folded into the sin table (exact: only signs change)::

        rotate_half([x1, x2]) = [-x2, x1] = roll([x1, x2], half) * [-1, +1]
    """

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        self.settings = (head_dim, max_position, theta, scaling)
        self.register_buffer("cos", torch.empty(max_position, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_position, head_dim), persistent=False)
        self.build_tables()

    def build_tables(self) -> None:
        """Fill the cos/sin tables (again after a model built on the meta device)."""
        head_dim, max_position, theta, scaling = self.settings
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.arange(max_position, dtype=torch.float32).unsqueeze(1) * inv_freq.unsqueeze(0)
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_position, head_dim]
        sign = torch.cat([-torch.ones(head_dim // 2), torch.ones(head_dim // 2)])  # [head_dim]
        with torch.device("cpu"):
            self.cos = emb.cos().to(self.cos.device)
            self.sin = (emb.sin() * sign).to(self.sin.device)  # signed: see the class docstring

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for the step's tokens, each ``[num_tokens, 1, head_dim]``."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Rotate ``x`` ``[num_tokens, heads, head_dim]`` by its tokens' angles."""
        cos, sin = cos_sin
        return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin
