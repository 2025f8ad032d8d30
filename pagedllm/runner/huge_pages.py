"""Model weights in transparent huge pages: the bytes a decode step streams through, 2 MiB to a TLB entry.

A one-sequence decode step reads every weight once, from memory: ~760 MB a
token for a Llama-3.2-1B Q4_K_M file. In 4 KiB pages that is ~190,000 TLB
misses a token, and the hardware prefetchers stop at every 4 KiB boundary; in
2 MiB pages, a few hundred. On the 2-vCPU Zen 5 machine the output head
(Q6_K, 128256 x 2048, 215 MB) took 15.1 ms of one thread's time in 4 KiB
pages and 8.6 ms in huge pages, and a decode step's CPU time fell by a fifth
to a quarter (BENCHMARKS.md, issue 48). The bits are the same; only where
they lie changes.

Most Linux machines ship transparent huge pages as ``madvise`` (only regions
that ask get them), and torch's CPU allocator does not ask. So the loader
materialises each large weight (built on the meta device) as an anonymous
private mapping advised ``MADV_HUGEPAGE`` before its first byte is written
(the load's copy then faults in whole 2 MiB pages). Only the tensor's whole
2 MiB stretches are advised, from a 2 MiB-aligned start, so its resident size
is its own, never rounded up. Where the kernel has no huge page to give, the
faults take 4 KiB pages, as torch's allocator would.
"""

from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE_BYTES = 2 << 20  # x86-64's PMD size: one transparent huge page
# a smaller tensor holds no whole huge page: torch's allocator keeps it
MIN_HUGE_TENSOR_BYTES = HUGE_PAGE_BYTES


def huge_pages_available() -> bool:
    """Whether this platform can advise an anonymous mapping into huge pages (Linux)."""
    return all(hasattr(mmap, name) for name in ("MADV_HUGEPAGE", "MAP_ANONYMOUS", "MAP_PRIVATE"))


def _contiguous(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    expected = 1
    for dim, step in zip(reversed(size), reversed(stride), strict=True):
        if dim != 1 and step != expected:
            return False
        expected *= dim
    return True


def empty_weight(size: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor of ``size`` / ``stride`` / ``dtype`` (torch.empty_strided's), in transparent
    huge pages where it is contiguous, at least ``MIN_HUGE_TENSOR_BYTES`` long and the kernel gives them.

    The tensor owns its mapping (freed with its storage) and is an ordinary contiguous CPU tensor.
    """
    size, stride = tuple(size), tuple(stride)
    num_bytes = math.prod(size) * dtype.itemsize
    if num_bytes < MIN_HUGE_TENSOR_BYTES or not _contiguous(size, stride) or not huge_pages_available():
        return torch.empty_strided(size, stride, dtype=dtype, device="cpu")
    # one huge page of slack: the tensor starts at the mapping's first 2 MiB boundary (the slack is never
    # touched, so never resident)
    mapping = mmap.mmap(-1, num_bytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    address = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()
    start = -address % HUGE_PAGE_BYTES  # a multiple of the page size: the mapping is page-aligned
    whole_pages = num_bytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES  # the tail keeps small pages: no rounding up
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE, start, whole_pages)
    except OSError:  # a kernel built without transparent huge pages: small pages, as torch's allocator gives
        pass
    # frombuffer holds the mapping (a buffer export) for as long as the tensor's storage lives
    flat = torch.frombuffer(mapping, dtype=torch.uint8, count=num_bytes, offset=start)
    return flat.view(dtype).view(size)
