"""An Anthropic messages request as the chat completions request it means, so one machinery serves both.

What maps onto what:

- ``system`` (a string or text blocks) -> a leading ``system`` message;
- a message's text blocks -> its content (joined by newlines, as list-of-parts content is);
- an assistant's ``tool_use`` blocks -> its ``tool_calls`` (``input`` as the arguments);
  its ``thinking`` blocks -> ``reasoning_content`` (templates do not show old thinking);
- a user's ``tool_result`` blocks -> ``tool`` messages right after the calls they answer
  (``is_error`` results are prefixed ``Error:``), then the rest of its text as a user message;
- ``tools`` (``input_schema``) -> function tools; ``tool_choice`` ``auto`` / ``any`` / ``tool`` /
  ``none`` -> ``auto`` / ``required`` / the named function / ``none``;
  ``disable_parallel_tool_use`` -> ``parallel_tool_calls: false``;
- ``thinking`` ``enabled`` / ``disabled`` -> the template variable ``enable_thinking`` true / false;
  ``enabled``'s ``budget_tokens`` -> ``thinking_token_budget`` (gpt-oss's analysis channel included);
- ``stop_sequences`` -> ``stop``; ``max_tokens``, ``temperature``, ``top_p``, ``top_k`` as they are.

Image and document blocks are refused (the model takes no images), and so
is a conversation ending with an assistant turn (prefill): a chat template
cannot render a reply to continue. Everything else the chat route checks
(tool results answering calls, schemas, sampling values) it checks here too.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from pagedllm.entrypoints.anthropic.protocol import (
    CountTokensRequest,
    MediaBlock,
    MessagesRequest,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ThinkingEnabled,
    ToolChoiceAny,
    ToolChoiceAuto,
    ToolChoiceTool,
    ToolResultBlock,
    ToolUseBlock,
)
from pagedllm.entrypoints.anthropic.protocol import Message as AnthropicMessage
from pagedllm.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    bad_request,
    describe_validation_error,
)


def to_chat_request(req: CountTokensRequest, can_think: bool) -> ChatCompletionRequest:
    """The chat completions request ``req`` means; APIError (400) for what this server cannot do.

    ``can_think``: whether the server has a reasoning parser (thinking blocks need one).
    A ``CountTokensRequest`` makes a request with no sampling fields: only its prompt is used.
    """
    if req.messages[-1].role == "assistant":
        raise bad_request("Prefill is not supported: the last message must be a user message (a chat template "
                          "cannot render an assistant reply to continue)", "messages")
    if isinstance(req.thinking, ThinkingEnabled) and not can_think:
        raise bad_request("thinking is enabled but this server has no reasoning parser to read the model's "
                          "thinking; start it with --reasoning-parser NAME (qwen3, deepseek_r1, ...) or leave "
                          "thinking unset", "thinking")
    body: dict[str, Any] = {"model": req.model, "messages": _messages(req)}
    body.update(_tools(req))
    if req.thinking is not None and req.thinking.type != "adaptive":
        body["chat_template_kwargs"] = {"enable_thinking": req.thinking.type == "enabled"}
    if isinstance(req.thinking, ThinkingEnabled):
        # the block is closed after this many tokens (thinking.py); a count too: on harmony the budget's
        # prompt opens the analysis message (harmony/thinking.py), so it counts those tokens
        body["thinking_token_budget"] = req.thinking.budget_tokens
    if isinstance(req, MessagesRequest):
        body.update(_sampling(req))
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:  # what the Anthropic schema let through and the chat schema does not
        raise describe_validation_error([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from e


def _sampling(req: MessagesRequest) -> dict[str, Any]:
    if isinstance(req.thinking, ThinkingEnabled) and req.thinking.budget_tokens >= req.max_tokens:
        raise bad_request(f"thinking.budget_tokens ({req.thinking.budget_tokens}) must be less than max_tokens "
                          f"({req.max_tokens})", "thinking")
    fields = {"max_tokens": req.max_tokens, "stop": req.stop_sequences, "temperature": req.temperature,
              "top_p": req.top_p, "top_k": req.top_k, "stream": req.stream}
    return {k: v for k, v in fields.items() if v is not None}


def _tools(req: CountTokensRequest) -> dict[str, Any]:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of the chat request."""
    out: dict[str, Any] = {}
    if req.tools is not None:
        out["tools"] = [{"type": "function", "function": {
            "name": t.name, **({"description": t.description} if t.description is not None else {}),
            "parameters": t.input_schema,
        }} for t in req.tools]
    choice = req.tool_choice
    if choice is None:
        return out
    if isinstance(choice, ToolChoiceTool):
        out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if isinstance(choice, (ToolChoiceAuto, ToolChoiceAny, ToolChoiceTool)) and choice.disable_parallel_tool_use:
        out["parallel_tool_calls"] = False
    return out


def _messages(req: CountTokensRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if req.system is not None:
        system = req.system if isinstance(req.system, str) else _join_text(req.system, "system")
        if system:
            out.append({"role": "system", "content": system})
    for i, message in enumerate(req.messages):
        where = f"messages[{i}].content"
        if message.role == "assistant":
            out.append(_assistant(message, where))
        else:
            out.extend(_user(message, where))
    return out


def _user(message: AnthropicMessage, where: str) -> list[dict[str, Any]]:
    """A user turn: a ``tool`` message per ``tool_result`` block, then a user message with the rest."""
    if isinstance(message.content, str):
        return [{"role": "user", "content": message.content}]
    results, texts = [], []
    for j, block in enumerate(message.content):
        if isinstance(block, ToolResultBlock):
            results.append({"role": "tool", "tool_call_id": block.tool_use_id,
                            "content": _result_text(block, f"{where}[{j}].content")})
        elif isinstance(block, TextBlock):
            texts.append(block.text)
        else:
            _refuse(block, f"{where}[{j}]", "a user")
    if texts or not results:
        results.append({"role": "user", "content": "\n".join(texts)})
    return results


def _assistant(message: AnthropicMessage, where: str) -> dict[str, Any]:
    """An assistant turn: its text, its calls (``tool_use``), its thinking (kept aside, as the chat route keeps it)."""
    if isinstance(message.content, str):
        return {"role": "assistant", "content": message.content}
    texts, calls, thinking = [], [], []
    for j, block in enumerate(message.content):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif isinstance(block, ThinkingBlock):
            thinking.append(block.thinking)
        elif not isinstance(block, RedactedThinkingBlock):
            _refuse(block, f"{where}[{j}]", "an assistant")
    out: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        out["tool_calls"] = calls
    if thinking:
        out["reasoning_content"] = "\n".join(thinking)
    return out


def _result_text(block: ToolResultBlock, where: str) -> str:
    content = block.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        text = _join_text(content, where)
    # the templates have no field for a failed call: the model reads it from the text
    return f"Error: {text}" if block.is_error else text


def _join_text(blocks: list[Any], where: str) -> str:
    for j, block in enumerate(blocks):
        if not isinstance(block, TextBlock):
            _refuse(block, f"{where}[{j}]", "this")
    return "\n".join(b.text for b in blocks)


def _refuse(block: Any, where: str, whose: str) -> None:
    """A 400 for a block that cannot be where it is (an image anywhere; a tool_result from the assistant...)."""
    if isinstance(block, MediaBlock):
        what = "images" if block.type == "image" else "documents"
        raise bad_request(f"{where} is a {block.type!r} block: this model takes no {what}, only text", "messages")
    raise APIError(400, f"{where}: a {block.type!r} block cannot be in {whose} message", "invalid_request_error",
                   "invalid_value", "messages")
