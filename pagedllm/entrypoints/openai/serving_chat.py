"""``POST /v1/chat/completions``: a conversation through the chat template, the assistant's reply out.

With ``tools`` the tools go to the template, and the reply is read for
calls (``tool_choice.py``, ``tool_parsers/``): in the model's own format
for ``"auto"``, or as the JSON a grammar forces for ``"required"`` and a
named function. Calls come back as ``message.tool_calls`` or, streamed, as
``delta.tool_calls`` pieces, as OpenAI sends them.

With a reasoning parser (``--reasoning-parser``, or one chosen from the
model and its chat template) each choice's output goes through it first
(``reasoning_parsers/``): the thinking comes back as
``message.reasoning_content`` / ``delta.reasoning_content``. A gpt-oss
model's prompt is rendered by openai-harmony (``harmony/prompt.py``), with
``reasoning_effort``, and its calls come from harmony's ``commentary``
messages; generation stops at ``<|return|>`` or ``<|call|>``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from pagedllm.engine.protocol import EngineClient, Prompt, RequestStream
from pagedllm.entrypoints.openai.engine_errors import to_api_error
from pagedllm.entrypoints.openai.logprobs import chat_logprobs
from pagedllm.entrypoints.openai.prompts import PromptEncoder
from pagedllm.entrypoints.openai.protocol import APIError, ChatCompletionRequest, bad_request
from pagedllm.entrypoints.openai.reasoning_parsers import (
    ReasoningParser,
    ReplyParser,
    detect_reasoning_parser,
    get_reasoning_parser,
)
from pagedllm.entrypoints.openai.serving_engine import OpenAIServing, usage
from pagedllm.entrypoints.openai.sse import sse_chunks, sse_response
from pagedllm.entrypoints.openai.thinking import apply_thinking_budget
from pagedllm.entrypoints.openai.tool_choice import ToolSpec
from pagedllm.entrypoints.openai.tool_parsers import ToolParser, get_tool_parser
from pagedllm.harmony.detect import is_harmony_model
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class OpenAIServingChat(OpenAIServing):
    """The chat completions handler (one prompt, ``n`` choices).

    Args:
        engine_client: the engine thread's client.
        prompts: the prompt encoder.
        model_name: the served model's name.
        tool_call_parser: the model's call format for ``tool_choice="auto"``
            (``hermes``, ``llama3_json``, or ``auto``: read from the chat template).
        default_max_tokens: the cap on a reply whose request sets no
            ``max_tokens`` / ``max_completion_tokens`` (``--default-max-tokens``); None: none.
        reasoning_parser: ``gpt_oss``, ``qwen3``, ``deepseek_r1``, ``granite``, ``none``, or ``auto``
            (chosen from the model and its chat template: ``reasoning_parsers.detect_reasoning_parser``).
        enable_auto_tool_choice: whether ``tool_choice="auto"`` with tools is served (else a 400, as vLLM
            without ``--enable-auto-tool-choice``).
    """

    def __init__(
        self, engine_client: EngineClient, prompts: PromptEncoder, model_name: str, tool_call_parser: str = "auto",
        default_max_tokens: int | None = None, reasoning_parser: str = "auto", enable_auto_tool_choice: bool = True,
    ) -> None:
        super().__init__(engine_client, prompts, model_name)
        self.default_max_tokens = default_max_tokens
        self.enable_auto_tool_choice = enable_auto_tool_choice
        engine = engine_client.engine
        template = getattr(engine.tokenizer.hf, "chat_template", None)
        template = template if isinstance(template, str) else None
        self.has_template = template is not None
        self.tool_parser = get_tool_parser(tool_call_parser, template)
        arch = engine.model_config
        self.harmony = is_harmony_model(arch.architecture, arch.architectures, template)
        self.reasoning_parser = get_reasoning_parser(reasoning_parser, self.harmony, template)
        if reasoning_parser in (None, "auto"):
            why = detect_reasoning_parser(self.harmony, template)[1]
            chosen = self.reasoning_parser.name if self.reasoning_parser is not None else "none"
            logger.info("reasoning parser: %s (auto: %s; --reasoning-parser overrides)", chosen, why)
        if self.reasoning_parser is not None and self.reasoning_parser.parses_tool_calls and not self.harmony:
            raise ValueError(f"the {self.reasoning_parser.name} reasoning parser reads harmony output; "
                             "this model does not use the harmony format")
        if self.harmony and self.reasoning_parser is not None and not self.reasoning_parser.parses_tool_calls:
            # harmony's channels are read by the gpt_oss parser only; another one's markers never occur in them
            raise ValueError(f"this model writes the harmony format, which the gpt_oss reasoning parser reads, "
                             f"not the {self.reasoning_parser.name} one (--reasoning-parser gpt_oss, or leave it auto)")
        if self.harmony:
            from pagedllm.harmony.vocab import harmony_encoding

            harmony_encoding()  # loaded (and its vocabulary written) at start: a missing one fails here, not per request

    async def create(self, req: ChatCompletionRequest, request: Request) -> Response:
        """Answer one chat request, streamed or whole."""
        self.check_model(req.model)
        params, tools, encoded = await self.prepare(req, request, delta=req.stream)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        sub = await self.add_requests(rid, [encoded], params, "messages")
        created = int(time.time())
        top_n = req.top_logprobs or 0
        replies = _ReplyParsers(self.reasoning_parser, encoded[0], tools, self.tool_parser)
        if not req.stream:
            header = {"id": rid, "object": "chat.completion", "created": created, "model": self.model_name,
                      **_service_tier(req)}
            return await self.wait_all(
                request, sub, lambda outs: self._response(header, sub, outs[0], top_n, tools, replies)
            )
        header = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                  **_service_tier(req)}
        tokens: dict[int, int] = {}
        events = sse_chunks(
            header, req.include_usage, self._stream(sub, params, top_n, tokens, tools, replies),
            lambda: usage(sub.prompt_token_counts[0], sum(tokens.values())),
        )
        return sse_response(events, on_close=sub.abort, writes=self.stream_writes)

    async def prepare(
        self, req: ChatCompletionRequest, request: Request, delta: bool
    ) -> tuple[SamplingParams, ToolSpec, Prompt]:
        """A chat request made ready to queue, as this route does it: (sampling params, tools, encoded prompt).

        The other dialects (``/v1/responses``, ``/v1/messages``) translate their
        requests into a chat request and call this, so every check, default and
        rendering rule is the chat route's. ``delta``: the output is read step
        by step (``RequestOutputKind.DELTA``). Raises APIError (400) for what
        the server cannot serve; an error rendering the prompt names ``messages``.
        """
        self._check_servable(req)
        tools = await asyncio.to_thread(req.tool_spec, self.grammar_limits)  # xgrammar checks each schema
        params = req.to_sampling_params(tools, self.default_max_tokens, self.sampling_defaults)
        if delta:
            params.output_kind = RequestOutputKind.DELTA  # the engine sends each choice's new text, held back
        if self.harmony:
            self._harmony_params(params, tools)
        if req.thinking_token_budget is not None:
            apply_thinking_budget(params, req.thinking_token_budget, self.reasoning_parser)
        await self.compile_constraint(params, req.constraint_param, request)
        try:
            encoded = await self.encode_prompt(req, tools, params)
        except Exception as e:
            raise to_api_error(e, "messages") from e
        return params, tools, encoded

    async def encode_prompt(self, req: ChatCompletionRequest, tools: ToolSpec, params: SamplingParams | None) -> Prompt:
        """The request's conversation as the engine's prompt: openai-harmony's rendering for a gpt-oss model,
        else the chat template; tokenized. ``params`` None: not truncated (a token count)."""
        messages = req.template_messages()
        if self.harmony:
            opened = req.thinking_token_budget is not None  # the budget counts the analysis the prompt opens
            return await self._harmony_prompt(messages, tools, req.reasoning_effort, params, opened)
        return await self.prompts.chat(messages, req.add_generation_prompt, params,  # type: ignore[arg-type]
                                       tools.template_tools(), req.chat_template_kwargs)

    def _check_servable(self, req: ChatCompletionRequest) -> None:
        """400 for what this server was started without: a chat template, or auto tool choice."""
        if not self.has_template and not self.harmony:
            raise bad_request("this model has no chat template, so it cannot chat; start the server with "
                              "--chat-template FILE (or use /v1/completions)", "messages", "no_chat_template")
        auto = req.tool_choice == "auto" or (req.tool_choice is None and req.tools)
        if auto and req.tools and not self.enable_auto_tool_choice:
            raise bad_request('tool_choice "auto" needs the server started with --enable-auto-tool-choice '
                              '(it was started with --no-enable-auto-tool-choice)', "tool_choice")

    def _harmony_params(self, params: SamplingParams, tools: ToolSpec) -> None:
        """A harmony request's own rules: it stops at ``<|return|>`` / ``<|call|>``; its calls are not forced.

        ``required`` and named ``tool_choice`` force calls with a JSON grammar, which would keep
        the model from writing harmony's channels: refused with a 400.
        """
        if tools.tool_choice not in ("auto", "none"):
            raise bad_request(
                "tool_choice 'required' or naming a function is not supported for harmony (gpt-oss) models; "
                "use 'auto'", "tool_choice",
            )
        from pagedllm.harmony.vocab import harmony_encoding

        try:
            stops = harmony_encoding().stop_tokens_for_assistant_actions()
        except ValueError as e:
            raise APIError(500, str(e), "server_error") from e
        params.stop_token_ids = sorted(set(params.stop_token_ids or ()) | set(stops))

    async def _harmony_prompt(
        self, messages: list[dict[str, Any]], tools: ToolSpec, effort: str | None, params: SamplingParams | None,
        open_analysis: bool = False,
    ) -> tuple[str | None, list[int]]:
        """The conversation rendered by openai-harmony (on a worker thread): (text or None, token ids).

        ``open_analysis``: the prompt opens the analysis message (a thinking budget's, ``harmony/thinking.py``);
        its text then comes back too, for the reply parser to know the output starts inside that message.
        """
        from pagedllm.harmony import thinking
        from pagedllm.harmony.prompt import render_prompt
        from pagedllm.harmony.vocab import harmony_encoding

        ids = await asyncio.to_thread(render_prompt, messages, tools.template_tools(), effort)
        if open_analysis:
            ids = thinking.open_analysis(ids)
        if params is None:
            self.prompts.engine.check_prompt_len(len(ids), None)
            return None, ids
        _, ids = await self.prompts.token_ids(ids, params)
        return (harmony_encoding().decode(ids) if open_analysis else None), ids

    def _response(
        self, header: dict[str, Any], sub: RequestStream, out: RequestOutput, top_n: int, tools: ToolSpec,
        replies: _ReplyParsers,
    ) -> dict[str, Any]:
        choices = []
        for c in out.outputs:
            message: dict[str, Any] = {"role": "assistant", "content": c.text}
            finish_reason = c.finish_reason
            parser = replies.new(buffered=True)
            if parser is not None:
                found = parser.extract(c.text, c.token_ids)
                message = {"role": "assistant", "content": found.content, "reasoning_content": found.reasoning_content}
                if tools.parses_calls:
                    message["tool_calls"] = [call.to_dict() for call in found.tool_calls]
                    finish_reason = tools.finish_reason(c.finish_reason, found.tools_called)
            elif tools.parses_calls:
                found = tools.extract(c.text, self.tool_parser)
                message = {"role": "assistant", "content": found.content,
                           "tool_calls": [call.to_dict() for call in found.tool_calls]}
                finish_reason = tools.finish_reason(c.finish_reason, found.tools_called)
            choices.append({
                "index": c.index, "message": message, "logprobs": chat_logprobs(c, 0, len(c.token_ids), top_n),
                "finish_reason": finish_reason, "stop_reason": c.stop_reason,
            })
        completion = sum(len(c.token_ids) for c in out.outputs)
        return {**header, "choices": choices, "usage": usage(sub.prompt_token_counts[0], completion)}

    async def _stream(
        self, sub: RequestStream, params: SamplingParams, top_n: int, tokens: dict[int, int], tools: ToolSpec,
        replies: _ReplyParsers,
    ) -> AsyncIterator[list[dict[str, Any]]]:
        """The choices of each chunk; ``tokens`` counts each choice's tokens for the usage chunk.

        The engine's outputs are deltas (``RequestOutputKind.DELTA``): each
        choice's new text (held back while a stop string may cut it), tokens and logprobs.
        """
        parsers: dict[int, ToolParser | ReplyParser | None] = {}
        async for _, out in sub.outputs():
            for c in out.outputs:
                if c.index not in parsers:
                    # as OpenAI: each choice opens with the role, once
                    parsers[c.index] = replies.new(buffered=False) or tools.new_parser(self.tool_parser)
                    yield [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None}]
                tokens[c.index] = tokens.get(c.index, 0) + len(c.token_ids)
                for chunk in _choice_chunks(c, c.text, c.finish_reason is not None,
                                            chat_logprobs(c, 0, len(c.token_ids), top_n), parsers[c.index], tools):
                    yield [chunk]


def _service_tier(req: ChatCompletionRequest) -> dict[str, str]:
    """The tier that served the request, as OpenAI's reply names it, where the request asked for one: a
    local server has one tier, ``default``, whatever was asked."""
    return {} if req.service_tier is None else {"service_tier": "default"}


class _ReplyParsers:
    """Makes each choice's ``ReplyParser`` for a request (None without a reasoning parser).

    ``prompt_text``: the rendered prompt (a ``<think>`` template may open the block there).
    """

    def __init__(
        self, reasoning: type[ReasoningParser] | None, prompt_text: str | None, tools: ToolSpec,
        tool_parser: type[ToolParser],
    ) -> None:
        self.reasoning = reasoning
        self.prompt_text = prompt_text
        self.tools = tools
        self.tool_parser = tool_parser

    def new(self, buffered: bool) -> ReplyParser | None:
        """A parser for one choice, or None when the request has no reasoning parser."""
        if self.reasoning is None:
            return None
        tools = self.tools
        max_calls = None if tools.parallel_tool_calls else 1
        reasoning = self.reasoning(
            prompt_text=self.prompt_text, calls_allowed=tools.parses_calls, max_calls=max_calls
        )
        return ReplyParser(reasoning, tools.new_parser(self.tool_parser, buffered=buffered))


def _choice_chunks(
    c: CompletionOutput, text: str, finished: bool, logprobs: dict[str, Any] | None,
    parser: ToolParser | ReplyParser | None, tools: ToolSpec,
) -> list[dict[str, Any]]:
    """The chunks one new piece of a choice makes: its delta (text, or call pieces), then its end.

    A parser may hold text back (a possible ``<tool_call>`` tag); the
    piece's logprobs still go out, in a chunk with an empty delta.
    """
    if parser is None:
        delta = {"content": text} if text else {}
        fin = {"finish_reason": c.finish_reason, "stop_reason": c.stop_reason} if finished else {"finish_reason": None}
        return [{"index": c.index, "delta": delta, "logprobs": logprobs, **fin}]
    chunks = []
    if isinstance(parser, ReplyParser):
        fed = parser.feed(text, c.token_ids) if text or c.token_ids else None
    else:
        fed = parser.feed(text) if text else None
    delta = fed.to_dict() if fed is not None else {}
    if delta or logprobs is not None:
        chunks.append({"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": None})
    if finished:
        tail = parser.finish()
        chunks.append({
            "index": c.index, "delta": tail.to_dict() if tail is not None else {}, "logprobs": None,
            "finish_reason": tools.finish_reason(c.finish_reason, parser.num_calls > 0) if tools.parses_calls
            else c.finish_reason,
            "stop_reason": c.stop_reason,
        })
    return chunks
