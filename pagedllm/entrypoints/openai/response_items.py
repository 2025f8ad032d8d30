"""Responses API items <-> chat messages: what ``/v1/responses`` turns into a chat conversation and back.

A Responses request's ``input`` is a string (one user message) or a list of
items. The items that make a conversation become OpenAI chat messages (plain
dicts, then checked by ``tool_messages.to_template_messages`` like any chat
request's):

    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": ...}]}
        -> {"role": "user", "content": "..."}   (parts joined by newlines; a string content as is;
           ``type`` may be left out, as OpenAI's "easy" input messages do)
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": ...}]}
        -> {"role": "assistant", "content": "..."}
    {"type": "function_call", "call_id": ..., "name": ..., "arguments": "{...}"}
        -> a ``tool_calls`` entry of an assistant message: the message just before when it is the
           assistant's (text, then its calls, is one turn), else a new assistant message
    {"type": "function_call_output", "call_id": ..., "output": "..."}
        -> {"role": "tool", "tool_call_id": ..., "content": "..."}
    {"type": "reasoning", ...}
        -> nothing: earlier turns' thinking is not shown to the model again (as chat templates
           drop it), and this server never sends ``encrypted_content`` to carry it

Any other item type (an ``item_reference``, hosted tools' calls) and any
non-text part (``input_image``, ``input_file``) is a ``ResponseItemError``
naming where it is (a 400). ``output_message`` / ``function_call_item``
build the items a response's ``output`` holds; fed back as input (a client
replaying ``response.output``, or ``previous_response_id``) they become the
same assistant turn.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from typing import Any

# the roles an input message may have (OpenAI's Responses API)
INPUT_ROLES = ("user", "system", "developer", "assistant")
# the text parts of a message's content, by role: what OpenAI's input and output items carry
_TEXT_PARTS = ("input_text", "output_text")
_MEDIA_PARTS = {"input_image": "images", "input_file": "files", "input_audio": "audio"}


class ResponseItemError(ValueError):
    """A malformed input item; the message names it (``input[2].content[0]``). ``param`` is the request field."""

    def __init__(self, message: str, param: str = "input", code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def new_item_id(prefix: str) -> str:
    """A fresh item id in OpenAI's shape: ``msg_``, ``fc_``, ``rs_`` or ``resp_`` and 48 hex digits."""
    return f"{prefix}_{secrets.token_hex(24)}"


def normalize_input(value: str | Sequence[Any] | None, where: str = "input") -> list[dict[str, Any]]:
    """The request's ``input`` as a list of items (a string is one user message); checked shallowly.

    Each item must be an object; its fields are checked by ``items_to_messages``.
    """
    if value is None:
        return []
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    items = []
    for i, item in enumerate(value):
        if not isinstance(item, Mapping):
            raise ResponseItemError(f"{where}[{i}] must be an object (an input item), got {type(item).__name__}")
        items.append(dict(item))
    return items


def items_to_messages(items: Sequence[Mapping[str, Any]], where: str = "input") -> list[dict[str, Any]]:
    """The conversation the items make, as chat messages (plain dicts); ResponseItemError for a bad item."""
    messages: list[dict[str, Any]] = []
    # whether messages[-1] is an assistant turn that later function_call items extend
    turn_open = False
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            message = _message(item, at)
            messages.append(message)
            turn_open = message["role"] == "assistant"
        elif kind == "function_call":
            call = _function_call(item, at)
            if turn_open:
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
                turn_open = True
        elif kind == "function_call_output":
            messages.append(_function_call_output(item, at))
            turn_open = False
        elif kind == "reasoning":
            _check_str(item.get("id"), f"{at}.id", optional=True)
        else:
            raise ResponseItemError(
                f"{at}.type {kind!r} is not supported; this server reads 'message', 'function_call', "
                "'function_call_output' and 'reasoning' items", code="unsupported_value",
            )
    return messages


def _message(item: Mapping[str, Any], at: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in INPUT_ROLES:
        raise ResponseItemError(f"{at}.role must be one of {', '.join(map(repr, INPUT_ROLES))}, got {role!r}")
    return {"role": role, "content": _content_text(item.get("content"), f"{at}.content")}


def _content_text(content: object, at: str) -> str:
    """A message's content as one string: a string, or its text parts joined by newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, Sequence) or isinstance(content, (bytes, bytearray)):
        raise ResponseItemError(f"{at} must be a string or a list of content parts, got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in _MEDIA_PARTS:
            raise ResponseItemError(f"{at}[{j}] is an {kind!r} part: this model takes no {_MEDIA_PARTS[kind]}, "
                                    "only text parts ('input_text')", code="unsupported_value")
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
            continue
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ResponseItemError(f"{at}[{j}] must be a text part {{'type': 'input_text', 'text': ...}}")
        texts.append(part["text"])
    return "\n".join(texts)


def _function_call(item: Mapping[str, Any], at: str) -> dict[str, Any]:
    call_id = _check_str(item.get("call_id"), f"{at}.call_id")
    name = _check_str(item.get("name"), f"{at}.name")
    arguments = item.get("arguments")
    if not isinstance(arguments, str):
        raise ResponseItemError(f"{at}.arguments must be the arguments' JSON text (a string)")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _function_call_output(item: Mapping[str, Any], at: str) -> dict[str, Any]:
    call_id = _check_str(item.get("call_id"), f"{at}.call_id")
    output = item.get("output")
    if output is None:
        raise ResponseItemError(f"missing required parameter: '{at}.output'", code="missing_required_parameter")
    return {"role": "tool", "tool_call_id": call_id, "content": _content_text(output, f"{at}.output")}


def _check_str(value: object, at: str, optional: bool = False) -> str:
    if value is None and optional:
        return ""
    if value is None:
        raise ResponseItemError(f"missing required parameter: '{at}'", code="missing_required_parameter")
    if not isinstance(value, str) or not value:
        raise ResponseItemError(f"{at} must be a non-empty string, got {value!r}")
    return value


def output_message(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    """An assistant message item of a response's ``output``: one ``output_text`` part."""
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [output_text_part(text)]}


def output_text_part(text: str) -> dict[str, Any]:
    """A message's ``output_text`` content part."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    """A ``function_call`` item of a response's ``output``."""
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    """A ``reasoning`` item of a response's ``output``: the model's thinking as one ``reasoning_text`` part."""
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}
