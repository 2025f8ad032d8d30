"""Free memory on a device: what the default KV pool is sized from (the runner, data-parallel replicas, ``env``)."""

from __future__ import annotations

import torch

# where /proc/meminfo cannot be read (not Linux): a guess that keeps the default pool modest
_UNKNOWN_HOST_BYTES = 8 << 30


def available_memory_bytes(device: torch.device) -> int:
    """Free memory on ``device`` (the GPU's free bytes, or the host's MemAvailable)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return _UNKNOWN_HOST_BYTES
