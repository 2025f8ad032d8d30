"""The KV cache: how many blocks fit, and the one tensor that holds them all.

::

    kv_cache  [2 (K, V), num_layers, num_kv_blocks, block_size, num_kv_heads, head_dim]
    layer i:  (kv_cache[0, i], kv_cache[1, i])   each [num_kv_blocks, block_size, num_kv_heads, head_dim]

Zero-filled at start-up and never resized: the block manager hands out its
block ids, the attention backends read and write it through block tables
and the slot mapping.
"""

from __future__ import annotations

import torch

from pagedllm.config import EngineConfig
from pagedllm.loader.model_config import ModelArchConfig

# when neither num_kv_blocks nor kv_cache_memory_bytes is given
DEFAULT_KV_SHARE = 0.25
DEFAULT_KV_CAP_BYTES = 2 << 30


def available_memory_bytes(device: torch.device) -> int:
    """Free memory on ``device`` (the GPU's free bytes, or the host's MemAvailable)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 8 << 30


def kv_bytes_per_block(model_config: ModelArchConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V."""
    mc = model_config
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * mc.num_hidden_layers * block_size * mc.num_key_value_heads * mc.head_dim * elem


def default_kv_budget(available_bytes: int, weight_bytes: int) -> int:
    """The pool's budget when none is given: a quarter of the memory the weights leave, at most 2 GiB.

    ``available_bytes`` is measured before the weights are loaded and
    ``weight_bytes`` is what the loaded model holds (``ModelRunner.weight_bytes``),
    so the budget follows the weights' real resident size (int4 blocks leave
    more room than float32 weights) and not whatever the allocator still
    keeps of the float32 tensors that quantizing at load let go.
    """
    return min(int(max(0, available_bytes - weight_bytes) * DEFAULT_KV_SHARE), DEFAULT_KV_CAP_BYTES)


def decide_num_kv_blocks(
    config: EngineConfig, model_config: ModelArchConfig, dtype: torch.dtype, available_bytes: int, weight_bytes: int
) -> int:
    """Blocks in the pool: ``num_kv_blocks`` if given, else what the memory budget holds.

    The budget is ``kv_cache_memory_bytes``, or ``default_kv_budget`` of the
    memory available before loading and the weights' bytes. ValueError when
    the pool cannot hold one sequence of ``max_model_len`` tokens.
    """
    num_blocks = config.num_kv_blocks
    if num_blocks is None:
        budget = config.kv_cache_memory_bytes
        if budget is None:
            budget = default_kv_budget(available_bytes, weight_bytes)
        num_blocks = max(1, budget // kv_bytes_per_block(model_config, config.block_size, dtype))
    min_blocks = (config.max_model_len + config.block_size - 1) // config.block_size
    if num_blocks < min_blocks:
        raise ValueError(
            f"the KV cache has room for {num_blocks} blocks, fewer than one sequence of "
            f"max_model_len={config.max_model_len} needs ({min_blocks}); lower max_model_len or "
            "give the cache more memory"
        )
    return num_blocks


def allocate_kv_cache(
    model_config: ModelArchConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The zero-filled cache tensor and its per-layer (K, V) views."""
    mc = model_config
    # [2 (K, V), num_layers, num_kv_blocks, block_size, num_kv_heads, head_dim]
    kv_cache = torch.zeros(
        2, mc.num_hidden_layers, num_blocks, block_size, mc.num_key_value_heads, mc.head_dim, dtype=dtype, device=device
    )
    return kv_cache, [(kv_cache[0, i], kv_cache[1, i]) for i in range(mc.num_hidden_layers)]
