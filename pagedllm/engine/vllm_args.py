"""vLLM's ``LLM(...)`` arguments that are not ``EngineConfig`` fields, turned into what they mean here.

A vLLM script passes ``dtype="auto"``, ``gpu_memory_utilization=0.9`` and
``trust_remote_code=True`` as a matter of routine; ``LLM`` takes them
(docs/coming-from-vllm.md):

- ``dtype="auto"``: the dtype the engine picks when none is given, float32
  (``EngineConfig.dtype``'s default): pagedllm converts every checkpoint's
  weights to it when they load (or keeps GGUF blocks quantized), whatever the
  checkpoint stores, since a float32 model on the CPU is the exact one.
- ``gpu_memory_utilization``: as in vLLM, the share of the device's memory
  the whole engine may take, weights and KV pool; here the share of the
  memory free when ``LLM`` starts (the host's MemAvailable on the CPU), less
  the model's weight files, becomes ``kv_cache_memory_bytes``. A share the
  weights alone exceed is a ValueError. ``kv_cache_memory_bytes`` or
  ``num_kv_blocks`` given as well win, as vLLM's ``kv_cache_memory_bytes``
  overrides it.
- ``trust_remote_code``: accepted; pagedllm never runs code from a model
  repository (every architecture it loads is its own code), so True changes
  nothing, which a log line says.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

# what dtype="auto" resolves to: EngineConfig's default (its docstring says why float32)
AUTO_DTYPE = "float32"


def translate_vllm_args(model_path: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with vLLM's ``dtype="auto"``, ``gpu_memory_utilization`` and ``trust_remote_code`` resolved
    into ``EngineConfig`` fields (or removed); ValueError for a value that means nothing."""
    out = dict(kwargs)
    if out.get("dtype") == "auto":
        out["dtype"] = AUTO_DTYPE
    trust = out.pop("trust_remote_code", False)
    if not isinstance(trust, bool):
        raise ValueError(f"trust_remote_code must be True or False, got {trust!r}")
    if trust:
        logger.info("trust_remote_code=True: pagedllm never runs code from a model repository; nothing to trust")
    utilization = out.pop("gpu_memory_utilization", None)
    if utilization is not None:
        _check_utilization(utilization)
        if out.get("kv_cache_memory_bytes") is None and out.get("num_kv_blocks") is None:
            out["kv_cache_memory_bytes"] = utilization_kv_budget(model_path, utilization, out.get("device", "cpu"))
    return out


def _check_utilization(utilization: object) -> None:
    if isinstance(utilization, bool) or not isinstance(utilization, (int, float)) or not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got {utilization!r}")


def utilization_kv_budget(model_path: str, utilization: float, device: str) -> int:
    """The KV pool's bytes when the engine may take ``utilization`` of the free memory: that share less the
    model's weight files (their size estimates the loaded weights, as for data-parallel replicas)."""
    import torch

    from pagedllm.device_memory import available_memory_bytes
    from pagedllm.loader import model_file_bytes

    available = available_memory_bytes(torch.device(device))
    weights = model_file_bytes(model_path)
    budget = int(available * utilization) - weights
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization={utilization} allows {available * utilization / 2**30:.2f} GiB of the "
            f"{available / 2**30:.2f} GiB free, and the weights alone take {weights / 2**30:.2f} GiB; raise it, "
            "or size the KV pool with kv_cache_memory_bytes"
        )
    return budget
