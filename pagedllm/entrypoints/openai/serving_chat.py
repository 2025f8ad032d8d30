"""``POST /v1/chat/completions``: a conversation through the chat template, the assistant's reply out."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from pagedllm.entrypoints.openai.deltas import DeltaTracker
from pagedllm.entrypoints.openai.engine_client import Submission, to_api_error
from pagedllm.entrypoints.openai.logprobs import chat_logprobs
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.serving_engine import OpenAIServing, usage
from pagedllm.entrypoints.openai.sse import sse_chunks, sse_response
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams


class OpenAIServingChat(OpenAIServing):
    """The chat completions handler (one prompt, ``n`` choices)."""

    async def create(self, req: ChatCompletionRequest, request: Request) -> Response:
        """Answer one chat request, streamed or whole."""
        self.check_model(req.model)
        params = req.to_sampling_params()
        await self.compile_constraint(params, req.constraint_param)
        try:
            encoded = await self.prompts.chat(req.template_messages(), req.add_generation_prompt, params)
        except Exception as e:
            raise to_api_error(e, "messages") from e
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        sub = await self.engine_client.add_requests(rid, [encoded], params, "messages")
        created = int(time.time())
        top_n = req.top_logprobs or 0
        if not req.stream:
            header = {"id": rid, "object": "chat.completion", "created": created, "model": self.model_name}
            return await self.wait_all(request, sub, lambda outs: _response(header, sub, outs[0], top_n))
        header = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name}
        tokens: dict[int, int] = {}
        events = sse_chunks(
            header, req.include_usage, _stream(sub, params, top_n, tokens),
            lambda: usage(sub.prompt_token_counts[0], sum(tokens.values())),
        )
        return sse_response(events, on_close=sub.abort)


def _response(header: dict[str, Any], sub: Submission, out: RequestOutput, top_n: int) -> dict[str, Any]:
    choices = [
        {
            "index": c.index,
            "message": {"role": "assistant", "content": c.text},
            "logprobs": chat_logprobs(c, 0, len(c.token_ids), top_n),
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        for c in out.outputs
    ]
    completion = sum(len(c.token_ids) for c in out.outputs)
    return {**header, "choices": choices, "usage": usage(sub.prompt_token_counts[0], completion)}


async def _stream(
    sub: Submission, params: SamplingParams, top_n: int, tokens: dict[int, int]
) -> AsyncIterator[list[dict[str, Any]]]:
    """The choices of each chunk; ``tokens`` counts each choice's tokens for the usage chunk."""
    tracker = DeltaTracker(params)
    first = True
    async for _, out in sub.outputs():
        if first:
            # as OpenAI: each choice opens with the role, once
            first = False
            for c in out.outputs:
                yield [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                        "logprobs": None, "finish_reason": None}]
        for c in out.outputs:
            tokens[c.index] = len(c.token_ids)
            d = tracker.delta(c.index, c)
            if d is None:
                continue
            text, finished, first_token, end = d
            delta = {"content": text} if text else {}
            fin = (
                {"finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                if finished else {"finish_reason": None}
            )
            yield [{"index": c.index, "delta": delta, "logprobs": chat_logprobs(c, first_token, end, top_n), **fin}]
