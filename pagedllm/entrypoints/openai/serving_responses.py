"""``POST /v1/responses`` (OpenAI's Responses API, which Codex speaks), ``GET`` and ``DELETE /v1/responses/{id}``.

A request is translated into a chat request (``responses_protocol.py``) and
served by the chat route's machinery (``serving_chat.OpenAIServingChat``: its
template, tool parser, reasoning parser, harmony rendering, grammar
compile). The output is read step by step through the same parsers as a
streamed chat reply and built into Responses items (``response_output.py``):
streamed as the Responses events (``response.created``,
``response.output_text.delta``, ``response.function_call_arguments.delta``,
``response.completed``... each with its ``sequence_number``), or returned
whole. With ``store`` (OpenAI's default) the response and its conversation
are kept in a bounded memory store (``response_store.py``) for
``previous_response_id`` and ``GET``; a restart forgets them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Query, Request
from fastapi.responses import Response
from pydantic import ValidationError
from sse_starlette import ServerSentEvent

from pagedllm.engine.protocol import EngineDeadError, EngineStepError, RequestStream
from pagedllm.entrypoints.openai.engine_errors import engine_failure, server_error
from pagedllm.entrypoints.openai.json_response import OpenAIJSONResponse
from pagedllm.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    bad_request,
    describe_validation_error,
)
from pagedllm.entrypoints.openai.reasoning_parsers import ReplyParser
from pagedllm.entrypoints.openai.response_input_items import DEFAULT_LIMIT, give_ids, list_page
from pagedllm.entrypoints.openai.response_items import (
    ResponseItemError,
    new_item_id,
    normalize_input,
)
from pagedllm.entrypoints.openai.response_output import ResponseOutputBuilder
from pagedllm.entrypoints.openai.response_store import ResponseStore, StoredResponse
from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.settings import ServerSettings
from pagedllm.entrypoints.openai.sse import sse_response, watch_disconnect
from pagedllm.entrypoints.openai.tool_parsers import DeltaMessage, ToolParser

logger = logging.getLogger(__name__)

# chat's field names in errors -> the Responses field the client sent
_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens", "response_format": "text",
           "reasoning_effort": "reasoning", "chat_template_kwargs": "reasoning"}


class OpenAIServingResponses:
    """The Responses handler, on top of the chat handler (one choice per response).

    Args:
        chat: the server's chat handler (its engine client, prompts, parsers and limits).
        store: where stored responses are kept.
    """

    def __init__(self, chat: OpenAIServingChat, store: ResponseStore) -> None:
        self.chat = chat
        self.store = store

    async def create(self, req: ResponsesRequest, request: Request) -> Response:
        """Answer one Responses request, streamed or whole."""
        chat = self.chat
        chat.check_model(req.model)
        req.check()
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            history = self._stored(req.previous_response_id, "previous_response_id").conversation
        new_items = _checked_input(req)
        creq = _to_chat(req, history + new_items, chat.harmony)
        rid = new_item_id("resp")
        sub, parser = await self._submit(rid, creq, request)
        state = _ResponseState(rid, req, chat.model_name, history + new_items)
        if not req.stream:
            return await self._whole(request, sub, parser, state)
        events = self._events(sub, parser, state)
        return sse_response(events, on_close=sub.abort, writes=chat.stream_writes)

    async def _submit(
        self, rid: str, creq: ChatCompletionRequest, request: Request
    ) -> tuple[RequestStream, ToolParser | ReplyParser | None]:
        """Check and queue the chat request as the chat route does; its stream and the parser of its output."""
        chat = self.chat
        try:  # the chat route's own checks, defaults and rendering; its errors named as Responses names them
            params, tools, encoded = await chat.prepare(creq, request, delta=True)  # both answers read step by step
        except APIError as e:
            raise _renamed(e) from e
        sub = await chat.add_requests(rid, [encoded], params, "input")
        parser: ToolParser | ReplyParser | None
        if chat.reasoning_parser is not None:
            max_calls = None if tools.parallel_tool_calls else 1
            reasoning = chat.reasoning_parser(prompt_text=encoded[0], calls_allowed=tools.parses_calls,
                                              max_calls=max_calls)
            parser = ReplyParser(reasoning, tools.new_parser(chat.tool_parser))
        else:
            parser = tools.new_parser(chat.tool_parser)
        return sub, parser

    async def _run(
        self, sub: RequestStream, parser: ToolParser | ReplyParser | None, state: _ResponseState
    ) -> AsyncIterator[list[dict[str, Any]]]:
        """The output, step by step, as each step's events (the builder in ``state`` keeps the items)."""
        builder = state.builder
        state.num_prompt_tokens = sub.prompt_token_counts[0]
        async for _, out in sub.outputs():
            state.num_cached_tokens = out.num_cached_tokens
            if out.error is not None:  # the request failed on its own inside a step; the others went on
                state.error = server_error(f"the engine failed on this request: {out.error}")
            for c in out.outputs:  # DELTA outputs: a step may carry none (nothing new for the choice)
                state.num_output_tokens += len(c.token_ids)
                builder.add(_feed(parser, c.text, c.token_ids), len(c.token_ids))
                if c.finish_reason is not None:
                    if parser is not None:
                        builder.add(parser.finish())
                    state.finish_reason = c.finish_reason
                    builder.finish(incomplete=c.finish_reason == "length")
            yield builder.take_events()

    async def _whole(
        self, request: Request, sub: RequestStream, parser: ToolParser | ReplyParser | None, state: _ResponseState
    ) -> OpenAIJSONResponse:
        """Wait for the whole output (aborted if the client leaves); the response body."""
        watcher = asyncio.create_task(watch_disconnect(request, sub.abort))
        try:
            async for _ in self._run(sub, parser, state):
                pass
        except (EngineStepError, EngineDeadError) as e:
            raise engine_failure(e) from e
        finally:
            watcher.cancel()
            sub.abort()  # no-op unless something above failed
        if state.error is not None:
            raise state.error
        if state.finish_reason is None or state.finish_reason == "abort":
            raise APIError(499, "the client closed the request", "invalid_request_error", "client_closed")
        body = state.body()
        self._keep(state, body)
        return OpenAIJSONResponse(body)

    async def _events(
        self, sub: RequestStream, parser: ToolParser | ReplyParser | None, state: _ResponseState
    ) -> AsyncIterator[ServerSentEvent]:
        """The stream: created, in progress, each step's events, then completed (or incomplete, or failed)."""
        seq = _Sequence()
        yield seq.event({"type": "response.created", "response": state.body("in_progress")})
        yield seq.event({"type": "response.in_progress", "response": state.body("in_progress")})
        try:
            async for events in self._run(sub, parser, state):
                for event in events:
                    yield seq.event(event)
        except (EngineStepError, EngineDeadError) as e:
            yield seq.event({"type": "response.failed", "response": state.body("failed", engine_failure(e))})
            return
        except Exception as e:  # a bug here fails this stream only, with a message
            logger.exception("streaming a response failed")
            err = server_error(f"internal error: {type(e).__name__}")
            yield seq.event({"type": "response.failed", "response": state.body("failed", err)})
            return
        if state.error is not None:
            yield seq.event({"type": "response.failed", "response": state.body("failed", state.error)})
            return
        if state.finish_reason is None or state.finish_reason == "abort":
            return  # aborted: the client is gone
        body = state.body()
        self._keep(state, body)
        yield seq.event({"type": f"response.{body['status']}", "response": body})

    def _keep(self, state: _ResponseState, body: dict[str, Any]) -> None:
        if state.req.store:
            give_ids(state.conversation)  # the input items' ids, fixed once for GET .../input_items
            self.store.put(body["id"], body, state.conversation + state.output_items(), len(state.conversation))

    def _stored(self, response_id: str, param: str | None) -> StoredResponse:
        """The stored response, or a 404 saying why it may be missing (``param``: the request field naming it)."""
        entry = self.store.get(response_id)
        if entry is None:
            raise APIError(404, f"Response with id '{response_id}' not found. Responses are kept in this "
                           "server's memory only while it runs and within its store limits (a restart forgets "
                           "them), and only when created with store=true.", "invalid_request_error",
                           "response_not_found" if param is None else "previous_response_not_found", param)
        return entry

    def get(self, response_id: str) -> dict[str, Any]:
        """A stored response's body; 404 when it is not (or no longer) stored."""
        return self._stored(response_id, None).body

    def input_items(
        self, response_id: str, order: str, limit: int, after: str | None, before: str | None,
        include: Sequence[str] = (),
    ) -> dict[str, Any]:
        """A page of the input items a stored response was generated from (``response_input_items.py``); 404
        when it is not stored, 400 for a bad order, limit, cursor or ``include`` value."""
        entry = self._stored(response_id, None)
        return list_page(entry.conversation[: entry.num_input_items], order, limit, after, before, include)

    def delete(self, response_id: str) -> dict[str, Any]:
        """Forget a stored response; 404 when it is not stored."""
        self._stored(response_id, None)
        self.store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}


class _ResponseState:
    """What one response accumulates while it runs, and its body (``Response``) at any moment."""

    def __init__(self, rid: str, req: ResponsesRequest, model: str, conversation: list[dict[str, Any]]) -> None:
        self.rid = rid
        self.req = req
        self.model = model
        self.conversation = conversation
        self.created_at = int(time.time())
        self.builder = ResponseOutputBuilder()
        self.finish_reason: str | None = None
        self.error: APIError | None = None
        self.num_prompt_tokens = 0
        self.num_output_tokens = 0
        self.num_cached_tokens = 0

    def output_items(self) -> list[dict[str, Any]]:
        """The output items, as they are fed back as input (everything but their stream-only state)."""
        return [dict(item) for item in self.builder.items]

    def body(self, status: str | None = None, error: APIError | None = None) -> dict[str, Any]:
        """The ``Response`` object; ``status`` None: the finished one (``completed`` or ``incomplete``)."""
        req = self.req
        done = status is None
        if done:
            status = "incomplete" if self.finish_reason == "length" else "completed"
        body: dict[str, Any] = {
            "id": self.rid, "object": "response", "created_at": self.created_at, "status": status,
            "error": None if error is None else {"code": "server_error", "message": error.message},
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": self.model,
            "output": self.output_items() if done else [], "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None,
                          "summary": req.reasoning.summary if req.reasoning else None},
            "store": req.store, "temperature": req.temperature, "top_p": req.top_p,
            "text": {"format": _text_format(req)}, "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [], "truncation": "disabled", "usage": self.usage() if done else None,
            "user": req.user, "metadata": req.metadata or {},
        }
        if done:
            body["completed_at"] = int(time.time())
        return body

    def usage(self) -> dict[str, Any]:
        """OpenAI's Responses ``usage``: input (and cached) tokens, output (and reasoning) tokens."""
        return {
            "input_tokens": self.num_prompt_tokens,
            "input_tokens_details": {"cached_tokens": self.num_cached_tokens, "cache_write_tokens": 0},
            "output_tokens": self.num_output_tokens,
            "output_tokens_details": {"reasoning_tokens": self.builder.num_reasoning_tokens},
            "total_tokens": self.num_prompt_tokens + self.num_output_tokens,
        }


def _feed(parser: ToolParser | ReplyParser | None, text: str, token_ids: list[int]) -> DeltaMessage | None:
    """One step's new output through the choice's parser (None: the text is the content)."""
    if parser is None:
        return DeltaMessage(content=text) if text else None
    if isinstance(parser, ReplyParser):
        return parser.feed(text, token_ids) if text or token_ids else None
    return parser.feed(text) if text else None


def _text_format(req: ResponsesRequest) -> dict[str, Any]:
    fmt = req.text.format if req.text is not None else None
    return {"type": "text"} if fmt is None else fmt.model_dump(by_alias=True, exclude_none=True)


class _Sequence:
    """Numbers a stream's events (``sequence_number``, from 0) and frames them as named server-sent events."""

    def __init__(self) -> None:
        self.next = 0

    def event(self, data: dict[str, Any]) -> ServerSentEvent:
        data["sequence_number"] = self.next
        self.next += 1
        return ServerSentEvent(data=json.dumps(data, ensure_ascii=False), event=data["type"])


def _checked_input(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as items; 400 for a malformed one."""
    try:
        return normalize_input(req.input)
    except ResponseItemError as e:
        raise bad_request(str(e), e.param, e.code) from e


def _to_chat(req: ResponsesRequest, conversation: list[dict[str, Any]], harmony: bool) -> ChatCompletionRequest:
    """The chat request; a chat field refused by its schema is a 400 naming the Responses field."""
    try:
        return req.to_chat_request(conversation, harmony)
    except ValidationError as e:
        errors = [{**err, "loc": ("body", *err["loc"])} for err in e.errors()]
        raise _renamed(describe_validation_error(errors)) from e


def _renamed(e: APIError) -> APIError:
    """A chat route's error with the Responses name of the field at fault."""
    if e.param in _PARAMS:
        e.param = _PARAMS[e.param]
    return e


def add_responses_routes(app: FastAPI, chat: OpenAIServingChat, settings: ServerSettings) -> None:
    """``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{response_id}``, ``GET
    /v1/responses/{response_id}/input_items`` (``app.state.responses``);
    the store's bounds are the settings' (``--max-num-stored-responses``, ``--max-stored-response-bytes``)."""
    from pagedllm.entrypoints.openai.api_server import _ERRORS, _GENERATING
    from pagedllm.entrypoints.openai.guards import require_json

    store = ResponseStore(settings.max_num_stored_responses, settings.max_stored_response_bytes)
    serving = OpenAIServingResponses(chat, store)
    app.state.responses = serving

    @app.post("/v1/responses", response_model=None, dependencies=[Depends(require_json)], responses=_GENERATING)
    async def create_response(req: ResponsesRequest, request: Request) -> Response:
        """OpenAI's Responses API: the model's output items for a conversation (``input``, or a stored one)."""
        return await serving.create(req, request)

    @app.get("/v1/responses/{response_id}", responses=_ERRORS)
    async def get_response(response_id: str) -> dict[str, Any]:
        """A stored response; 404 when it is not stored (``store`` false, evicted, or before a restart)."""
        return serving.get(response_id)

    @app.get("/v1/responses/{response_id}/input_items", responses=_ERRORS)
    async def list_input_items(
        response_id: str, order: str = "desc", limit: int = DEFAULT_LIMIT, after: str | None = None,
        before: str | None = None, include: Annotated[list[str] | None, Query()] = None,
        include_brackets: Annotated[list[str] | None, Query(alias="include[]")] = None,
    ) -> dict[str, Any]:
        """The input items of a stored response, a page at a time (OpenAI's list: ``order``, ``limit``,
        ``after``, ``before``, ``include``: repeated as ``include=`` or, as the openai client sends it,
        ``include[]=``; values this server cannot serve are a 400, ``response_input_items.check_include``)."""
        return serving.input_items(response_id, order, limit, after, before, [*(include or ()),
                                                                             *(include_brackets or ())])

    @app.delete("/v1/responses/{response_id}", responses=_ERRORS)
    async def delete_response(response_id: str) -> dict[str, Any]:
        """Forget a stored response; 404 when it is not stored."""
        return serving.delete(response_id)
