"""A per-layer change of variables for K and the query that an int4 KV cache quantizes better.

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
attends with ``q' = q * s`` (values are stored as they are):

    q' . k' = q . k - q . m        the same for every key of the query:
                                    softmax(q' . k') = softmax(q . k)

with ``m`` the keys' mean and ``s_c = sqrt(std(k_c) / rms(q_c))`` (the
queries of the KV head's group), which balances the two factors of every
term ``q_c * err_c``. A layer whose scores are softcapped keeps ``m = 0``:
tanh does not ignore a constant; nor does a layer with attention sinks, whose
sink logit is not shifted with the scores. (Centring the values as well, exact too
since the probabilities sum to 1, measured worse: +3.16% perplexity
against +2.62% without, docs/configuration.md.)

The vectors are fixed per layer (``fit``, from one calibration prompt run
when the cache is made: ``runner/kv_calibration.py``), so a token's stored
bits depend on its own K/V only (prefix caching, copy-on-write and batch
invariance unchanged), and every attention backend reads the transformed
rows as they are: the transform lives in the model's Python, before the
K/V write, and a traced decode step records it. With the native ops it is
two in-place ``row_affine_`` calls a layer (q, k), each a step-program
node, so a captured decode step stays one native program; with torch, the
same as in-place torch ops.
Until ``fit`` the transform is the identity and adds no op.
"""

from __future__ import annotations

import torch

from pagedllm.layers.custom_op import CustomOp

# s_c = (std(k_c) / rms(q_c)) ** _SCALE_EXPONENT; 0.5 (balance) and 0.25 measured alike (docs/configuration.md)
_SCALE_EXPONENT = 0.5
# channel statistics below this fraction of the head's largest count as this fraction (no division by ~0)
_FLOOR = 1e-3


class KvStats:
    """Running float64 sums of one layer's q and k over a calibration prompt, per KV head and channel."""

    def __init__(self, num_kv_heads: int, head_dim: int) -> None:
        shape = (num_kv_heads, head_dim)
        self.num_tokens = 0
        self.k_sum = torch.zeros(shape, dtype=torch.float64)
        self.k_sq = torch.zeros(shape, dtype=torch.float64)
        self.q_sq = torch.zeros(shape, dtype=torch.float64)  # summed over the group's query heads
        self.group = 0

    def add(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """Fold in ``q`` ``[T, heads, d]`` and ``k`` ``[T, kv_heads, d]``."""
        num_tokens, num_kv_heads, head_dim = k.shape
        self.group = q.shape[1] // num_kv_heads
        qg = q.detach().double().reshape(num_tokens, num_kv_heads, self.group, head_dim)
        self.q_sq += qg.square().sum(dim=(0, 2))
        k64 = k.detach().double()
        self.k_sum += k64.sum(0)
        self.k_sq += k64.square().sum(0)
        self.num_tokens += num_tokens


class KvTransform(CustomOp):
    """``k' = (k - m) / s`` and ``q' = q * s`` for one attention layer.

    ``shift_keys=False`` (softcapped scores, attention sinks) keeps ``m = 0``. Inactive (the
    identity, no op) until ``fit``; ``record`` makes ``encode`` gather the
    statistics ``fit`` needs (see the module docstring). ``encode`` works in
    place on its arguments (views of the layer's qkv rows) and returns them.
    """

    def __init__(self, num_kv_heads: int, head_dim: int, shift_keys: bool = True) -> None:
        super().__init__()
        self.num_kv_heads, self.head_dim, self.shift_keys = num_kv_heads, head_dim, shift_keys
        self.active = False
        self.stats: KvStats | None = None
        # fit registers the buffers (the model's loader leaves buffers made at construction uninitialised,
        # and a transform that is never fitted holds none): k_mul, k_add [kv_heads, d]; their rows as the
        # in-place op takes them, q_mul_row [heads * d], k_mul_row and k_add_row [kv_heads * d]
        self.dtype = torch.float32

    def record(self) -> None:
        """Gather statistics from the next ``encode`` calls (the transform stays the identity)."""
        if self.active:
            raise ValueError("this layer's KV transform is fitted already")
        self.stats = KvStats(self.num_kv_heads, self.head_dim)

    def encode(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The query ``[T, heads, d]`` and K ``[T, kv_heads, d]`` as attention reads and the cache stores them,
        changed in place."""
        if self.stats is not None:
            self.stats.add(q, k)
        if not self.active:
            return q, k
        self._affine(q, self.q_mul_row, None)
        self._affine(k, self.k_mul_row, self.k_add_row)  # (k - m) / s as k * (1/s) + (-m/s)
        return q, k

    def _affine(self, x: torch.Tensor, mul: torch.Tensor | None, add: torch.Tensor | None) -> None:
        """``x`` ``[T, heads, d]`` ``= x * mul + add`` per row (``mul``/``add`` ``[heads * d]``), in place."""
        heads_adjacent = x.stride(2) == 1 and x.stride(1) == x.shape[2]  # each row's heads one run of floats
        if self.native is not None and heads_adjacent:
            self.native.row_affine_(x.flatten(1), mul, add)  # [T, heads * d], a view of x
            return
        shape = x.shape[1:]
        if mul is not None:
            x.mul_(mul.view(shape))
        if add is not None:
            x.add_(add.view(shape))

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
        rows = {
            "k_mul": 1.0 / s, "k_add": -m / s,  # [kv_heads, d]
            "q_mul_row": s.repeat_interleave(stats.group, dim=0).flatten(),  # [heads * d]
            "k_mul_row": (1.0 / s).flatten(), "k_add_row": (-m / s).flatten(),  # [kv_heads * d]
        }
        for name, value in rows.items():
            self.register_buffer(name, value.to(self.dtype), persistent=False)
        self.stats = None
        self.active = True
