"""Which data-parallel replica gets a request: the longest cached prefix, then the least load.

A prompt's full blocks are hashed in the server process with the prefix
cache's own chain (``block_manager.extend_block_hashes``), so a hash here is
the key under which a replica's block manager caches that block. Per replica
the router knows two sets of hashes:

- *reported*: every hash in the replica's prefix cache, sent by the replica
  with its stats (at most every 0.1 s while it works, and when it goes idle).
  This is the truth, evictions included, but it lags;
- *learned*: the hashes of the prompts routed there in the last
  ``LEARNED_TTL_S`` seconds. They cover the lag: a burst of requests sharing
  a prefix follows the first one even before its prefill has run.

A request's score on a replica is the number of leading blocks of its prompts
found in either set (only blocks inside the first ``len - 1`` tokens count, as
in the block manager: the last token is always computed). The request goes to
the highest score; ties, and requests that match nowhere, go to the replica
with the fewest unfinished requests, and equal loads take turns.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence

from pagedllm.engine.block_manager import extend_block_hashes

# seconds a routed prompt's hashes count for a replica without the replica reporting them
LEARNED_TTL_S = 5.0


class PrefixRouter:
    """Picks a replica per request from the block hashes each replica holds.

    Args:
        num_replicas: how many replicas there are.
        block_size: tokens per KV block (the engines' ``block_size``).
        prefix_caching: whether the engines cache prefixes; without it only load counts.
    """

    def __init__(self, num_replicas: int, block_size: int, prefix_caching: bool = True) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        # block_size is EngineConfig's, checked there
        self.num_replicas = num_replicas
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._reported: list[frozenset[int]] = [frozenset()] * num_replicas
        self._learned: list[dict[int, float]] = [{} for _ in range(num_replicas)]
        self._turn = itertools.count()
        self._lock = threading.Lock()

    def prompt_hashes(self, token_ids: Sequence[int]) -> list[int]:
        """The chained hashes of the prompt's blocks that a prefix-cache hit can cover."""
        if not self.prefix_caching:
            return []
        bs = self.block_size
        n = (len(token_ids) - 1) // bs
        return extend_block_hashes([], (token_ids[i * bs : (i + 1) * bs] for i in range(n)))

    def _match(self, replica: int, hashes: list[int]) -> int:
        reported, learned = self._reported[replica], self._learned[replica]
        n = 0
        for h in hashes:
            if h not in reported and h not in learned:
                break
            n += 1
        return n

    def scores(self, prompts: list[list[int]]) -> list[int]:
        """Per replica, the cached leading blocks of the prompts (given as their hashes), summed."""
        with self._lock:
            return [sum(self._match(r, hashes) for hashes in prompts) for r in range(self.num_replicas)]

    def choose(self, prompts: list[list[int]], loads: list[int | None]) -> int:
        """The replica for a request whose prompts have these hashes.

        Args:
            prompts: each prompt's block hashes (``prompt_hashes``).
            loads: per replica its unfinished requests, None for one that is not serving.

        Raises ValueError when no replica serves.
        """
        if len(loads) != self.num_replicas:
            raise ValueError(f"expected {self.num_replicas} loads, got {len(loads)}")
        alive = [r for r, load in enumerate(loads) if load is not None]
        if not alive:
            raise ValueError("no data-parallel replica is serving")
        scores = self.scores(prompts)
        best = max(scores[r] for r in alive)
        candidates = [r for r in alive if scores[r] == best]
        least = min(loads[r] or 0 for r in candidates)
        candidates = [r for r in candidates if (loads[r] or 0) == least]
        return candidates[next(self._turn) % len(candidates)]

    def record(self, replica: int, prompts: list[list[int]]) -> None:
        """The request with these prompt hashes went to ``replica``: it will cache them."""
        now = time.monotonic()
        with self._lock:
            learned = self._learned[replica]
            for hashes in prompts:
                for h in hashes:
                    learned[h] = now

    def report(self, replica: int, cached: frozenset[int]) -> None:
        """The replica's prefix cache holds exactly ``cached`` now; learned hashes past their time go."""
        cutoff = time.monotonic() - LEARNED_TTL_S
        with self._lock:
            self._reported[replica] = cached
            learned = self._learned[replica]
            for h in [h for h, t in learned.items() if t < cutoff]:
                del learned[h]

    def forget(self, replica: int) -> None:
        """The replica lost its cache (its process died)."""
        with self._lock:
            self._reported[replica] = frozenset()
            self._learned[replica] = {}
