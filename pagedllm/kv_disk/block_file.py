"""The bytes of one KV block on disk: a header, the block's token ids, its K/V, and a checksum.

::

    magic    8 bytes  b"PLKVBLK1"
    header   24 bytes block hash (u64), number of token ids (u32), reserved (u32), payload bytes (u64)
    tokens   8 bytes each (int64): the block's token ids, compared on load (a 64-bit hash may collide)
    payload  the block's K/V exactly as the pool holds it (every layer, K and V)
    checksum 16 bytes xxh3-128 of everything before it

A file cut short (a crash mid-write of another process, a full disk), or with
any byte changed, fails ``decode_block`` and is a miss: it is never read as
K/V. Plain bytes, no torch: the bookkeeping's store reads and checks files.
"""

from __future__ import annotations

import struct
from array import array

import xxhash

MAGIC = b"PLKVBLK1"
_HEADER = struct.Struct("<QIIQ")
_CHECKSUM_BYTES = 16


class BlockFileError(ValueError):
    """A block file that is torn, corrupt, or not the block asked for."""


def encode_block(block_hash: int, token_ids: tuple[int, ...] | list[int], payload: bytes) -> bytes:
    """The file's bytes for the block ``block_hash`` holding ``token_ids`` whose K/V is ``payload``."""
    body = b"".join((
        MAGIC,
        _HEADER.pack(block_hash, len(token_ids), 0, len(payload)),
        array("q", token_ids).tobytes(),
        payload,
    ))
    return body + xxhash.xxh3_128_digest(body)


def decode_block(data: bytes, block_hash: int, token_ids: tuple[int, ...]) -> bytes:
    """The K/V payload of ``data``; BlockFileError unless it is a whole, intact file of exactly this block."""
    head = len(MAGIC) + _HEADER.size
    if len(data) < head + _CHECKSUM_BYTES or data[: len(MAGIC)] != MAGIC:
        raise BlockFileError("not a block file (short or wrong magic)")
    stored_hash, num_tokens, _, payload_len = _HEADER.unpack_from(data, len(MAGIC))
    end = head + 8 * num_tokens + payload_len
    if len(data) != end + _CHECKSUM_BYTES:
        raise BlockFileError(f"block file of {len(data)} bytes, its header says {end + _CHECKSUM_BYTES}")
    view = memoryview(data)
    if xxhash.xxh3_128_digest(view[:end]) != bytes(view[end:]):
        raise BlockFileError("block file checksum mismatch")
    if stored_hash != block_hash:
        raise BlockFileError("block file holds another block's hash")
    stored_tokens = array("q")
    stored_tokens.frombytes(view[head : head + 8 * num_tokens])
    if tuple(stored_tokens) != tuple(token_ids):
        raise BlockFileError("block file holds other token ids (a hash collision)")
    return bytes(view[head + 8 * num_tokens : end])
