"""What the completion and chat handlers share: the model check, the wait
for a non-streamed answer, the grammar compile and the usage block."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

from fastapi import Request

from pagedllm.engine.protocol import (
    EngineClient,
    EngineDeadError,
    EngineStepError,
    Prompt,
    RequestStream,
)
from pagedllm.entrypoints.openai.engine_errors import engine_failure, to_api_error
from pagedllm.entrypoints.openai.json_response import OpenAIJSONResponse
from pagedllm.entrypoints.openai.prompts import PromptEncoder
from pagedllm.entrypoints.openai.protocol import APIError, bad_request
from pagedllm.entrypoints.openai.sse import StreamWrites, watch_disconnect
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output.compiler import CompileCancelled
from pagedllm.structured_output.limits import GrammarLimits


class OpenAIServing:
    """Base of the handlers of the generating routes.

    Args:
        engine_client: the engine client (``engine/protocol.py``): one engine thread or data-parallel replicas.
        prompts: the prompt encoder (tokenizer process, chat template).
        model_name: the name clients use in ``model``.

    ``served_names``: every name ``model`` may use (``--served-model-name A B``); replies carry ``model_name``.
    ``stream_writes``: how long a stream's write may wait for a client that reads
    nothing (``sse.py``); the app sets it from ``--stream-write-timeout``.
    ``sampling_defaults``: the model's (``generation_config.json``), for the
    sampling fields a request leaves out.
    """

    def __init__(self, engine_client: EngineClient, prompts: PromptEncoder, model_name: str) -> None:
        self.engine_client = engine_client
        self.prompts = prompts
        self.model_name = model_name
        self.served_names: tuple[str, ...] = (model_name,)  # the app adds --served-model-name's others
        self.stream_writes = StreamWrites()
        self.sampling_defaults: dict[str, Any] = dict(engine_client.engine.generation_defaults.values)

    def check_model(self, name: str | None) -> None:
        """404 unless ``name`` is one of the served model's names (or None: vLLM's leniency)."""
        check_model(name, self.served_names)

    @property
    def grammar_limits(self) -> GrammarLimits:
        """The engine's structured-output limits (``--grammar-*`` flags)."""
        return self.engine_client.engine.grammar_compiler.limits

    async def compile_constraint(self, params: SamplingParams, param: str, request: Request | None = None) -> None:
        """Compile the request's structured-output constraint on a worker thread: a bad one is a 400 here.

        The engine thread then finds it in the engine's grammar cache, so a
        long compile never stalls other requests' steps. Over a limit
        (``GrammarLimits``) is a 400 naming the limit; when the client of
        ``request`` leaves (or this task is cancelled) the compile is killed,
        and the request ends with 499.
        """
        if params.structured_outputs is None:
            return
        cancel = threading.Event()
        watcher = asyncio.create_task(watch_disconnect(request, cancel.set)) if request is not None else None
        try:
            await asyncio.to_thread(self.engine_client.engine.compile_grammar, params, cancel)
        except CompileCancelled as e:
            raise APIError(499, "the client closed the request", "invalid_request_error", "client_closed") from e
        except ValueError as e:
            raise bad_request(str(e), param) from e
        finally:
            cancel.set()  # a cancelled await leaves the thread compiling: stop it too (no-op when done)
            if watcher is not None:
                watcher.cancel()

    async def add_requests(
        self, request_id: str, prompts: list[Prompt], params: SamplingParams, param: str
    ) -> RequestStream:
        """Queue the request's prompts on the engine client; what it raises becomes the client's error.

        The engine client knows no HTTP (``engine/protocol.py``): a refusal
        (too many waiting: 429, too many prompts: 400, stopping: 503) or a
        prompt the engine rejects (400 naming ``param``) is mapped here.
        """
        try:
            return await self.engine_client.add_requests(request_id, prompts, params)
        except APIError:
            raise
        except Exception as e:
            raise to_api_error(e, param) from e

    async def wait_all(
        self, request: Request, sub: RequestStream, make_response: Callable[[list[RequestOutput]], dict[str, Any]]
    ) -> OpenAIJSONResponse:
        """Wait for every prompt of a non-streamed request; abort if the client leaves."""
        watcher = asyncio.create_task(watch_disconnect(request, sub.abort))
        final: dict[int, RequestOutput] = {}
        try:
            async for index, out in sub.outputs():
                if out.finished:
                    final[index] = out
        except (EngineStepError, EngineDeadError) as e:
            raise engine_failure(e) from e
        finally:
            watcher.cancel()
            sub.abort()  # no-op unless something above failed
        if len(final) < len(sub.streams):  # the client left; nobody reads this
            raise APIError(499, "the client closed the request", "invalid_request_error", "client_closed")
        return OpenAIJSONResponse(make_response([final[i] for i in range(len(sub.streams))]))


def check_model(name: str | None, served: str | tuple[str, ...]) -> None:
    """404 unless ``name`` is ``served`` (or one of its names); no name means the served one, as vLLM allows."""
    if name is not None and name not in ((served,) if isinstance(served, str) else served):
        raise APIError(404, f"The model `{name}` does not exist.", "invalid_request_error", "model_not_found", "model")


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's ``usage`` block."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
