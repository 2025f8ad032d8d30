"""``GET /v1/responses/{id}/input_items``: the input items a stored response was generated from, a page at a time.

A stored response keeps its conversation (``response_store.py``): every
earlier turn's items (through ``previous_response_id``), the request's own
``input``, then its output. Its input items are all but the output, listed as
OpenAI lists them: ``{"object": "list", "data": [...], "first_id",
"last_id", "has_more"}``, newest first unless ``order=asc``, at most
``limit`` (1-100, default 20) per page, after (or before) the item whose id
the cursor names. Each item is in the shape the API returns it: an id (given
when the response was stored, to items sent without one), ``type`` (a bare
``{"role", "content"}`` message is a ``message``), a message's text content as
``input_text`` (``output_text`` for the assistant's) parts, and a ``status``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedllm.entrypoints.openai.protocol import bad_request
from pagedllm.entrypoints.openai.response_items import new_item_id

MAX_LIMIT = 100
DEFAULT_LIMIT = 20
# the id prefix of each item type, as OpenAI's ids begin
_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def give_ids(items: Sequence[dict[str, Any]]) -> None:
    """Give each item without an ``id`` a fresh one, in place (before it is stored, so pages agree on ids)."""
    for item in items:
        if not isinstance(item.get("id"), str) or not item["id"]:
            item["id"] = new_item_id(_ID_PREFIXES.get(item.get("type", "message"), "item"))


def listed_item(item: dict[str, Any]) -> dict[str, Any]:
    """An input item as the list returns it (a copy): its type, text parts and status filled in."""
    out = dict(item)
    kind = out.setdefault("type", "message")
    out.setdefault("status", "completed")
    if kind == "message" and isinstance(out.get("content"), str):
        part = "output_text" if out.get("role") == "assistant" else "input_text"
        out["content"] = [{"type": part, "text": out["content"]}]
    return out


def list_page(
    items: Sequence[dict[str, Any]], order: str = "desc", limit: int = DEFAULT_LIMIT, after: str | None = None,
    before: str | None = None,
) -> dict[str, Any]:
    """One page of ``items`` (oldest first, as stored); APIError (400) for a bad order, limit or cursor."""
    if order not in ("asc", "desc"):
        raise bad_request(f"order must be 'asc' or 'desc', got {order!r}", "order")
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise bad_request(f"limit must be an integer from 1 to {MAX_LIMIT}, got {limit!r}", "limit")
    ordered = list(items) if order == "asc" else list(reversed(items))
    ids = [item.get("id") for item in ordered]
    lo, hi = 0, len(ordered)
    if after is not None:
        lo = _cursor(ids, after, "after") + 1
    if before is not None:
        hi = _cursor(ids, before, "before")
    window = ordered[lo:hi]
    page = window[:limit] if before is None else window[-limit:]  # "before" pages back toward the start
    has_more = len(window) > len(page)
    data = [listed_item(item) for item in page]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


def _cursor(ids: list[Any], item_id: str, param: str) -> int:
    try:
        return ids.index(item_id)
    except ValueError:
        raise bad_request(f"{param}: no input item with id '{item_id}' in this response", param) from None
