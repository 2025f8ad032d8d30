"""Process-wide settings, applied once by the engine at start, before the model is built."""

from __future__ import annotations

import torch

from pagedllm.config import EngineConfig


def apply_process_settings(config: EngineConfig) -> None:
    """Size torch's intra-op thread pool (which the native ops run on too) to ``config.num_threads``.

    None leaves torch's default (one thread per core). This is the process's
    pool, shared by every engine in it: the last engine started sets it.
    """
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
