"""Whole KV blocks as bytes and back: what the prefix cache on disk stores (``kv_disk/store.py``).

A block's bytes are its slice of the pool, every layer's K then V, exactly
as the pool holds them (an int8 / fp8 / int4 cache's scales included)::

    kv_cache  [2, num_layers, num_kv_blocks, block_size, num_kv_heads, width]
    block b   kv_cache[:, :, b]  ->  [2, num_layers, block_size, num_kv_heads, width] as bytes
"""

from __future__ import annotations

import warnings

import torch

from pagedllm.layers.kv_quant import indexable


def block_nbytes(kv_cache: torch.Tensor) -> int:
    """Bytes of one block of ``kv_cache`` (all layers, K and V)."""
    return kv_cache[:, :, 0].numel() * kv_cache.element_size()


def read_block_bytes(kv_cache: torch.Tensor, block_ids: list[int]) -> list[bytes]:
    """The bytes of each block in ``block_ids``, copied out of the pool (the blocks may be reused after)."""
    if not block_ids:
        return []
    cache = indexable(kv_cache)
    idx = torch.tensor(block_ids, dtype=torch.int64, device=cache.device)
    # [2, L, n, ...] -> [n, 2, L, ...]: one contiguous run of bytes per block
    blocks = cache.index_select(2, idx).movedim(2, 0).contiguous().cpu()
    raw = blocks.view(torch.uint8).reshape(len(block_ids), -1).numpy()
    return [row.tobytes() for row in raw]


def write_block_bytes(kv_cache: torch.Tensor, loads: list[tuple[int, bytes]]) -> None:
    """Write each ``(block id, bytes)`` of ``loads`` into the pool (ValueError for bytes of another size)."""
    if not loads:
        return
    size = block_nbytes(kv_cache)
    for block_id, data in loads:
        if len(data) != size:
            raise ValueError(f"block {block_id}: {len(data)} bytes, a block of this pool has {size}")
    cache = indexable(kv_cache)
    shape = cache[:, :, 0].shape
    for block_id, data in loads:
        # one block at a time, straight from the file's bytes: no second copy of a long prompt's blocks
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only bytes: only read here
            src = torch.frombuffer(data, dtype=torch.uint8)
        cache[:, :, block_id].copy_(src.view(cache.dtype).view(shape))
