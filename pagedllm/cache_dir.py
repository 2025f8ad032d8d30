"""Where pagedllm keeps what it builds once and reuses: kernel libraries, tokenizers converted from GGUF files."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$PAGEDLLM_CACHE_DIR``, default ``~/.cache/pagedllm``."""
    return Path(os.environ.get("PAGEDLLM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "pagedllm"))
