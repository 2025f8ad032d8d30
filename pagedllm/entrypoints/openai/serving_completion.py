"""``POST /v1/completions``: prompts (text or token ids) in, text completions out.

With ``echo`` each choice starts with its prompt (and, with ``logprobs``,
the prompt's scored tokens), which is how eval harnesses such as
lm-evaluation-harness read log-likelihoods through this API.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from pagedllm.engine.protocol import EngineClient, Prompt, RequestStream
from pagedllm.entrypoints.openai.engine_errors import to_api_error
from pagedllm.entrypoints.openai.logprobs import (
    completion_logprobs,
    join_completion_logprobs,
    prompt_completion_logprobs,
)
from pagedllm.entrypoints.openai.prompts import PromptEncoder
from pagedllm.entrypoints.openai.protocol import CompletionRequest
from pagedllm.entrypoints.openai.serving_engine import OpenAIServing, usage
from pagedllm.entrypoints.openai.sse import sse_chunks, sse_response
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams


class OpenAIServingCompletion(OpenAIServing):
    """The completions handler; each prompt's ``n`` choices are numbered ``prompt_index * n + i``.

    Args:
        engine_client: the engine thread's client.
        prompts: the prompt encoder.
        model_name: the served model's name.
        default_max_tokens: the cap on a completion whose request sets no
            ``max_tokens`` (``--default-max-tokens``); None: none.
    """

    def __init__(
        self, engine_client: EngineClient, prompts: PromptEncoder, model_name: str,
        default_max_tokens: int | None = None,
    ) -> None:
        super().__init__(engine_client, prompts, model_name)
        self.default_max_tokens = default_max_tokens

    async def create(self, req: CompletionRequest, request: Request) -> Response:
        """Answer one completions request, streamed or whole."""
        self.check_model(req.model)
        params = req.to_sampling_params(self.default_max_tokens, self.sampling_defaults)
        if req.stream:
            params.output_kind = RequestOutputKind.DELTA  # the engine sends each choice's new text, held back
        await self.compile_constraint(params, req.constraint_param, request)
        encoded = await self._encode(req, params)
        echo = await self._echo_texts(encoded, params) if req.echo else None
        rid = f"cmpl-{uuid.uuid4().hex}"
        sub = await self.add_requests(rid, encoded, params, "prompt")
        header = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.model_name}
        if not req.stream:
            return await self.wait_all(request, sub, lambda outs: self._response(header, sub, outs, params.n, echo))
        tokens: dict[int, int] = {}
        events = sse_chunks(
            header, req.include_usage, self._stream(sub, params, tokens, echo),
            lambda: usage(sum(sub.prompt_token_counts), sum(tokens.values())),
        )
        return sse_response(events, on_close=sub.abort, writes=self.stream_writes)

    async def _encode(self, req: CompletionRequest, params: SamplingParams) -> list[Prompt]:
        """Every prompt tokenized (text) or checked (token ids); 400 for a bad one."""
        try:
            return [
                await (self.prompts.text(p, params) if isinstance(p, str) else self.prompts.token_ids(p, params))
                for p in req.prompts()
            ]
        except Exception as e:
            raise to_api_error(e, "prompt") from e

    async def _echo_texts(self, encoded: list[Prompt], params: SamplingParams) -> list[_Echo]:
        """Each prompt's text (decoded when it came as ids or was truncated) and its first token's text."""
        echoes = []
        for text, ids in encoded:
            if text is None or params.truncate_prompt_tokens is not None:
                text = await self.prompts.worker.decode(ids)
            first = await self.prompts.worker.decode(ids[:1]) if params.prompt_logprobs is not None else ""
            echoes.append(_Echo(text, first))
        return echoes

    def _response(
        self, header: dict[str, Any], sub: RequestStream, outs: list[RequestOutput], n: int,
        echo: list[_Echo] | None,
    ) -> dict[str, Any]:
        choices = []
        for i, out in enumerate(outs):
            for c in out.outputs:
                text, logprobs = c.text, completion_logprobs(c, 0, len(c.token_ids), 0)[0]
                if echo is not None:
                    text, logprobs = echo[i].text + c.text, _echo_logprobs(echo[i], out, c, len(c.token_ids))[0]
                choices.append({"index": i * n + c.index, "text": text, "logprobs": logprobs, **_finish(c)})
        completion = sum(len(c.token_ids) for out in outs for c in out.outputs)
        return {**header, "choices": choices, "usage": usage(sum(sub.prompt_token_counts), completion)}

    async def _stream(
        self, sub: RequestStream, params: SamplingParams, tokens: dict[int, int], echo: list[_Echo] | None
    ) -> AsyncIterator[list[dict[str, Any]]]:
        """The choices of each chunk; ``tokens`` counts each choice's tokens for the usage chunk.

        The engine's outputs are deltas (``RequestOutputKind.DELTA``): each
        choice's new text (held back while a stop string may cut it), tokens
        and logprobs. With ``echo`` a choice's first chunk carries its prompt first.
        """
        text_offsets: dict[int, int] = {}  # per choice: the logprobs' text_offset after what was sent
        async for index, out in sub.outputs():
            for c in out.outputs:
                choice = index * params.n + c.index
                first = choice not in tokens
                tokens[choice] = tokens.get(choice, 0) + len(c.token_ids)
                text, end = c.text, len(c.token_ids)
                fin = _finish(c) if c.finish_reason is not None else {"finish_reason": None, "stop_reason": None}
                if echo is not None and first:
                    text = echo[index].text + text
                    logprobs, text_offsets[choice] = _echo_logprobs(echo[index], out, c, end)
                else:
                    logprobs, text_offsets[choice] = completion_logprobs(c, 0, end, text_offsets.get(choice, 0))
                yield [{"index": choice, "text": text, "logprobs": logprobs, **fin}]


@dataclass(frozen=True)
class _Echo:
    """What ``echo`` puts before a prompt's choices."""

    text: str  # the prompt's text
    first_token_text: str  # the text of its first token (which has no logprob)


def _echo_logprobs(
    echo: _Echo, out: RequestOutput, c: CompletionOutput, end: int
) -> tuple[dict[str, Any] | None, int]:
    """The prompt's logprobs then those of output tokens ``0:end``, and the text offset after them."""
    if c.logprobs is None or out.prompt_logprobs is None:
        return None, 0
    head, offset = prompt_completion_logprobs(out.prompt_token_ids, out.prompt_logprobs, echo.first_token_text)
    tail, offset = completion_logprobs(c, 0, end, offset)
    return join_completion_logprobs(head, tail), offset


def _finish(c: CompletionOutput) -> dict[str, Any]:
    return {"finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
