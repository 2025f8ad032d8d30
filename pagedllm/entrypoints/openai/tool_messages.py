"""Chat messages with tool calls and tool results, turned into what Hugging Face chat templates read.

OpenAI's messages and the templates' differ in three places:

- an assistant message's ``tool_calls[i].function.arguments`` is a JSON
  *string*; templates (Qwen's, Llama 3's, Hermes') render it with
  ``tojson`` and expect the decoded object, as vLLM hands it to them;
- an assistant message with calls may have no ``content``; templates get
  ``""`` (several test ``message.content`` with string filters);
- a ``role: "tool"`` message carries ``tool_call_id``; templates get it, and
  also the function's ``name`` (looked up from the call it answers), which
  some templates print.

Content given as a list of parts has its text parts joined by newlines, as
vLLM does; other part types are refused. Only the fields templates read are
kept (``role``, ``content``, ``name``, ``tool_calls``, ``tool_call_id``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from pagedllm.sampling_params import check_text


class ToolMessageError(ValueError):
    """A malformed message; the text names it (``messages[2].tool_calls[0]...``). ``param`` is ``messages``."""

    param = "messages"

    def __init__(self, message: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.code = code


def to_template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as chat templates read it; ToolMessageError for a malformed message.

    ``messages`` are OpenAI's message objects as plain dicts (a pydantic
    model's ``model_dump(exclude_none=True)``). A ``tool`` message must
    answer a call made by an earlier assistant message, as OpenAI requires.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise ToolMessageError("messages must be a non-empty list")
    out: list[dict[str, Any]] = []
    call_names: dict[str, str] = {}  # id -> function name, of the calls made so far
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise ToolMessageError(f"{where} must be an object")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ToolMessageError(f"{where}.role must be a non-empty string")
        if role == "assistant":
            converted = _assistant(message, where, call_names)
        elif role == "tool":
            converted = _tool_result(message, where, call_names)
        elif role == "function":
            raise ToolMessageError(f"{where}: role 'function' is deprecated and not supported; use role 'tool'")
        else:
            converted = {"role": role, "content": _content(message.get("content"), f"{where}.content")}
        name = message.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise ToolMessageError(f"{where}.name must be a string")
            converted["name"] = name
        out.append(converted)
    return out


def _content(content: object, where: str, optional: bool = False) -> str:
    """A message's content as one string: text parts joined by newlines."""
    if content is None and optional:
        return ""
    if content is None:
        raise ToolMessageError(f"missing required parameter: '{where}'", "missing_required_parameter")
    if isinstance(content, str):
        text = content
    elif isinstance(content, Sequence) and not isinstance(content, (bytes, bytearray)):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ToolMessageError(f"{where}[{j}] must be a text part {{'type': 'text', 'text': ...}} "
                                       "(only text content is supported)")
            texts.append(part["text"])
        text = "\n".join(texts)
    else:
        raise ToolMessageError(f"{where} must be a string or a list of text parts" + ("" if not optional else " or null"))
    try:
        check_text(where, text)
    except ValueError as e:
        raise ToolMessageError(str(e)) from None
    return text


def _assistant(message: Mapping[str, Any], where: str, call_names: dict[str, str]) -> dict[str, Any]:
    """An assistant message: its content (may be empty when it makes calls) and its calls with decoded arguments."""
    calls = message.get("tool_calls")
    if not calls:
        return {"role": "assistant", "content": _content(message.get("content"), f"{where}.content")}
    if not isinstance(calls, Sequence) or isinstance(calls, (str, bytes)):
        raise ToolMessageError(f"{where}.tool_calls must be a list")
    converted = [_call(call, f"{where}.tool_calls[{j}]") for j, call in enumerate(calls)]
    for call in converted:
        call_names[call["id"]] = call["function"]["name"]
    content = _content(message.get("content"), f"{where}.content", optional=True)
    return {"role": "assistant", "content": content, "tool_calls": converted}


def _call(call: object, where: str) -> dict[str, Any]:
    """``{"id", "type": "function", "function": {"name", "arguments": <JSON text>}}`` with the arguments decoded."""
    if not isinstance(call, Mapping):
        raise ToolMessageError(f"{where} must be an object")
    call_id = call.get("id")
    if not isinstance(call_id, str) or not call_id:
        raise ToolMessageError(f"{where}.id must be a non-empty string")
    if call.get("type", "function") != "function":
        raise ToolMessageError(f"{where}.type must be 'function', got {call.get('type')!r}")
    function = call.get("function")
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str) or not function["name"]:
        raise ToolMessageError(f"{where}.function must be {{'name': str, 'arguments': str}}")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            check_text(f"{where}.function.arguments", arguments)
            arguments = json.loads(arguments)
        except ValueError as e:
            raise ToolMessageError(f"{where}.function.arguments is not valid JSON: {e}") from None
    if not isinstance(arguments, Mapping):
        raise ToolMessageError(f"{where}.function.arguments must be the JSON text of an object")
    return {"id": call_id, "type": "function", "function": {"name": function["name"], "arguments": dict(arguments)}}


def _tool_result(message: Mapping[str, Any], where: str, call_names: dict[str, str]) -> dict[str, Any]:
    """A ``tool`` message: the result of an earlier call, with that call's function name."""
    call_id = message.get("tool_call_id")
    if not isinstance(call_id, str) or not call_id:
        raise ToolMessageError(f"{where}.tool_call_id must be a non-empty string (the id of the call it answers)")
    if call_id not in call_names:
        raise ToolMessageError(f"{where}: a 'tool' message must answer a call of an earlier assistant message's "
                               f"tool_calls; no call has the id {call_id!r}")
    content = _content(message.get("content"), f"{where}.content")
    return {"role": "tool", "tool_call_id": call_id, "name": call_names[call_id], "content": content}


def template_supports_tools(chat_template: str | None) -> bool:
    """Whether a chat template reads ``tools`` at all (one that does not never shows the model its tools)."""
    return bool(chat_template) and "tools" in chat_template
