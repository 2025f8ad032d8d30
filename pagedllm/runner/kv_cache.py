"""The KV cache: how many blocks fit, and the one tensor that holds them all.

::

    kv_cache  [2 (K, V), num_kv_layers, num_kv_blocks, block_size, num_kv_heads, head_dim]
    layer i:  (kv_cache[0, r], kv_cache[1, r])   each [num_kv_blocks, block_size, num_kv_heads, head_dim]
              r = kv_cache_rows(config)[i]  (a row of layer i's KV cache group, kv_groups.py)

Only attention layers have a row: a hybrid model's state layers (Gated
DeltaNet, short conv, Mamba-2: ``ModelArchConfig.layer_types``) keep a
per-sequence state instead (``runner/state_cache.py``), so a 3:1 hybrid
reserves K/V for its attention quarter alone. ``kv_cache_rows`` is the one
layer -> row map; a model without state layers has row ``i`` for layer ``i``.

A model with sliding-window layers has KV cache groups (``kv_groups.py``): the second dimension
holds ``num_rows`` rows, and layer ``i`` uses row ``layer_slot(i)[1]`` in the blocks of its group's table.

A model whose layers differ in kv heads or head size (Gemma 4's global
layers) has one shape for all: the most kv heads and the largest head any
layer has (``ModelArchConfig.cache_kv_heads`` / ``cache_head_dim``); a
smaller layer repeats its kv heads and pads its heads with zeros into it.

An int8 or fp8 cache (``kv_cache_dtype="int8"``, ``"fp8*"``) has a last dimension of
``head_dim + 4``: each head's int8 values, then the four bytes of their
float32 scale (``layers/kv_quant.py``). The scales live inside the blocks'
own bytes, so everything that handles whole blocks (copy-on-write's
``copy_blocks``, ``release_kv_blocks``, the lazy mapping, a tensor-parallel
rank's slice of the heads) carries them with no code of its own, and a
kernel finds a row's scale next to its values. An int4 cache
(``kv_cache_dtype="int4"``, a uint8 tensor) is the same with a last
dimension of ``head_dim / 2 + 4`` bytes: rotated nibbles, then the scale.

Never resized: the block manager hands out its block ids, the attention
backends read and write it through block tables and the slot mapping.

On the CPU the tensor lives in an anonymous private mapping the OS backs page
by page on first write, so the process's resident memory follows the blocks
in use, not the pool's size: the default pool, half of the memory the
weights leave (``resolved_config.default_kv_budget``), costs nothing until
requests write into it. The block manager hands out the lowest free ids
first, which keeps the written pages packed at the start of each layer's
slice; when its blocks empty, ``release_kv_blocks`` gives their pages back
(``madvise(MADV_DONTNEED)``: the next write finds them zero-filled again)::

    layer 0 K  [ b0 b1 b2 . . . . . . . . . ]   resident: the blocks written
    layer 0 V  [ b0 b1 b2 . . . . . . . . . ]   . reserved address space only
    ...
"""

from __future__ import annotations

import ctypes
import mmap

import torch

from pagedllm.c_heap import libc
from pagedllm.kv_groups import model_kv_layout
from pagedllm.layers.kv_quant import (
    INT4_SCALE_BYTES,
    INT8_SCALE_BYTES,
    QUANTIZED_CACHE_DTYPES,
    hadamard_block,
)
from pagedllm.loader.model_config import ModelArchConfig

_MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)  # 4 on Linux


def cache_head_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements one head of one token takes in a cache of ``dtype``: ``head_dim``, plus an int8 / fp8 cache's
    scale bytes; an int4 cache (uint8) ``head_dim / 2`` bytes of nibbles and its scale's (ValueError for an odd
    head_dim)."""
    if dtype == torch.uint8:
        hadamard_block(head_dim)  # refuses an odd head_dim
        return head_dim // 2 + INT4_SCALE_BYTES
    return head_dim + INT8_SCALE_BYTES if dtype in QUANTIZED_CACHE_DTYPES else head_dim


def kv_cache_rows(model_config: ModelArchConfig) -> list[int | None]:
    """Each layer's row of the cache tensor's layer dimension (``model_kv_layout``'s: the attention layers in
    order without KV cache groups, a group's row with them), None for a state layer (which has no K/V)."""
    layout = model_kv_layout(model_config)
    return [layout.layer_slot(i)[1] if layout.has_layer(i) else None for i in range(model_config.num_hidden_layers)]


def kv_bytes_per_block(model_config: ModelArchConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across its rows (every layer, or a KV cache group's), K and V (an int8 / int4 cache's
    scales included)."""
    mc = model_config
    elem = torch.tensor([], dtype=dtype).element_size()
    width = cache_head_width(mc.cache_head_dim, dtype)
    return 2 * model_kv_layout(mc).num_rows * block_size * mc.cache_kv_heads * width * elem


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor in an anonymous private mapping: no page is resident until it is written."""
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.tensor([], dtype=dtype).element_size()
    # private, not Python's default shared mapping: MADV_DONTNEED frees a private page
    buf = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # the tensor keeps buf alive (frombuffer holds a reference to it)
    return torch.frombuffer(buf, dtype=dtype, count=numel).view(shape)


def allocate_kv_cache(
    model_config: ModelArchConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, ...]]]:
    """The zero-filled cache tensor and its per-layer (K, V) views (on the CPU, resident only where written);
    a state layer's entry is ``()`` (``runner/state_cache.py`` puts its state tensors there).

    With KV cache groups (``kv_groups.py``) the layer dimension holds one group's rows, and layer ``i``
    views the row ``model_kv_layout(mc).layer_slot(i)`` names: layers of different groups share a row's tensor
    and write disjoint blocks of it (their groups' block tables never hold the same block at once).
    """
    mc = model_config
    layout = model_kv_layout(mc)
    # [2 (K, V), num_rows (the attention layers without groups), num_kv_blocks, block_size, num_kv_heads,
    #  head_dim (+ 4 scale bytes: int8; head_dim / 2 + 4 bytes: int4)]
    shape = (2, layout.num_rows, num_blocks, block_size, mc.cache_kv_heads,
             cache_head_width(mc.cache_head_dim, dtype))
    if device.type == "cpu":
        kv_cache = lazy_zeros(shape, dtype)
    else:
        kv_cache = torch.zeros(shape, dtype=dtype, device=device)
    return kv_cache, [() if r is None else (kv_cache[0, r], kv_cache[1, r]) for r in kv_cache_rows(mc)]


def release_kv_blocks(kv_cache: torch.Tensor, ranges: list[tuple[int, int]]) -> int:
    """Give the OS back the pages of the blocks in ``ranges`` (``[start, stop)`` ids), in every layer's K and V.

    Only whole pages inside a range go (a page shared with a live block
    stays); they read as zeros afterwards. Returns the bytes given back. A
    no-op (0) where the cache is not in such a mapping (a GPU's).
    """
    if kv_cache.device.type != "cpu" or not ranges:
        return 0
    # [2, num_layers, num_kv_blocks, ...]: one slice of num_kv_blocks blocks per (K/V, layer)
    num_slices = kv_cache.shape[0] * kv_cache.shape[1]
    num_blocks = kv_cache.shape[2]
    block_bytes = kv_cache[0, 0, 0].numel() * kv_cache.element_size()
    slice_bytes = num_blocks * block_bytes
    base = kv_cache.data_ptr()
    page = mmap.PAGESIZE
    released = 0
    c = libc()
    for s in range(num_slices):
        for start, stop in ranges:
            lo = base + s * slice_bytes + start * block_bytes
            hi = base + s * slice_bytes + stop * block_bytes
            lo, hi = -(-lo // page) * page, hi // page * page  # whole pages inside the range
            if hi > lo:
                if c.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_DONTNEED) != 0:
                    raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) failed on the KV cache")
                released += hi - lo
    return released


def resident_kv_bytes(kv_cache: torch.Tensor) -> int:
    """Bytes of the cache tensor the OS holds in memory now (``mincore``); its full size where that is unknown."""
    nbytes = kv_cache.numel() * kv_cache.element_size()
    if kv_cache.device.type != "cpu" or nbytes == 0:
        return nbytes
    page = mmap.PAGESIZE
    start = kv_cache.data_ptr() // page * page
    num_pages = -(-(kv_cache.data_ptr() + nbytes - start) // page)
    vec = (ctypes.c_ubyte * num_pages)()
    if libc().mincore(ctypes.c_void_p(start), ctypes.c_size_t(num_pages * page), vec) != 0:
        return nbytes
    # the low bit of each byte says whether that page is resident (the others are reserved)
    return int(torch.frombuffer(vec, dtype=torch.uint8).bitwise_and_(1).sum()) * page
