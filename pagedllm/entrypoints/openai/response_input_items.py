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

``include`` (OpenAI's ``ResponseIncludable`` values; the openai client sends
them as ``include[]``) adds fields to the listed items. The one that means
something here is ``reasoning.encrypted_content``: a reasoning item sent back
as input keeps the ``encrypted_content`` it was sent with (this server makes
none), and without the value that field is left out, as OpenAI lists it. The
others ask for what this server never stores: hosted tools' results and
sources (no hosted tool runs here), image URLs (inputs are text) and output
logprobs (a response keeps none): a 400 naming the value, not a list that
silently lacks them.
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
ENCRYPTED_REASONING = "reasoning.encrypted_content"
# OpenAI's other ``include`` values, and why a list here cannot hold what they ask for
_UNSERVED_INCLUDES = {
    "file_search_call.results": "no hosted tool (file search) runs on this server",
    "web_search_call.results": "no hosted tool (web search) runs on this server",
    "web_search_call.action.sources": "no hosted tool (web search) runs on this server",
    "code_interpreter_call.outputs": "no hosted tool (code interpreter) runs on this server",
    "computer_call_output.output.image_url": "no hosted tool (computer use) runs on this server",
    "message.input_image.image_url": "this server takes text inputs only: no input holds an image",
    "message.output_text.logprobs": "a stored response keeps no logprobs (top_logprobs is not served)",
}


def give_ids(items: Sequence[dict[str, Any]]) -> None:
    """Give each item without an ``id`` a fresh one, in place (before it is stored, so pages agree on ids)."""
    for item in items:
        if not isinstance(item.get("id"), str) or not item["id"]:
            item["id"] = new_item_id(_ID_PREFIXES.get(item.get("type", "message"), "item"))


def check_include(include: Sequence[str]) -> frozenset[str]:
    """The ``include`` values of a list request; APIError (400) for one this server cannot serve."""
    for value in include:
        if value == ENCRYPTED_REASONING:
            continue
        why = _UNSERVED_INCLUDES.get(value)
        if why is None:
            known = ", ".join([ENCRYPTED_REASONING, *_UNSERVED_INCLUDES])
            raise bad_request(f"include: unknown value {value!r}; OpenAI's values are {known}", "include")
        raise bad_request(f"include {value!r} cannot be served: {why}; only {ENCRYPTED_REASONING!r} is",
                          "include", "unsupported_value")
    return frozenset(include)


def listed_item(item: dict[str, Any], include: frozenset[str] = frozenset()) -> dict[str, Any]:
    """An input item as the list returns it (a copy): its type, text parts and status filled in, and the
    fields only ``include`` adds (a reasoning item's ``encrypted_content``) left out unless asked for."""
    out = dict(item)
    kind = out.setdefault("type", "message")
    if kind == "reasoning" and ENCRYPTED_REASONING not in include:
        out.pop("encrypted_content", None)
    out.setdefault("status", "completed")
    if kind == "message" and isinstance(out.get("content"), str):
        part = "output_text" if out.get("role") == "assistant" else "input_text"
        out["content"] = [{"type": part, "text": out["content"]}]
    return out


def list_page(
    items: Sequence[dict[str, Any]], order: str = "desc", limit: int = DEFAULT_LIMIT, after: str | None = None,
    before: str | None = None, include: Sequence[str] = (),
) -> dict[str, Any]:
    """One page of ``items`` (oldest first, as stored); APIError (400) for a bad order, limit, cursor or
    ``include`` value (``check_include``)."""
    if order not in ("asc", "desc"):
        raise bad_request(f"order must be 'asc' or 'desc', got {order!r}", "order")
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise bad_request(f"limit must be an integer from 1 to {MAX_LIMIT}, got {limit!r}", "limit")
    included = check_include(include)
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
    data = [listed_item(item, included) for item in page]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


def _cursor(ids: list[Any], item_id: str, param: str) -> int:
    try:
        return ids.index(item_id)
    except ValueError:
        raise bad_request(f"{param}: no input item with id '{item_id}' in this response", param) from None
