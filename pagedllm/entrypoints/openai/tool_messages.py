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
vLLM does; other part types are refused (``engine/chat_content.py``: an image part says
the model takes no images). Only the fields templates read are
kept (``role``, ``content``, ``name``, ``tool_calls``, ``tool_call_id``).

Roles are OpenAI's five (``ROLES``); anything else is refused, since the
template prints the role verbatim (``"system<|im_end|>"`` would inject
special tokens). A ``developer`` message reaches the template as
``system``: OpenAI's newer models read developer messages as the system
instructions, and chat templates know only ``system``.

Tool results follow OpenAI's rules: ``tool`` messages come right after the
assistant message whose ``tool_calls`` they answer (or after another such
``tool`` message), each answers one of those calls by its id, and no call
is answered twice; call ids within one assistant message are distinct.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from pagedllm.engine.chat_content import content_text
from pagedllm.sampling_params import check_text

# the roles OpenAI's chat completions define
ROLES = ("system", "developer", "user", "assistant", "tool")


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
    # the calls the tool messages that follow may answer: those of the last assistant message,
    # until a message other than a tool result comes (id -> function name), and those answered
    open_calls: dict[str, str] = {}
    answered: set[str] = set()
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise ToolMessageError(f"{where} must be an object")
        role = _role(message.get("role"), where)
        if role != "tool":
            open_calls, answered = {}, set()
        if role == "assistant":
            converted = _assistant(message, where, open_calls)
        elif role == "tool":
            converted = _tool_result(message, where, open_calls, answered)
        else:
            # developer instructions are the system prompt to a chat template (see the module's doc)
            converted = {"role": "system" if role == "developer" else role,
                         "content": _content(message.get("content"), f"{where}.content")}
        name = message.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise ToolMessageError(f"{where}.name must be a string")
            converted["name"] = name
        out.append(converted)
    return out


def _role(role: object, where: str) -> str:
    """A message's role, one of ``ROLES``."""
    if role == "function":
        raise ToolMessageError(f"{where}: role 'function' is deprecated and not supported; use role 'tool'")
    if not isinstance(role, str) or role not in ROLES:
        raise ToolMessageError(f"{where}.role must be one of {', '.join(map(repr, ROLES))}, got {role!r}")
    return role


def _content(content: object, where: str, optional: bool = False) -> str:
    """A message's content as one string: text parts joined by newlines."""
    if content is None and optional:
        return ""
    if content is None:
        raise ToolMessageError(f"missing required parameter: '{where}'", "missing_required_parameter")
    try:
        text = content_text(content, where)
    except ValueError as e:
        raise ToolMessageError(str(e) + ("" if not optional or isinstance(content, Sequence) else " or null")) from None
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
    for j, call in enumerate(converted):
        if call["id"] in call_names:
            # a tool result could not say which of the two it answers
            raise ToolMessageError(f"{where}.tool_calls[{j}].id: duplicate call id {call['id']!r} "
                                   "(the ids of one message's tool_calls must be distinct)")
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


def _tool_result(
    message: Mapping[str, Any], where: str, open_calls: dict[str, str], answered: set[str]
) -> dict[str, Any]:
    """A ``tool`` message: the result of a call of the assistant message before it, with that call's name."""
    call_id = message.get("tool_call_id")
    if not isinstance(call_id, str) or not call_id:
        raise ToolMessageError(f"{where}.tool_call_id must be a non-empty string (the id of the call it answers)")
    if not open_calls:
        raise ToolMessageError(f"{where}: a 'tool' message must answer a call of the assistant message's "
                               f"tool_calls right before it; no call has the id {call_id!r} there")
    if call_id not in open_calls:
        raise ToolMessageError(f"{where}: a 'tool' message must answer a call of the assistant message's "
                               f"tool_calls right before it; no call has the id {call_id!r} (the calls: "
                               f"{', '.join(map(repr, open_calls))})")
    if call_id in answered:
        raise ToolMessageError(f"{where}: the call {call_id!r} is answered twice")
    answered.add(call_id)
    content = _content(message.get("content"), f"{where}.content")
    return {"role": "tool", "tool_call_id": call_id, "name": open_calls[call_id], "content": content}


def template_supports_tools(chat_template: str | None) -> bool:
    """Whether a chat template reads ``tools`` at all (one that does not never shows the model its tools)."""
    return bool(chat_template) and "tools" in chat_template
