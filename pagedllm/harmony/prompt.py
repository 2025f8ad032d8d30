"""OpenAI chat messages, function tools and ``reasoning_effort`` rendered as a harmony prompt.

The canonical prompt for a gpt-oss model is openai-harmony's renderer, not
the chat template shipped with the checkpoint (vLLM makes the same choice):
the renderer is OpenAI's reference for the format the model was trained on,
it places ``reasoning_effort`` in the system message and the tools in the
developer message as TypeScript-like ``namespace functions``, it drops the
analysis of earlier turns the way the format requires, and it yields token
ids directly, so no text round trip through a tokenizer can split a special
token. The model's own template is only used to detect the format.

Mapping (messages as ``tool_messages.to_template_messages`` returns them):

- a harmony ``system`` message is always first, with the reasoning effort
  (``medium`` unless the request sets one);
- OpenAI ``system`` / ``developer`` messages (the template form has both as
  ``system``) become the developer message's instructions, joined by blank
  lines; the request's function tools go in the same developer message;
- ``user`` -> user; ``assistant`` content -> a ``final`` channel message;
  each assistant ``tool_calls`` entry -> a ``commentary`` message to
  ``functions.NAME`` with ``<|constrain|>json`` and the arguments' JSON;
- ``tool`` -> a message from ``functions.NAME`` to the assistant on
  ``commentary``, NAME being the function of the call it answers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pagedllm.harmony.vocab import harmony_encoding

REASONING_EFFORTS = ("low", "medium", "high")


def render_prompt(
    messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
    reasoning_effort: str | None = None,
) -> list[int]:
    """The prompt token ids of the conversation, ending where the assistant's reply begins.

    ``messages``: in the chat-template form (``to_template_messages``);
    ``tools``: OpenAI function tools (``{"type": "function", "function": {...}}``);
    ``reasoning_effort``: ``low``, ``medium`` or ``high`` (None: medium).
    ValueError for an unknown effort or a message harmony cannot express.
    """
    from openai_harmony import Conversation, Role

    if reasoning_effort is not None and reasoning_effort not in REASONING_EFFORTS:
        raise ValueError(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {reasoning_effort!r}")
    instructions = [m.get("content") or "" for m in messages if m["role"] in ("system", "developer")]
    rendered = [_system_message(reasoning_effort)]
    developer = _developer_message("\n\n".join(i for i in instructions if i), tools)
    if developer is not None:
        rendered.append(developer)
    call_names: dict[str, str] = {}  # call id -> function, for tool results that do not name it
    for message in messages:
        for call in message.get("tool_calls") or []:
            call_names[call.get("id", "")] = call.get("function", call)["name"]
        if message["role"] == "tool" and not message.get("name"):
            message = {**message, "name": call_names.get(message.get("tool_call_id", ""), "")}
        rendered.extend(_turn(message))
    conversation = Conversation.from_messages(rendered)
    return list(harmony_encoding().render_conversation_for_completion(conversation, Role.ASSISTANT))


def _system_message(reasoning_effort: str | None) -> Any:
    from openai_harmony import Message, ReasoningEffort, Role, SystemContent

    effort = ReasoningEffort(reasoning_effort.capitalize()) if reasoning_effort else ReasoningEffort.MEDIUM
    return Message.from_role_and_content(Role.SYSTEM, SystemContent.new().with_reasoning_effort(effort))


def _developer_message(instructions: str, tools: list[dict[str, Any]] | None) -> Any:
    """The developer message with the instructions and the function tools; None when it has neither."""
    from openai_harmony import DeveloperContent, Message, Role, ToolDescription

    if not instructions and not tools:
        return None
    content = DeveloperContent.new()
    if instructions:
        content = content.with_instructions(instructions)
    if tools:
        content = content.with_function_tools([
            ToolDescription.new(f["name"], f.get("description") or "", parameters=f.get("parameters"))
            for f in (t["function"] for t in tools)
        ])
    return Message.from_role_and_content(Role.DEVELOPER, content)


def _turn(message: dict[str, Any]) -> list[Any]:
    """The harmony messages of one conversation turn (system/developer ones went to the developer message)."""
    from openai_harmony import Author, Message, Role

    role, content = message["role"], message.get("content") or ""
    if role in ("system", "developer"):
        return []
    if role == "user":
        return [Message.from_role_and_content(Role.USER, content)]
    if role == "tool":
        author = Author.new(Role.TOOL, f"functions.{message.get('name') or ''}")
        return [Message.from_author_and_content(author, content).with_channel("commentary").with_recipient("assistant")]
    if role != "assistant":
        raise ValueError(f"harmony has no {role!r} messages")
    out = []
    if content:
        out.append(Message.from_role_and_content(Role.ASSISTANT, content).with_channel("final"))
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call)
        arguments = fn.get("arguments")
        text = arguments if isinstance(arguments, str) else json.dumps(arguments if arguments is not None else {})
        out.append(
            Message.from_role_and_content(Role.ASSISTANT, text).with_channel("commentary")
            .with_recipient(f"functions.{fn['name']}").with_content_type("<|constrain|>json")
        )
    return out
