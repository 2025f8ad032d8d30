"""Open the disk prefix cache for an engine: its fingerprint from the config, the model and the runner."""

from __future__ import annotations

from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.kv_disk.fingerprint import kv_fingerprint
from pagedllm.kv_disk.store import DiskBlockStore
from pagedllm.loader.model_config import ModelArchConfig


def _runner_fingerprint(config: EngineConfig, model_config: ModelArchConfig, runner: Any) -> dict[str, Any]:
    """The fingerprint of the K/V blocks ``runner``'s pool holds (``kv_disk/fingerprint.py``)."""
    runtime = {
        "kv_dtype": str(runner.kv_cache_dtype),
        "block_shape": list(runner.kv_cache[:, :, 0].shape),
        "weights": str(runner.dtype),
        "compute": str(runner.compute_dtype),
        "weight_format": runner.weight_format,
        "linear_backend": runner.linear_backend,
        "attention_backend": runner.resolved.attention_backend,
        "batch_invariant": runner.resolved.batch_invariant,
        "device": runner.device.type,
    }
    return kv_fingerprint(config, model_config, runtime)


def open_kv_disk_store(config: EngineConfig, model_config: ModelArchConfig, runner: Any) -> DiskBlockStore | None:
    """The store of ``config.kv_cache_dir`` for the blocks ``runner``'s pool holds, or None when it is unset."""
    if config.kv_cache_dir is None:
        return None
    payload_bytes = runner.kv_cache[:, :, 0].numel() * runner.kv_cache.element_size()
    return DiskBlockStore(config.kv_cache_dir, _runner_fingerprint(config, model_config, runner), payload_bytes,
                          config.kv_cache_dir_max_bytes)


def open_state_disk_store(
    config: EngineConfig, model_config: ModelArchConfig, runner: Any
) -> DiskBlockStore | None:
    """A hybrid model's state snapshots in ``config.kv_cache_dir``: a store of their own (a folder of its own
    fingerprint: the K/V one plus the state layers' shapes and dtype, so another layout never reads them),
    files named by the hash of the block each state follows. None when the directory is unset or the model
    has no state layers."""
    if config.kv_cache_dir is None or not runner.state_bytes_per_slot:
        return None
    fingerprint = _runner_fingerprint(config, model_config, runner)
    fingerprint["state"] = {
        "shapes": [None if shapes is None else [list(s) for s in shapes] for shapes in runner.state_shapes],
        "dtype": str(runner.state_dtype),
    }
    return DiskBlockStore(config.kv_cache_dir, fingerprint, runner.state_bytes_per_slot,
                          config.kv_cache_dir_max_bytes)
