"""Open the disk prefix cache for an engine: its fingerprint from the config, the model and the runner."""

from __future__ import annotations

from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.kv_disk.fingerprint import kv_fingerprint
from pagedllm.kv_disk.store import DiskBlockStore
from pagedllm.loader.model_config import ModelArchConfig


def open_kv_disk_store(config: EngineConfig, model_config: ModelArchConfig, runner: Any) -> DiskBlockStore | None:
    """The store of ``config.kv_cache_dir`` for the blocks ``runner``'s pool holds, or None when it is unset."""
    if config.kv_cache_dir is None:
        return None
    block_shape = list(runner.kv_cache[:, :, 0].shape)
    runtime = {
        "kv_dtype": str(runner.kv_cache_dtype),
        "block_shape": block_shape,
        "weights": str(runner.dtype),
        "compute": str(runner.compute_dtype),
        "weight_format": runner.weight_format,
        "linear_backend": runner.linear_backend,
        "attention_backend": runner.resolved.attention_backend,
        "batch_invariant": runner.resolved.batch_invariant,
        "device": runner.device.type,
    }
    fingerprint = kv_fingerprint(config, model_config, runtime)
    payload_bytes = runner.kv_cache[:, :, 0].numel() * runner.kv_cache.element_size()
    return DiskBlockStore(config.kv_cache_dir, fingerprint, payload_bytes, config.kv_cache_dir_max_bytes)
