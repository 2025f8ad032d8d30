"""The JSON answer every route and error of the server sends, and the check that keeps its text encodable.

Starlette's ``JSONResponse`` writes non-ASCII text as UTF-8, which a lone
UTF-16 surrogate (JSON ``"\\ud800"``, or the bytes ``ED A0 80`` that
``json.loads`` lets through) cannot be: an answer quoting one (an error
message naming the value) raised ``UnicodeEncodeError`` while it was being
written, a 500 after which uvicorn closed the connection. Two things close
that, for every route at once:

- ``find_lone_surrogate``: the request models refuse any string (or object
  key) holding one before a route sees it (a 400 naming where,
  ``protocol.py``);
- ``OpenAIJSONResponse``: an answer that still holds one is written with
  ``\\uXXXX`` escapes (valid JSON, every byte ASCII) rather than failing.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import JSONResponse


class OpenAIJSONResponse(JSONResponse):
    """``JSONResponse`` that never fails on text UTF-8 cannot encode: such a body is written escaped."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            # ensure_ascii writes a lone surrogate as the escape it came in as
            return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


# the JSON values that hold no text
_SCALARS = frozenset({int, float, bool, type(None)})


def _surrogate_at(text: str) -> int | None:
    """The index of the first lone surrogate of ``text``, or None (the fast path: one C-level encode)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def find_lone_surrogate(value: object, where: str = "") -> tuple[str, int] | None:
    """Where the first string of a parsed JSON value (object keys included) holds a lone surrogate.

    Returns (path, index in that string), the path written as the error
    messages write fields (``messages[0].content``); None when every string
    is valid Unicode text. Walks the value iteratively: a deeply nested body
    cannot exhaust the stack.
    """
    stack: list[tuple[object, str]] = [(value, where)]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            index = _surrogate_at(item)
            if index is not None:
                return path or "the request body", index
            continue
        if isinstance(item, dict):
            for key in item:
                index = _surrogate_at(key) if isinstance(key, str) else None
                if index is not None:
                    return f"a key of {path or 'the request body'}", index
            children = [(f"{path}.{key}" if path else str(key), sub) for key, sub in item.items() if _nested(sub)]
        elif isinstance(item, list):
            if _SCALARS.issuperset(map(type, item)):
                continue  # a token-id list of a million numbers: one C-level pass
            children = [(f"{path}[{i}]", sub) for i, sub in enumerate(item) if _nested(sub)]
        else:
            continue
        stack.extend((sub, sub_path) for sub_path, sub in reversed(children))
    return None


def _nested(value: object) -> bool:
    """Whether ``value`` can hold a string: one, or a container."""
    return isinstance(value, (str, dict, list))
