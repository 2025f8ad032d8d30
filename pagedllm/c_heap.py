"""The C allocator under torch's CPU tensors: freed activations kept for the next step, given back when idle.

A prompt step allocates and frees the same large activations in every layer (the 1B file's 2048-token
prefill: a 128 MiB gate/up product, 64 MiB ones beside it). glibc serves any block over its mmap threshold
(at most 32 MiB) from a fresh ``mmap`` and unmaps it on free, so each such tensor comes back as zeroed pages
the kernel faults in one by one: 1.25 million minor faults (5 GB) a step, about a seventh of that step's
time (docs/performance.md). ``keep_freed_heap`` makes glibc serve every block from its heap and keep what is
freed there, as a caching allocator does; ``trim_heap``, called as the engine goes idle, hands the free part
back to the OS. Where the C library is not glibc (no ``mallopt`` / ``malloc_trim``) both do nothing.

A thread other than the main one allocates from an arena of its own, whose blocks over 64 MiB are mapped
one by one whatever the settings: ``share_one_arena``, called by the ``pagedllm`` command and by a
data-parallel replica's process before any thread starts, puts every thread on the main arena, so the
server's engine thread reuses the heap as ``LLM.generate`` does.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
# the largest value mallopt takes (an int): free memory at the heap's top is kept up to this, 2 GiB
_KEEP_BYTES = 2**31 - 1


@functools.cache
def libc() -> ctypes.CDLL:
    """The C library (madvise / mincore on an address, the allocator's settings)."""
    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def share_one_arena() -> bool:
    """Have every thread allocate from the C allocator's main arena; True where the C library took it.

    glibc fixes the number of arenas when a second thread first allocates, so this only counts before that:
    the ``pagedllm`` command and a data-parallel replica's process call it first thing. Threads here
    allocate little but the engine thread's steps, so one arena costs no contention worth measuring and
    keeps those steps' blocks in the heap that ``keep_freed_heap`` keeps.
    """
    mallopt = getattr(libc(), "mallopt", None)
    return mallopt is not None and bool(mallopt(_M_ARENA_MAX, 1))


def keep_freed_heap() -> bool:
    """Have the C allocator serve large blocks from its heap, not from one ``mmap`` each, and keep freed
    memory at the heap's top instead of returning it at once; True where the C library took both settings.

    Process-wide and sticky, like the thread count: set by the model runner once the weights and the KV pool
    are in place (the pool is its own mapping, ``runner/kv_cache.py``; loading's temporaries are trimmed
    first). What is kept is the largest step's activations, reused by every later step and given back by
    ``trim_heap`` when the engine goes idle.
    """
    mallopt = getattr(libc(), "mallopt", None)
    if mallopt is None:
        return False
    settings = ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _KEEP_BYTES))
    return all([bool(mallopt(param, value)) for param, value in settings])


def trim_heap() -> None:
    """Hand the C allocator's free memory back to the OS (glibc's ``malloc_trim``; nothing where the C library
    has none).

    Called as the engine goes idle, beside the KV pages: a burst's activations leave freed chunks in the
    allocator's arenas, which glibc keeps for the next allocation unless trimmed (a server idle after a
    burst of 32 requests on the bundled model kept 100-190 MiB of them; with ``keep_freed_heap`` a step's
    largest activations too)."""
    trim = getattr(libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)
