"""Paged attention: write new K/V through the slot mapping, read through block tables.

The KV cache of one layer is a pair of tensors ``[num_blocks, block_size,
num_kv_heads, head_dim]``. Viewed flat, ``[num_blocks * block_size, ...]``,
slot ``s`` is row ``s``: the slot mapping says where each new token's K/V
goes, and a sequence's block table says which blocks hold its context::

    block_table [7, 2]   block_size 4   context of 6 tokens
    cache rows:  7*4+0 .. 7*4+3 (tokens 0-3), 2*4+0 .. 2*4+1 (tokens 4-5)

Three backends share one interface: ``ReferenceAttention`` (per sequence,
plain torch, easy to check), ``SdpaAttention`` (decodes batched through torch
SDPA on a gathered copy of the context) and ``CpuPagedAttention`` (decodes
read the blocks in place with a native kernel). Tests compare them on
scattered block tables.

The cache may hold a narrower dtype than the model computes in
(``EngineConfig.kv_cache_dtype``): new K/V are rounded to it when written
and widened back to the queries' dtype when read; attention itself runs in
the model's dtype. Prompts computed from scratch attend over their new K/V
without reading the cache, so those are rounded the same way first
(``as_stored``): every path sees a token's K/V exactly as the cache holds
it, and a prompt gives the same result whole or in chunks. An int8 cache
(``kv_cache_dtype="int8"``) holds each head's values with one scale per
token, an int4 one (``"int4"``, a uint8 tensor) Hadamard-rotated nibbles
with one scale per token, an fp8 one (``"fp8"``, ``"fp8_e4m3"``,
``"fp8_e5m2"``) int8's layout with fp8 values (``layers/kv_quant.py``); the
native kernels read them in place, the torch paths dequantize what they
gather.

Two per-layer options change which scores count (``forward``'s keywords):
``sliding_window=w`` lets the query at position ``i`` see only keys at
``i - w < j <= i`` (transformers' sliding-window mask), and ``softcap=c``
bounds every score by ``c * tanh(score / c)`` before the mask (Gemma's
``attn_logit_softcapping``). A window is a mask only: the cache keeps
every block of the sequence, out-of-window ones included. SDPA takes no
softcap, so softcapped scores go through an explicit softmax
(``explicit_attention``); ``CpuPagedAttention``'s kernels know neither
option yet and hand such layers to the SDPA path.

A third, ``sinks`` (a float tensor ``[num_heads]``, gpt-oss's attention
sinks), adds one learned logit per query head to the softmax's denominator:
``p_j = exp(s_j) / (sum_t exp(s_t) + exp(sink))``, a term that weights no
value, so a head may attend to "nothing" (transformers concatenates the
sink to the scores, takes the softmax and drops its column). SDPA takes
none, so torch paths with sinks use the explicit softmax; the native
kernels take them, and start each softmax's max and sum with the sink.
"""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from pagedllm.layers.kv_quant import (
    QUANTIZED_CACHE_DTYPES,
    indexable,
    quantize_heads,
    stored_values,
)


@dataclass(frozen=True)
class AttentionMetadata:
    """Per-step addressing, built on the CPU by the model runner.

    Sequences are ordered prefills first, then decodes; sequence ``i`` owns
    batch tokens ``query_start_loc[i] .. query_start_loc[i+1]-1``, which sit at
    positions ``num_computed[i] .. seq_lens[i]-1`` of that sequence.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: flat cache slot per new token
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int64, padded with 0
    seq_lens_tensor: torch.Tensor  # [num_seqs] int64: context length after this step
    query_start_loc: list[int]  # [num_seqs + 1]
    seq_lens: list[int]  # [num_seqs]
    num_computed: list[int]  # [num_seqs]: tokens whose K/V was cached before this step
    num_prefills: int  # sequences [0, num_prefills) are prefills
    block_size: int
    # KV cache groups (kv_groups.py): each group's own metadata (its block tables and slots), and the
    # group of each layer; None: one group, this metadata itself
    group_metas: tuple[AttentionMetadata, ...] | None = None
    layer_groups: tuple[int, ...] = ()

    def for_layer(self, layer: int) -> AttentionMetadata:
        """The metadata layer ``layer`` reads: its KV cache group's."""
        return self if self.group_metas is None else self.group_metas[self.layer_groups[layer]]
    # a hybrid model's state layers (docs/hybrid-models.md); None for a model without them
    state_slots: torch.Tensor | None = None  # [num_seqs] int64: each sequence's state slot
    # [num_seqs] bool: False where the sequence computes from position 0 (its state starts at zero)
    has_initial_state: torch.Tensor | None = None

    def __post_init__(self) -> None:
        # checked once per step, here, rather than in every layer: native
        # kernels trust these tensors with raw pointers
        if self.block_tables.dtype != torch.int64 or self.seq_lens_tensor.dtype != torch.int64:
            raise ValueError("block_tables and seq_lens_tensor must be int64")
        if self.seq_lens and max(self.seq_lens) > self.block_tables.shape[1] * self.block_size:
            raise ValueError("a sequence is longer than its block table")

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def first_decode_token(self) -> int | None:
        """The batch row of the first decode token (None: no decodes)."""
        return self.query_start_loc[self.num_prefills] if self.num_seqs > self.num_prefills else None


@dataclass(frozen=True)
class DecodeMetadata:
    """A decode-only step's addressing, tensors only: one new token per sequence, row ``i`` sequence ``i``.

    What a traced decode step reads (``runner/capture/captured_decode.py``): the
    step's row count is the tensors' first dimension, which the trace keeps
    a symbol, and nothing of the step reaches Python. The decode paths that
    size their work from Python lengths (SDPA's gather, the reference) read
    fields this class does not have, and so cannot be traced.
    """

    slot_mapping: torch.Tensor  # [num_seqs] int64: flat cache slot per new token
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int64
    seq_lens_tensor: torch.Tensor  # [num_seqs] int64: context length after this step
    block_size: int
    num_prefills: ClassVar[int] = 0
    first_decode_token: ClassVar[int] = 0
    # KV cache groups: each group's own metadata and each layer's group (AttentionMetadata's)
    group_metas: tuple[DecodeMetadata, ...] | None = None
    layer_groups: tuple[int, ...] = ()
    # a hybrid model's state layers: each sequence's state slot, which it continues (a decode row always
    # continues its state: a step with a sequence starting from zero is not captured)
    state_slots: torch.Tensor | None = None  # [num_seqs] int64

    def for_layer(self, layer: int) -> DecodeMetadata:
        """The metadata layer ``layer`` reads: its KV cache group's."""
        return self if self.group_metas is None else self.group_metas[self.layer_groups[layer]]


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded to a cache of ``dtype``; float16 saturates at +-65504 first.

    An inf in the cache would stay in its slot after the block is freed, and
    a padded read (SDPA's gather) turns even a masked inf into NaN.
    """
    if dtype == torch.float16 and x.dtype != torch.float16:
        x = x.clamp(-65504.0, 65504.0)
    return x.to(dtype)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter new K/V ``[num_tokens, num_kv_heads, head_dim]`` into their slots (rounded to the cache's dtype;
    an int8, int4 or fp8 cache's rows quantized with their scales)."""
    num_kv_heads = k.shape[1]
    if k_cache.dtype in QUANTIZED_CACHE_DTYPES:
        k_rows, v_rows = quantize_heads(k, k_cache.dtype, keys=True), quantize_heads(v, v_cache.dtype)
    else:
        k_rows, v_rows = to_cache_dtype(k, k_cache.dtype), to_cache_dtype(v, v_cache.dtype)
    k_cache, v_cache, k_rows, v_rows = (indexable(t) for t in (k_cache, v_cache, k_rows, v_rows))
    k_cache.view(-1, num_kv_heads, k_cache.shape[-1]).index_copy_(0, slot_mapping, k_rows)
    v_cache.view(-1, num_kv_heads, v_cache.shape[-1]).index_copy_(0, slot_mapping, v_rows)


def as_stored(x: torch.Tensor, cache: torch.Tensor, keys: bool = False) -> torch.Tensor:
    """``x`` as the cache holds it (rounded to the cache's dtype, or int8 / int4 / fp8-quantized), back in ``x``'s
    dtype; ``keys``: ``x`` holds K rows (an int4 cache quantizes them with a searched scale)."""
    if cache.dtype in QUANTIZED_CACHE_DTYPES:
        return stored_values(quantize_heads(x, cache.dtype, keys)).to(x.dtype)
    return x if cache.dtype == x.dtype else to_cache_dtype(x, cache.dtype).to(x.dtype)


def visible_keys(q_pos: torch.Tensor, seq_len: int, sliding_window: int | None) -> torch.Tensor:
    """Which keys each query sees: ``[q_len, seq_len]`` bool for queries at positions ``q_pos`` ``[q_len]``.

    Causal (``j <= i``) and, with a window ``w``, ``j > i - w``, as
    transformers' ``sliding_window_overlay``.
    """
    k_pos = torch.arange(seq_len, device=q_pos.device).unsqueeze(0)  # [1, seq_len]
    q_pos = q_pos.unsqueeze(1)  # [q_len, 1]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


def explicit_attention(
    q: torch.Tensor,  # [..., heads, q_len, head_dim]
    k: torch.Tensor,  # [..., heads, kv_len, head_dim]
    v: torch.Tensor,  # [..., heads, kv_len, head_dim]
    mask: torch.Tensor,  # bool, broadcastable to [..., heads, q_len, kv_len]; True: attend
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,  # [heads]
) -> torch.Tensor:  # [..., heads, q_len, head_dim]
    """Softmax attention written out, for what SDPA cannot do (a softcap on the scores, attention sinks).

    As transformers' eager attention: scores in the queries' dtype, capped,
    masked, softmax in float32 (with each head's sink in the denominator),
    probabilities back in the queries' dtype.
    """
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = sink_softmax(scores.float(), sinks).to(q.dtype)
    return torch.matmul(probs, v)


def sink_softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dimension of ``scores`` ``[..., heads, q_len, kv_len]``, each head's sink logit
    (``sinks`` ``[heads]``, None: none) one more term of its denominator; in ``scores``' dtype."""
    if sinks is None:
        return scores.softmax(dim=-1)
    sink = sinks.to(scores.dtype).view(-1, 1, 1).expand(*scores.shape[:-1], 1)
    # the sink as one more column, dropped after the softmax (a column of its own keeps the max shift exact)
    return torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]


def gather_context(
    cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, block_size: int
) -> torch.Tensor:
    """K or V of one sequence's first ``seq_len`` tokens: [seq_len, num_kv_heads, head_dim] (an int8
    or int4 cache's dequantized to float32)."""
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks]]  # [num_blocks, block_size, kv_heads, head_dim]
    return stored_values(blocks.flatten(0, 1)[:seq_len])


# the cache dtypes the native kernels read and write
_NATIVE_CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, *QUANTIZED_CACHE_DTYPES)
# cache pairs CpuPagedAttention remembers before it drops the entries of freed ones
_CACHE_VERDICTS_PRUNE_AT = 256


def native_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the native ops can read and write this K/V cache pair: CPU, one native dtype, contiguous."""
    return (
        k_cache.device.type == "cpu"
        and v_cache.device.type == "cpu"
        and k_cache.dtype in _NATIVE_CACHE_DTYPES
        and v_cache.dtype == k_cache.dtype
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
    )


class AttentionBackend(ABC):
    """Computes attention for a batch of sequences over the paged cache."""

    name: str

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write the new K/V, then attend; ``sliding_window`` / ``softcap`` / ``sinks``: see the module docstring."""
        # every new token's K/V goes in first, so queries later in the batch
        # (and other sequences sharing a cached prefix) can read it
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.num_prefills:
            k, v = as_stored(k, k_cache, keys=True), as_stored(v, v_cache)
        return self.attend(q, k, v, k_cache, v_cache, meta, scale, sliding_window=sliding_window, softcap=softcap,
                           sinks=sinks)

    @abstractmethod
    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


class ReferenceAttention(AttentionBackend):
    """One sequence at a time, explicit softmax: the path to check others against."""

    name = "reference"

    def attend(self, q, k, v, k_cache, v_cache, meta, scale, *, sliding_window=None, softcap=None,  # noqa: ANN001, ANN201
               sinks=None):
        out = torch.empty_like(q)
        group = q.shape[1] // k_cache.shape[2]
        for i in range(meta.num_seqs):
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            seq_len, num_computed = meta.seq_lens[i], meta.num_computed[i]
            keys = gather_context(k_cache, meta.block_tables[i], seq_len, meta.block_size)
            values = gather_context(v_cache, meta.block_tables[i], seq_len, meta.block_size)
            keys = keys.repeat_interleave(group, dim=1)  # [seq_len, num_heads, head_dim]
            values = values.repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), keys.float()) * scale
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            q_pos = torch.arange(num_computed, seq_len, device=q.device)
            scores = scores.masked_fill(~visible_keys(q_pos, seq_len, sliding_window), float("-inf"))
            probs = sink_softmax(scores, sinks)
            out[start:end] = torch.einsum("hqk,khd->qhd", probs, values.float()).to(q.dtype)
        return out


class SdpaAttention(AttentionBackend):
    """Prefills one by one, all decodes in one batched call, via torch SDPA.

    The decode path gathers each sequence's blocks into a padded contiguous
    tensor first (``k_cache[block_tables]``): simple and device-agnostic, but
    a copy of every context in every layer at every step.

    A layer with a sliding window or a softcap runs the prefills of this
    class (``_prefill_one``), never a subclass's ``_prefills``, which may be
    a native kernel that knows neither option (``CpuPagedAttention``).
    Decodes with a window go to ``_decodes`` (a subclass's kernel must take
    the window); with a softcap, to this class's ``_sdpa_decodes``.
    """

    name = "sdpa"

    def attend(self, q, k, v, k_cache, v_cache, meta, scale, *, sliding_window=None, softcap=None,  # noqa: ANN001, ANN201
               sinks=None):
        out = torch.empty_like(q)
        if sliding_window is None and softcap is None:
            self._prefills(q, k, v, k_cache, v_cache, meta, scale, out, sinks)
        else:
            for i in range(meta.num_prefills):
                self._prefill_one(i, q, k, v, k_cache, v_cache, meta, scale, out, sliding_window, softcap, sinks)
        first = meta.first_decode_token
        if first is not None:
            if softcap is None:
                self._decodes(q[first:], k_cache, v_cache, meta, scale, out[first:], sliding_window, sinks)
            else:
                self._sdpa_decodes(q[first:], k_cache, v_cache, meta, scale, out[first:], sliding_window, softcap,
                                   sinks)
        return out

    def _prefills(self, q, k, v, k_cache, v_cache, meta, scale, out, sinks=None) -> None:  # noqa: ANN001
        for i in range(meta.num_prefills):
            self._prefill_one(i, q, k, v, k_cache, v_cache, meta, scale, out, sinks=sinks)

    def _prefill_one(  # noqa: ANN001
        self, i, q, k, v, k_cache, v_cache, meta, scale, out, sliding_window=None, softcap=None, sinks=None,
    ) -> None:
        """Prefill sequence ``i`` through torch SDPA (an explicit softmax for softcapped scores or sinks)."""
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        seq_len, num_computed = meta.seq_lens[i], meta.num_computed[i]
        qi = q[start:end].transpose(0, 1)  # [num_heads, q_len, head_dim]
        if num_computed == 0:
            # nothing cached before: the new K/V is the whole context
            ki, vi = k[start:end], v[start:end]
        else:
            ki = gather_context(k_cache, meta.block_tables[i], seq_len, meta.block_size).to(q.dtype)
            vi = gather_context(v_cache, meta.block_tables[i], seq_len, meta.block_size).to(q.dtype)
        explicit = softcap is not None or sinks is not None  # what SDPA cannot do
        mask = None  # plain causal over fresh K/V: SDPA's is_causal, no mask tensor
        if num_computed or sliding_window is not None or explicit:
            # [q_len, seq_len]: a query sees keys up to its own position, within its window
            mask = visible_keys(torch.arange(num_computed, seq_len, device=q.device), seq_len, sliding_window)
        group = q.shape[1] // ki.shape[1]
        if group > 1 and (q.device.type == "cpu" or explicit):
            # K/V heads repeated for the query heads that share them: SDPA with
            # enable_gqa takes torch's slow math path on the CPU, this its fused kernel
            ki, vi = ki.repeat_interleave(group, dim=1), vi.repeat_interleave(group, dim=1)
        if explicit:
            out[start:end] = explicit_attention(
                qi, ki.transpose(0, 1), vi.transpose(0, 1), mask, scale, softcap, sinks
            ).transpose(0, 1)  # [num_heads, q_len, head_dim] -> [q_len, num_heads, head_dim]
            return
        out[start:end] = F.scaled_dot_product_attention(
            qi.unsqueeze(0), ki.transpose(0, 1).unsqueeze(0), vi.transpose(0, 1).unsqueeze(0),
            attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=ki.shape[1] != q.shape[1],
        )[0].transpose(0, 1)  # [1, num_heads, q_len, head_dim] -> [q_len, num_heads, head_dim]

    def _decodes(self, q, k_cache, v_cache, meta, scale, out, sliding_window=None, sinks=None) -> None:  # noqa: ANN001
        """One new token per sequence ``meta.num_prefills ..``; ``q``/``out`` are ``[B, num_heads, head_dim]``."""
        self._sdpa_decodes(q, k_cache, v_cache, meta, scale, out, sliding_window, sinks=sinks)

    def _sdpa_decodes(  # noqa: ANN001
        self, q, k_cache, v_cache, meta, scale, out, sliding_window=None, softcap=None, sinks=None,
    ) -> None:
        """``_decodes`` through SDPA, with an optional window, softcap and sinks (see ``attend``)."""
        tables = meta.block_tables[meta.num_prefills :]  # [B, max_blocks]
        seq_lens = meta.seq_lens_tensor[meta.num_prefills :]  # [B]
        max_blocks = (max(meta.seq_lens[meta.num_prefills :]) + meta.block_size - 1) // meta.block_size
        tables = tables[:, :max_blocks]
        # [B, max_blocks * block_size, kv_heads, head_dim] -> [B, kv_heads, L, head_dim]
        keys = stored_values(k_cache[tables]).flatten(1, 2).transpose(1, 2).to(q.dtype)
        values = stored_values(v_cache[tables]).flatten(1, 2).transpose(1, 2).to(q.dtype)
        length = keys.shape[2]
        k_pos = torch.arange(length, device=q.device).unsqueeze(0)  # [1, L]
        # each query sits at position seq_len - 1: keys before seq_len, and within the window
        mask = k_pos < seq_lens.unsqueeze(1)  # [B, L]
        if sliding_window is not None:
            mask &= k_pos >= seq_lens.unsqueeze(1) - sliding_window
        mask = mask[:, None, None, :]  # [B, 1, 1, L]
        if softcap is not None or sinks is not None:
            group = q.shape[1] // keys.shape[1]
            keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
            out[:] = explicit_attention(q.unsqueeze(2), keys, values, mask, scale, softcap, sinks).squeeze(2)
            return
        out[:] = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        ).squeeze(2)


class CpuPagedAttention(SdpaAttention):
    """Native kernels for decodes and for prompts computed from scratch; SDPA for the rest.

    The decode kernel (``kernels/attention/paged_decode.cpp``) walks each sequence's
    block table and never copies the context, which is where the SDPA
    backend spends its decode time on the CPU. Prompts with nothing cached
    attend over their own new K/V rows, all of them in one call
    (``kernels/attention/prefill_attention.cpp``); prompts that continue cached context
    (prefix-cache hits, chunked prefills), and every prompt under
    ``batch_invariant``, read it in place in the decode kernel's order, all of
    them in one call (``kernels/attention/paged_prefill.cpp``). Float32 queries on the CPU; the cache may be float32, float16,
    bfloat16, int8, int4 or fp8 (values and per-head scales, read in place and widened in registers).

    The decode kernel takes a sliding window (it starts each sequence at the
    block holding its window's first key and masks the keys before it); the
    prefill kernels take neither a window nor a softcap, so windowed prompts
    go through SDPA (the explicit softmax with sinks), and so does everything
    in a softcapped layer (only the K/V write staying native). Every native
    kernel takes attention sinks (a float32 ``[num_heads]`` tensor).

    Whether a cache pair suits the native ops (``native_caches``) is
    decided on the pair's first use and remembered: a cache's dtype, device
    and layout are fixed when it is allocated. A pair that does not suit
    them is written and read the base class's way. New K/V must be float32
    CPU rows of whole, contiguous heads (the model's slices of its fused
    qkv); the native write checks that, and a slot outside the cache,
    itself (ValueError).
    """

    name = "cpu_paged"
    def __init__(self, batch_invariant: bool = False) -> None:
        # EngineConfig.batch_invariant, resolved: every prompt token through paged_prefill
        self.batch_invariant = batch_invariant
        from pagedllm.kernels import kernels_failure, load_kernels

        ops = load_kernels()
        if ops is None:
            raise ValueError(f"the cpu_paged attention backend cannot be built here: {kernels_failure()}")
        self._ops = ops  # torch.ops.pagedllm
        # (id(k_cache), id(v_cache)) -> (the caches, weakly, whether native_caches holds for them); weak
        # references so that an id reused by a later tensor is never taken for the old cache's
        self._cache_verdicts: dict[tuple[int, int], tuple[weakref.ref, weakref.ref, bool]] = {}

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, *, sliding_window=None, softcap=None,  # noqa: ANN001, ANN201
                sinks=None):
        options = {"sliding_window": sliding_window, "softcap": softcap, "sinks": sinks}
        if not self._native_caches(k_cache, v_cache):
            return super().forward(q, k, v, k_cache, v_cache, meta, scale, **options)
        # as the base class, with the K/V write as one native op (two
        # index_copy_ calls otherwise; 0.24 s of the throughput workload)
        self._ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping.contiguous())
        if meta.num_prefills:
            k, v = as_stored(k, k_cache, keys=True), as_stored(v, v_cache)
        return self.attend(q, k, v, k_cache, v_cache, meta, scale, **options)

    def _native_caches(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        """``native_caches(k_cache, v_cache)``, computed on the pair's first use and remembered."""
        key = (id(k_cache), id(v_cache))
        known = self._cache_verdicts.get(key)
        if known is not None and known[0]() is k_cache and known[1]() is v_cache:
            return known[2]
        if len(self._cache_verdicts) >= _CACHE_VERDICTS_PRUNE_AT:
            # forget freed caches (tests make many; an engine's stay for its lifetime)
            self._cache_verdicts = {
                pair: entry for pair, entry in self._cache_verdicts.items()
                if entry[0]() is not None and entry[1]() is not None
            }
        verdict = native_caches(k_cache, v_cache)
        self._cache_verdicts[key] = (weakref.ref(k_cache), weakref.ref(v_cache), verdict)
        return verdict

    def _prefills(self, q, k, v, k_cache, v_cache, meta, scale, out, sinks=None) -> None:  # noqa: ANN001
        # Prompts that continue cached context (a later chunk, a prefix-cache hit, a recompute after
        # preemption) read it in place, through their block tables (paged_prefill); with batch_invariant
        # every prompt does, so that a token's attention has the decode kernel's bits whichever step
        # computes it (docs/batch-invariance.md). Otherwise prompts computed from scratch read their K/V
        # from this step's rows, tiled (prefill_attention): the same products, summed in another order.
        fresh = [] if self.batch_invariant else [i for i in range(meta.num_prefills) if meta.num_computed[i] == 0]
        paged = [i for i in range(meta.num_prefills) if not fresh or meta.num_computed[i] != 0]
        if paged:
            self._paged_prefills(paged, q, k_cache, v_cache, meta, scale, out, sinks)
        if not fresh:
            return
        bounds = torch.tensor(
            [b for i in fresh for b in (meta.query_start_loc[i], meta.query_start_loc[i + 1])], dtype=torch.int64
        )  # [2 * num_fresh]: each prompt's first and one-past-last row
        # the op checks dtypes, head layout and bounds (ValueError)
        self._ops.prefill_attention(q, k, v, out, bounds, scale, sinks)

    def _paged_prefills(self, prompts, q, k_cache, v_cache, meta, scale, out, sinks=None) -> None:  # noqa: ANN001
        """Prompts ``prompts`` (indices of prefills) attending to the cache in place, all in one native call.

        The token at position ``p`` reads keys ``0 .. p`` through its prompt's
        block table (its own K/V were written before ``attend``), with the
        decode kernel's reduction order (``kernels/attention/paged_prefill.cpp``). Gathering
        the context instead (the parent's SDPA path) copies every cached row in
        every layer for every chunk: at 4k tokens of context that copy made a
        16-token chunk of a long prompt cost twice as much per token as a
        2,048-token one, and so capped how finely a prompt can be chunked
        among running streams (``engine/step_budget.py``).
        """
        if k_cache.dim() == 4 and k_cache.shape[1] != meta.block_size:
            raise ValueError(f"cpu_paged: a cache of {tuple(k_cache.shape)} does not have block_size {meta.block_size}")
        bounds = torch.tensor(
            [b for i in prompts for b in (meta.query_start_loc[i], meta.query_start_loc[i + 1])], dtype=torch.int64
        )  # [2 * num_prompts]: each prompt's first and one-past-last row
        if len(prompts) == meta.num_prefills:
            tables, seq_lens = meta.block_tables[: meta.num_prefills], meta.seq_lens_tensor[: meta.num_prefills]
        else:
            index = torch.tensor(prompts, dtype=torch.int64)
            tables, seq_lens = meta.block_tables[index], meta.seq_lens_tensor[index]
        # q and out may be views with a row stride (slices of the fused qkv); the op checks them, the bounds,
        # every length against its table and every block read (ValueError)
        self._ops.paged_prefill(q, k_cache, v_cache, tables, bounds, seq_lens.contiguous(), scale, out, sinks)

    def _decodes(self, q, k_cache, v_cache, meta, scale, out, sliding_window=None, sinks=None) -> None:  # noqa: ANN001
        # the op checks the tensors and every block a sequence reads (ValueError);
        # the block size the metadata was built for is known only here
        if k_cache.dim() == 4 and k_cache.shape[1] != meta.block_size:
            raise ValueError(f"cpu_paged: a cache of {tuple(k_cache.shape)} does not have block_size {meta.block_size}")
        q = q.contiguous()
        result = out if out.is_contiguous() and out.dtype == q.dtype else torch.empty_like(q)
        tables = meta.block_tables[meta.num_prefills :]
        seq_lens = meta.seq_lens_tensor[meta.num_prefills :].contiguous()
        # a window reads each sequence's last sliding_window keys only, from the block that holds the first
        self._ops.paged_decode(q, k_cache, v_cache, tables, seq_lens, scale, result, sliding_window or 0, sinks)
        if result is not out:
            out.copy_(result)


def make_backend(name: str, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 batch_invariant: bool = False) -> AttentionBackend:
    """Backend by its resolved name: "cpu_paged", "sdpa" or "reference" ("auto" is resolved by
    ``resolved_config.resolve_config``); ``batch_invariant``: cpu_paged's mode (``EngineConfig.batch_invariant``)."""
    backends = {"reference": ReferenceAttention, "sdpa": SdpaAttention, "cpu_paged": CpuPagedAttention}
    if name not in backends:
        raise ValueError(f"unknown attention backend {name!r}; choose from {sorted(backends)} "
                         "(\"auto\" is resolved by resolve_config)")
    if name == "cpu_paged" and (device != "cpu" or dtype != torch.float32):
        raise ValueError("the cpu_paged attention backend runs float32 on the CPU only")
    if batch_invariant and name != "cpu_paged":
        raise ValueError(f"batch_invariant needs the cpu_paged attention backend, not {name!r}")
    return CpuPagedAttention(batch_invariant) if name == "cpu_paged" else backends[name]()
