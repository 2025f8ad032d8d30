"""The prefix cache on disk: full KV blocks in files named by their prefix-cache hash, under a fingerprint.

::

    <kv_cache_dir>/
      <fingerprint id>/                 one folder per model + KV format + settings (``fingerprint.py``)
        fingerprint.json                what the id was computed from (for a reader, never trusted)
        00a3f1c2d4e5b6a7.kvb            one full block: hash chain value in hex (``block_file.py``)
        .00a3f1c2d4e5b6a7.<pid>.<uuid>.tmp   a write in progress: renamed into place when whole

Plain Python (no torch): the block manager asks it which hashes the disk
holds and reads the blocks it admits (``engine/block_manager.py``); the
runner hands it the bytes of blocks just published, which one background
thread writes (``write``): the step never waits on the disk.

Sharing and failure:
  * a file appears whole or not at all (a unique temporary name, then
    ``os.replace``), so servers sharing the folder never see half a file;
    a torn or altered file fails its checksum and is a miss (counted in
    ``num_corrupt`` and removed), never K/V;
  * another fingerprint is another folder: a model or KV format change
    never reads the old blocks;
  * ``max_bytes`` bounds the whole directory, all fingerprints: past it the
    least recently used files go (a hit touches a file's mtime, so the
    order is shared by every server on the folder);
  * a full disk (ENOSPC, EDQUOT) turns writing off for this store's life
    with one warning; reads go on.
"""

from __future__ import annotations

import atexit
import errno
import json
import logging
import os
import queue
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import xxhash

from pagedllm.kv_disk.block_file import BlockFileError, decode_block, encode_block

logger = logging.getLogger(__name__)

SUFFIX = ".kvb"
# bytes of block payloads the writer may have queued: past it a block is not written (counted as dropped)
MAX_PENDING_BYTES = 512 * 2**20
# a temporary file this old is left from a process that died mid-write: the next scan removes it
STALE_TMP_S = 600.0
_FULL_DISK = (errno.ENOSPC, errno.EDQUOT)


def fingerprint_id(fingerprint: dict[str, Any]) -> str:
    """The folder name of ``fingerprint``: a hash of its canonical JSON."""
    text = json.dumps(fingerprint, sort_keys=True, separators=(",", ":"))
    return xxhash.xxh3_128_hexdigest(text.encode())


class DiskBlockStore:
    """KV blocks on disk under ``root`` for one fingerprint, at most ``max_bytes`` in the whole of ``root``.

    Args:
        root: the cache directory (created if missing).
        fingerprint: everything that changes the bits of a block (``fingerprint.py``), JSON-ready.
        payload_bytes: the K/V bytes of one block: a file whose payload differs is a miss.
        max_bytes: the bound on the directory's block files (None: unbounded).
    """

    def __init__(self, root: Path | str, fingerprint: dict[str, Any], payload_bytes: int,
                 max_bytes: int | None = None) -> None:
        if payload_bytes < 1:
            raise ValueError(f"payload_bytes must be >= 1, got {payload_bytes}")
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.root = Path(root)
        self.payload_bytes = payload_bytes
        self.max_bytes = max_bytes
        self.dir = self.root / fingerprint_id(fingerprint)
        self.dir.mkdir(parents=True, exist_ok=True)
        # counters (blocks, or bytes); the writer thread adds to its own
        self.num_hits = 0
        self.num_misses = 0
        self.num_corrupt = 0
        self.num_writes = 0
        self.num_write_errors = 0
        self.num_dropped = 0
        self.num_evictions = 0
        self.bytes_read = 0
        self.bytes_written = 0
        # None while writing works; the reason once a full disk turned it off
        self.writes_disabled: str | None = None
        self._write_fingerprint(fingerprint)
        self._total_bytes = self._scan_and_evict()
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[int, tuple[int, ...], bytes] | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="pagedllm-kv-disk-writer", daemon=True)
        self._writer.start()
        self._closed = False
        # a script that ends without shutting its engine down still gets its queued blocks written
        # (the writer is a daemon thread, which the interpreter would otherwise drop mid-queue)
        atexit.register(self.close)

    # --- reading (the bookkeeping's thread) ----------------------------------
    def path(self, block_hash: int) -> Path:
        """The file of the block ``block_hash``."""
        return self.dir / f"{block_hash:016x}{SUFFIX}"

    def contains(self, block_hash: int) -> bool:
        """Whether a file of this block exists now (its contents are checked only when read)."""
        return self.path(block_hash).is_file()

    def read_chain(self, hashes: list[int], token_ids: list[tuple[int, ...]]) -> list[bytes]:
        """The payloads of the blocks ``hashes`` (holding ``token_ids``), in order, up to the first absent
        or bad one: a prefix of a prompt is only usable up to its first gap."""
        payloads: list[bytes] = []
        for block_hash, tokens in zip(hashes, token_ids):
            payload = self._read(block_hash, tokens)
            if payload is None:
                self.num_misses += 1
                break
            payloads.append(payload)
        self.num_hits += len(payloads)
        return payloads

    def _read(self, block_hash: int, tokens: tuple[int, ...]) -> bytes | None:
        path = self.path(block_hash)
        try:
            data = path.read_bytes()
        except OSError:  # absent (never written, or evicted by a server sharing the folder)
            return None
        try:
            payload = decode_block(data, block_hash, tokens)
            if len(payload) != self.payload_bytes:
                raise BlockFileError(f"payload of {len(payload)} bytes, a block here has {self.payload_bytes}")
        except BlockFileError as e:
            self.num_corrupt += 1
            logger.warning("kv cache dir: ignoring %s: %s", path, e)
            path.unlink(missing_ok=True)
            return None
        self.bytes_read += len(data)
        try:
            os.utime(path)  # most recently used, for every server sharing the folder
        except OSError:
            pass
        return payload

    # --- writing (a background thread) ---------------------------------------
    def write(self, block_hash: int, token_ids: tuple[int, ...], payload: bytes) -> None:
        """Queue the block for writing; returns at once. Dropped when writing is off or too much is queued."""
        if self.writes_disabled is not None or self._closed:
            return
        if len(payload) != self.payload_bytes:
            raise ValueError(f"payload of {len(payload)} bytes, a block here has {self.payload_bytes}")
        with self._lock:
            if self._pending_bytes + len(payload) > MAX_PENDING_BYTES:
                self.num_dropped += 1
                return
            self._pending_bytes += len(payload)
        self._queue.put((block_hash, tuple(token_ids), payload))

    def flush(self) -> None:
        """Wait until every queued block is written (or given up)."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the writer thread. Idempotent; later blocks are not written."""
        self._closed = True
        atexit.unregister(self.close)
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                with self._lock:
                    self._pending_bytes -= len(item[2])
                if self.writes_disabled is None:
                    self._write_one(*item)
            except Exception:  # the thread must outlive any one block; the step path never sees it
                self.num_write_errors += 1
                logger.exception("kv cache dir: writing a block failed")
            finally:
                self._queue.task_done()

    def _write_one(self, block_hash: int, token_ids: tuple[int, ...], payload: bytes) -> None:
        final = self.path(block_hash)
        if final.exists():
            return  # written by an earlier run or a server sharing the folder
        data = encode_block(block_hash, token_ids, payload)
        if self.max_bytes is not None and len(data) > self.max_bytes:
            return
        tmp = self.dir / f".{block_hash:016x}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        try:
            with open(tmp, "xb") as f:
                f.write(data)
            os.replace(tmp, final)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            if e.errno in _FULL_DISK:
                self.writes_disabled = f"{os.strerror(e.errno)} writing {final}"
                logger.warning("kv cache dir: %s; blocks are no longer written to disk (reads go on)",
                               self.writes_disabled)
            else:
                self.num_write_errors += 1
                logger.warning("kv cache dir: could not write %s: %s", final, e)
            return
        self.num_writes += 1
        self.bytes_written += len(data)
        self._total_bytes += len(data)
        if self.max_bytes is not None and self._total_bytes > self.max_bytes:
            self._total_bytes = self._scan_and_evict()

    # --- the directory -------------------------------------------------------
    def _write_fingerprint(self, fingerprint: dict[str, Any]) -> None:
        path = self.dir / "fingerprint.json"
        if path.exists():
            return
        tmp = self.dir / f".fingerprint.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        try:
            tmp.write_text(json.dumps(fingerprint, sort_keys=True, indent=1))
            os.replace(tmp, path)
        except OSError as e:  # informative only: the folder's name is what is compared
            tmp.unlink(missing_ok=True)
            logger.warning("kv cache dir: could not write %s: %s", path, e)

    def _scan_and_evict(self) -> int:
        """Remove stale temporary files, then the least recently used blocks past ``max_bytes``; the bytes left.

        Scans every fingerprint's folder: the bound is the directory's, whichever server wrote what.
        """
        files: list[tuple[float, int, Path]] = []
        now = time.time()
        for sub in self.root.iterdir() if self.root.is_dir() else ():
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub):
                try:
                    st = entry.stat()
                except OSError:
                    continue  # removed meanwhile by a server sharing the folder
                if entry.name.endswith(".tmp") and now - st.st_mtime > STALE_TMP_S:
                    Path(entry.path).unlink(missing_ok=True)
                elif entry.name.endswith(SUFFIX):
                    files.append((st.st_mtime, st.st_size, Path(entry.path)))
        total = sum(size for _, size, _ in files)
        if self.max_bytes is None or total <= self.max_bytes:
            return total
        for _, size, path in sorted(files, key=lambda f: f[0]):
            try:
                path.unlink()
                self.num_evictions += 1
            except FileNotFoundError:
                pass  # another server evicted it
            total -= size
            if total <= self.max_bytes:
                break
        return total

    @property
    def num_bytes(self) -> int:
        """Bytes of block files in the directory, as this store last counted them."""
        return self._total_bytes
