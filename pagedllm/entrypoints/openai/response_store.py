"""The responses ``/v1/responses`` keeps (``store``), for ``previous_response_id`` and ``GET``/``DELETE``.

In memory, bounded by a count and by bytes (each entry's JSON size), least
recently used first out: an agent's long conversation re-stores its whole
history with every turn, so the byte bound is the one that matters. A
restart forgets everything; a forgotten or evicted id is a 404 that says so.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

# defaults: 1,000 responses, 256 MiB of JSON (a 30k-token agent conversation is about 120 KB of text)
DEFAULT_MAX_NUM_RESPONSES = 1000
DEFAULT_MAX_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class StoredResponse:
    """One stored response: its body (as ``GET`` returns it) and its conversation.

    ``conversation``: every item the next turn continues from, as input
    items: the earlier turns', this request's input, then its output
    (``instructions`` are not part of it: OpenAI does not carry them over).
    ``num_bytes``: the JSON size the store counts. ``num_input_items``: how
    many of the conversation's items were the response's input (the rest are its output).
    """

    body: dict[str, Any]
    conversation: list[dict[str, Any]]
    num_bytes: int
    num_input_items: int = 0


class ResponseStore:
    """An LRU map of response id -> ``StoredResponse``, bounded in count and bytes; thread-safe.

    Args:
        max_num_responses: most responses kept.
        max_bytes: most bytes kept (the JSON size of bodies and conversations); a
            single response larger than this is not stored at all.
    """

    def __init__(self, max_num_responses: int = DEFAULT_MAX_NUM_RESPONSES, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()
        self.num_bytes = 0
        self.num_evicted = 0
        self.max_num_responses = 0
        self.max_bytes = 0
        self.resize(max_num_responses, max_bytes)

    def resize(self, max_num_responses: int, max_bytes: int) -> None:
        """New bounds; entries over them are evicted now, least recently used first."""
        for name, value in (("max_num_responses", max_num_responses), ("max_bytes", max_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        with self._lock:
            self.max_num_responses = max_num_responses
            self.max_bytes = max_bytes
            self._evict(0)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, response_id: object) -> bool:
        return response_id in self._entries

    def put(
        self, response_id: str, body: dict[str, Any], conversation: list[dict[str, Any]], num_input_items: int = 0
    ) -> bool:
        """Store a response (replacing one of the same id); False when it alone is over ``max_bytes``.

        ``num_input_items``: how many of ``conversation``'s first items were its input."""
        size = len(json.dumps(body, ensure_ascii=False)) + len(json.dumps(conversation, ensure_ascii=False))
        with self._lock:
            self._pop(response_id)
            if size > self.max_bytes:
                return False
            self._evict(size)
            self._entries[response_id] = StoredResponse(body, conversation, size, num_input_items)
            self.num_bytes += size
            return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response (now the most recently used), or None."""
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is not None:
                self._entries.move_to_end(response_id)
            return entry

    def delete(self, response_id: str) -> bool:
        """Forget a response; False when it was not stored."""
        with self._lock:
            return self._pop(response_id) is not None

    def _pop(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.num_bytes -= entry.num_bytes
        return entry

    def _evict(self, incoming: int) -> None:
        """Drop the least recently used until ``incoming`` more bytes and one more entry fit (0: just fit)."""
        room = 1 if incoming else 0
        while self._entries and (
            len(self._entries) + room > self.max_num_responses or self.num_bytes + incoming > self.max_bytes
        ):
            _, entry = self._entries.popitem(last=False)
            self.num_bytes -= entry.num_bytes
            self.num_evicted += 1
