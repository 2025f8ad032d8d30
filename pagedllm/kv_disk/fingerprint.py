"""What the bits of a KV block depend on, as JSON-ready data: the disk cache's folder is named by its hash.

A block's K/V follows from its tokens (the hash chain names those) and from
everything below: the weights (each weight file's size and a hash of samples
of its bytes: head, middle and tail, so a copied or renamed file still
matches and hashing a 10 GB file costs milliseconds), the model's
architecture as read (RoPE and its scaling included), the weights' format
and quantization, the compute dtype, the KV cache's dtype and block shape,
the attention and linear backends, and the code that computes K/V (the
sources of the kernels, layers, models and loader packages: any edit there
may change rounding, so a checkout that changed them starts a new folder).
Any difference is another
folder, so a block is never read by an engine that would have computed
other bits.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import xxhash

from pagedllm.config import EngineConfig
from pagedllm.loader.model_config import ModelArchConfig

FORMAT_VERSION = 1
_SAMPLE_BYTES = 2**20
# files of a checkpoint folder whose bytes change the weights (tokenizer files do not change K/V of given ids)
_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth")
_SOURCE_SUFFIXES = (".py", ".cpp", ".h", ".c", ".cc")
# the packages whose code decides a block's bits
_SOURCE_PACKAGES = ("kernels", "layers", "models", "loader")


def file_identity(path: Path) -> dict[str, Any]:
    """A file's name, size and the xxh3 of its first, middle and last MiB."""
    size = path.stat().st_size
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        for offset in sorted({0, max(0, size // 2 - _SAMPLE_BYTES // 2), max(0, size - _SAMPLE_BYTES)}):
            f.seek(offset)
            h.update(f.read(_SAMPLE_BYTES))
    return {"name": path.name, "size": size, "sample_xxh3": h.hexdigest()}


def model_files_identity(model: Path, gguf_file: str | None = None) -> list[dict[str, Any]]:
    """The identity of every weight file and config.json of ``model`` (a file or a folder)."""
    model = Path(model)
    if model.is_file():
        return [file_identity(model)]
    if not model.is_dir():
        return [{"name": str(model)}]  # a hub id: resolved elsewhere, the revision is in the fingerprint
    files = sorted(
        p for p in model.iterdir()
        if p.is_file() and (p.suffix in _WEIGHT_SUFFIXES or p.name == "config.json")
        and (gguf_file is None or p.suffix != ".gguf" or p.name == gguf_file)
    )
    return [file_identity(p) for p in files]


def compute_sources_hash() -> str:
    """xxh3 of the sources (file names and bytes) of the packages that compute K/V (a few ms)."""
    root = Path(__file__).resolve().parent.parent
    h = xxhash.xxh3_128()
    for package in _SOURCE_PACKAGES:
        for p in sorted((root / package).rglob("*")):
            if p.suffix in _SOURCE_SUFFIXES and p.is_file():
                h.update(str(p.relative_to(root)).encode())
                h.update(p.read_bytes())
    return h.hexdigest()


def kv_fingerprint(
    config: EngineConfig, model_config: ModelArchConfig, runtime: dict[str, Any]
) -> dict[str, Any]:
    """The fingerprint of this engine's blocks; ``runtime`` holds what the runner resolved (KV dtype and
    block shape, weight format, backends), as plain values."""
    return {
        "format": FORMAT_VERSION,
        "model_files": model_files_identity(config.model, config.gguf_file),
        "revision": config.revision,
        "model_config": _plain(dataclasses.asdict(model_config)),
        "dtype": config.dtype,
        "kv_cache_dtype": config.kv_cache_dtype,
        "block_size": config.block_size,
        "quantization": config.quantization,
        "quantization_group_size": config.quantization_group_size,
        "gguf_activations": config.gguf_activations,
        "sources": compute_sources_hash(),
        "runtime": _plain(runtime),
    }


def _plain(value: Any) -> Any:
    """``value`` with tuples as lists and anything JSON does not know as its repr (a stable text)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return repr(value)
