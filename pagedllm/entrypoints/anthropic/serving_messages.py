"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's Messages API, on the chat route.

A request is turned into the chat completions request it means
(``convert.py``) and served by the chat handler's parts: its checks, its
sampling defaults, the chat template, the tool parser and the reasoning
parser chosen for the server. The reply's deltas become Anthropic content
blocks (``content_blocks.py``): ``thinking`` from the reasoning parser,
``text``, ``tool_use`` from the tool parser, or from the grammar that
``tool_choice`` ``any`` / ``tool`` forces. Streamed, the events are
Anthropic's: ``message_start``, ``ping``, ``content_block_start`` /
``content_block_delta`` / ``content_block_stop`` per block, ``message_delta``
(the stop reason and usage), ``message_stop``; a failure after the stream
began is an ``error`` event.

``usage.input_tokens`` counts the prompt tokens the engine computed and
``cache_read_input_tokens`` those it found in its prefix cache (their sum is
the prompt, as ``count_tokens`` counts it); a stream's ``message_start``
cannot know the split yet and counts the whole prompt as input, and its
``message_delta`` gives the split.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response

from pagedllm.engine.protocol import EngineDeadError, EngineStepError, RequestStream
from pagedllm.entrypoints.anthropic.content_blocks import ContentBlocks, stop_reason
from pagedllm.entrypoints.anthropic.convert import to_chat_request
from pagedllm.entrypoints.anthropic.errors import AnthropicErrorMiddleware, anthropic_error
from pagedllm.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from pagedllm.entrypoints.openai.engine_errors import engine_failure, to_api_error
from pagedllm.entrypoints.openai.guards import require_json
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, bad_request
from pagedllm.entrypoints.openai.reasoning_parsers import ReplyParser
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.sse import sse_response
from pagedllm.entrypoints.openai.tool_choice import ToolSpec
from pagedllm.entrypoints.openai.tool_parsers import DeltaMessage, ToolParser
from pagedllm.outputs import RequestOutput

logger = logging.getLogger(__name__)


class AnthropicServingMessages:
    """The Messages API handler, on the server's chat handler (its template, parsers and limits)."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def create(self, req: MessagesRequest, request: Request) -> Response:
        """Answer one messages request, streamed or whole."""
        chat = self.chat
        body = self._chat_request(req)
        params, tools, encoded = await chat.prepare(body, request, delta=req.stream)  # the chat route's rules
        rid = f"msg_{uuid.uuid4().hex}"
        sub = await chat.add_requests(rid, [encoded], params, "messages")
        header = {"id": rid, "type": "message", "role": "assistant", "model": req.model}
        reply = _Reply(self._parser(encoded[0], tools, buffered=not req.stream))
        if not req.stream:
            prompt_len = sub.prompt_token_counts[0]
            return await chat.wait_all(request, sub, lambda outs: _message(header, prompt_len, outs[0], reply))
        return sse_response(_events(header, sub, reply), on_close=sub.abort, writes=chat.stream_writes)

    async def count_tokens(self, req: CountTokensRequest) -> dict[str, int]:
        """The number of tokens of the prompt the same messages request would give the engine."""
        body = self._chat_request(req)
        tools = await asyncio.to_thread(body.tool_spec, self.chat.grammar_limits)
        try:
            _, ids = await self.chat.encode_prompt(body, tools, None)
        except Exception as e:
            raise to_api_error(e, "messages") from e
        return {"input_tokens": len(ids)}

    def _chat_request(self, req: CountTokensRequest) -> ChatCompletionRequest:
        """The request as a chat request; 404 for another model, 400 for what this server cannot serve."""
        chat = self.chat
        chat.check_model(req.model)
        if not chat.has_template and not chat.harmony:
            raise bad_request("this model has no chat template, so it cannot chat; start the server with "
                              "--chat-template FILE", "messages", "no_chat_template")
        body = to_chat_request(req, chat.reasoning_parser is not None)
        if body.thinking_token_budget is not None and body.tool_choice not in (None, "auto", "none"):
            # as Anthropic's API: a forced call's grammar would constrain the thinking too (thinking_budget.py)
            raise bad_request("thinking may not be enabled when tool_choice forces tool use (type 'any' or 'tool'); "
                              "use tool_choice 'auto' or disable thinking", "thinking")
        if body.tools and body.tool_choice in (None, "auto") and not chat.enable_auto_tool_choice:
            raise bad_request('tool_choice "auto" needs the server started with --enable-auto-tool-choice '
                              '(it was started with --no-enable-auto-tool-choice)', "tool_choice")
        return body

    def _parser(self, prompt_text: str | None, tools: ToolSpec, buffered: bool) -> ToolParser | ReplyParser | None:
        """The reply's parser: the reasoning parser (if the server has one) before the tool parser (if any)."""
        chat = self.chat
        calls = tools.new_parser(chat.tool_parser, buffered=buffered)
        if chat.reasoning_parser is None:
            return calls
        max_calls = None if tools.parallel_tool_calls else 1
        reasoning = chat.reasoning_parser(prompt_text=prompt_text, calls_allowed=tools.parses_calls,
                                          max_calls=max_calls)
        return ReplyParser(reasoning, calls)


class _Reply:
    """One reply's parser and blocks: feed each new piece of output, then finish."""

    def __init__(self, parser: ToolParser | ReplyParser | None) -> None:
        self.parser = parser
        self.blocks = ContentBlocks()

    def feed(self, text: str, token_ids: Sequence[int]) -> list[dict[str, Any]]:
        """The events of the output's next piece."""
        if self.parser is None:
            delta = DeltaMessage(content=text) if text else None
        elif isinstance(self.parser, ReplyParser):
            delta = self.parser.feed(text, token_ids) if text or token_ids else None
        else:
            delta = self.parser.feed(text) if text else None
        return self.blocks.add(delta)

    def finish(self) -> list[dict[str, Any]]:
        """The output ended: what the parser held back, then the last block's stop."""
        tail = self.parser.finish() if self.parser is not None else None
        return self.blocks.add(tail) + self.blocks.close()


def _usage(prompt_len: int, out: RequestOutput, num_output_tokens: int) -> dict[str, int]:
    cached = min(out.num_cached_tokens, prompt_len)
    return {"input_tokens": prompt_len - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": num_output_tokens}


def _message(header: dict[str, Any], prompt_len: int, out: RequestOutput, reply: _Reply) -> dict[str, Any]:
    """The whole answer: Anthropic's ``Message``."""
    c = out.outputs[0]
    reply.feed(c.text, c.token_ids)
    reply.finish()
    reason, sequence = stop_reason(c.finish_reason, c.stop_reason, reply.blocks.num_calls)
    return {**header, "content": reply.blocks.content(), "stop_reason": reason, "stop_sequence": sequence,
            "usage": _usage(prompt_len, out, len(c.token_ids))}


def _event(data: dict[str, Any]) -> dict[str, str]:
    """One server-sent event, named by its type as Anthropic names them."""
    return {"event": data["type"], "data": json.dumps(data, ensure_ascii=False)}


async def _events(header: dict[str, Any], sub: RequestStream, reply: _Reply) -> AsyncIterator[dict[str, str]]:
    """The stream's events; a failure after it began ends it with an ``error`` event."""
    prompt_len = sub.prompt_token_counts[0]
    yield _event({"type": "message_start", "message": {
        **header, "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": prompt_len, "output_tokens": 0}}})
    yield _event({"type": "ping"})
    num_tokens, last, ending = 0, None, None
    try:
        async for _, out in sub.outputs():
            last = out
            for c in out.outputs:
                num_tokens += len(c.token_ids)
                for event in reply.feed(c.text, c.token_ids):
                    yield _event(event)
                if c.finish_reason is not None:
                    ending = (c.finish_reason, c.stop_reason)
        if ending is None or last is None:
            yield _event(anthropic_error(503, "the request ended before its reply did (the server is stopping)"))
            return
        for event in reply.finish():
            yield _event(event)
        reason, sequence = stop_reason(*ending, reply.blocks.num_calls)
        yield _event({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                      "usage": _usage(prompt_len, last, num_tokens)})
        yield _event({"type": "message_stop"})
    except (EngineStepError, EngineDeadError) as e:
        err = engine_failure(e)
        yield _event(anthropic_error(err.status_code, err.message))
    except Exception as e:  # a bug here fails this stream only, with a message
        logger.exception("streaming a messages reply failed")
        yield _event(anthropic_error(500, f"internal error: {type(e).__name__}"))


def add_messages_routes(app: FastAPI, chat: OpenAIServingChat) -> None:
    """``POST /v1/messages`` and ``POST /v1/messages/count_tokens``, their errors in Anthropic's shape.

    Call it after the app's other middleware is added: its error rewriting must be outermost.
    The routes are left out of ``/openapi.json``, which describes OpenAI's error body; docs/messages-api.md
    describes them.
    """
    handler = AnthropicServingMessages(chat)
    app.add_middleware(AnthropicErrorMiddleware)
    json_body = [Depends(require_json)]

    @app.post("/v1/messages", response_model=None, dependencies=json_body, include_in_schema=False)
    async def messages(req: MessagesRequest, request: Request) -> Response:
        """Anthropic's messages: the assistant's next turn for a conversation."""
        return await handler.create(req, request)

    @app.post("/v1/messages/count_tokens", dependencies=json_body, include_in_schema=False)
    async def count_tokens(req: CountTokensRequest) -> dict[str, int]:
        """The number of prompt tokens a messages request would have."""
        return await handler.count_tokens(req)
