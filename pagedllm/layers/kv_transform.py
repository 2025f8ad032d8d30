"""A per-layer change of variables for K, V and the query that an int4 KV cache quantizes better.

An int4 cache (``layers/kv_quant.py``) spends 15 levels on each rotated head
row; its error is proportional to the row's size. Keys carry two things the
scores do not need at that precision (measured on SmolLM2-135M,
docs/configuration.md):

* a large component common to every token (the channel means of K, the
  "attention sink" directions): a query's score against it is the same for
  every key, so softmax ignores it, yet it sets the scale of every row;
* channels whose key values are large where the queries' are small, and the
  other way round: an error in channel c costs ``q_c * err_c``.

So each layer stores, per KV head, not ``k`` but ``k' = (k - m) / s`` and
attends with ``q' = q * s``:

    q' . k' = q . k - q . m        the same for every key of the query:
                                    softmax(q' . k') = softmax(q . k)

with ``m`` the keys' mean and ``s_c = sqrt(std(k_c) / rms(q_c))`` (the
queries of the KV head's group), which balances the two factors of every
term ``q_c * err_c``. Values are stored centred, ``v' = v - m_v``, and
``m_v`` is added back to the output (the probabilities sum to 1, so
``sum p_i v_i = m_v + sum p_i v'_i``). A layer whose scores are softcapped
keeps ``m = 0``: tanh does not ignore a constant.

The vectors are fixed per layer (``fit``, from one calibration prompt run
when the cache is made: ``runner/kv_calibration.py``), so a token's stored
bits depend on its own K/V only (prefix caching, copy-on-write and batch
invariance unchanged), and every attention backend reads the transformed
rows as they are: the transform lives in the model's Python, before the
K/V write and after attention, and a traced decode step records it.
Until ``fit`` the transform is the identity and adds no op.
"""

from __future__ import annotations

import torch
from torch import nn

# s_c = (std(k_c) / rms(q_c)) ** _SCALE_EXPONENT; 0.5 (balance) and 0.25 measured alike (docs/configuration.md)
_SCALE_EXPONENT = 0.5
# channel statistics below this fraction of the head's largest count as this fraction (no division by ~0)
_FLOOR = 1e-3


class KvStats:
    """Running float64 sums of one layer's q, k and v over a calibration prompt, per KV head and channel."""

    def __init__(self, num_kv_heads: int, head_dim: int) -> None:
        shape = (num_kv_heads, head_dim)
        self.num_tokens = 0
        self.k_sum = torch.zeros(shape, dtype=torch.float64)
        self.k_sq = torch.zeros(shape, dtype=torch.float64)
        self.q_sq = torch.zeros(shape, dtype=torch.float64)  # summed over the group's query heads
        self.v_sum = torch.zeros(shape, dtype=torch.float64)
        self.group = 0

    def add(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Fold in ``q`` ``[T, heads, d]``, ``k``/``v`` ``[T, kv_heads, d]``."""
        num_tokens, num_kv_heads, head_dim = k.shape
        self.group = q.shape[1] // num_kv_heads
        qg = q.detach().double().reshape(num_tokens, num_kv_heads, self.group, head_dim)
        self.q_sq += qg.square().sum(dim=(0, 2))
        k64, v64 = k.detach().double(), v.detach().double()
        self.k_sum += k64.sum(0)
        self.k_sq += k64.square().sum(0)
        self.v_sum += v64.sum(0)
        self.num_tokens += num_tokens


class KvTransform(nn.Module):
    """``k' = (k - m) / s``, ``q' = q * s``, ``v' = v - m_v`` and ``out + m_v`` for one attention layer.

    ``shift_keys=False`` (softcapped scores) keeps ``m = 0``. Inactive (the
    identity, no op) until ``fit``; ``record`` makes ``encode`` gather the
    statistics ``fit`` needs (see the module docstring).
    """

    def __init__(self, num_kv_heads: int, head_dim: int, shift_keys: bool = True) -> None:
        super().__init__()
        self.num_kv_heads, self.head_dim, self.shift_keys = num_kv_heads, head_dim, shift_keys
        self.active = False
        self.stats: KvStats | None = None
        # [kv_heads, head_dim] each; q_scale and out_shift are repeated over the query heads at fit time
        self.register_buffer("k_mul", torch.ones(num_kv_heads, head_dim), persistent=False)
        self.register_buffer("k_add", torch.zeros(num_kv_heads, head_dim), persistent=False)
        self.register_buffer("v_shift", torch.zeros(num_kv_heads, head_dim), persistent=False)
        self.register_buffer("q_scale", torch.ones(num_kv_heads, head_dim), persistent=False)
        self.register_buffer("out_shift", torch.zeros(num_kv_heads, head_dim), persistent=False)

    def record(self) -> None:
        """Gather statistics from the next ``encode`` calls (the transform stays the identity)."""
        if self.active:
            raise ValueError("this layer's KV transform is fitted already")
        self.stats = KvStats(self.num_kv_heads, self.head_dim)

    def encode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The query, K and V as the cache stores and attention reads them."""
        if self.stats is not None:
            self.stats.add(q, k, v)
        if not self.active:
            return q, k, v
        q = q * self.q_scale  # [T, heads, d] * [heads, d]
        k = torch.addcmul(self.k_add, k, self.k_mul)  # (k - m) / s as k * (1/s) + (-m/s)
        v = v - self.v_shift
        return q, k, v

    def decode(self, out: torch.Tensor) -> torch.Tensor:
        """Attention's output ``[T, heads, d]`` with the values' mean added back."""
        return out + self.out_shift if self.active else out

    def fit(self) -> None:
        """Set the vectors from the recorded statistics (module docstring) and activate."""
        stats = self.stats
        if stats is None or stats.num_tokens == 0:
            raise ValueError("KvTransform.fit needs record() and at least one encode() first")
        n = stats.num_tokens
        k_mean = stats.k_sum / n
        k_std = (stats.k_sq / n - k_mean.square()).clamp_min(0).sqrt()
        q_rms = (stats.q_sq / (n * stats.group)).sqrt()
        k_std = k_std.clamp_min(_FLOOR * k_std.amax(dim=-1, keepdim=True).clamp_min(1e-30))
        q_rms = q_rms.clamp_min(_FLOOR * q_rms.amax(dim=-1, keepdim=True).clamp_min(1e-30))
        s = (k_std / q_rms) ** _SCALE_EXPONENT
        s = s / s.log().mean(dim=-1, keepdim=True).exp()  # geometric mean 1 per head: magnitudes as before
        m = k_mean if self.shift_keys else torch.zeros_like(k_mean)
        self.k_mul.copy_(1.0 / s)
        self.k_add.copy_(-m / s)
        self.v_shift.copy_(stats.v_sum / n)
        self.q_scale = s.repeat_interleave(stats.group, dim=0).to(self.k_mul)  # [heads, d], the buffers' dtype
        self.out_shift = self.v_shift.repeat_interleave(stats.group, dim=0)  # [heads, d]
        self.stats = None
        self.active = True
