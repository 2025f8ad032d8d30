"""The engine client protocol: what the OpenAI server's handlers may call on whatever runs the engine.

Two clients implement it (``pagedllm/clients/``), and the server is typed
against this protocol only, so its routes do not know which one serves them:

- ``AsyncEngine`` (``clients/async_engine.py``): one ``LLMEngine`` on a
  thread of the server's process;
- ``DataParallelEngine`` (``clients/data_parallel/client.py``): N engine
  processes behind a prefix-aware router (``--data-parallel-size``).

The offline ``LLM`` (``engine/llm.py``) is the third way to drive an
engine. It shares ``engine`` (the ``EngineView`` below: configuration,
tokenizer, prompt and grammar checks) and the request model (a prompt, one
``SamplingParams``, cumulative ``RequestOutput`` objects), but does not
implement ``EngineClient``: it steps its engine synchronously on the
caller's thread until a batch finishes, so admission control (``draining``,
``max_waiting``), ``abort`` of a request in flight, ``start`` / ``stop`` /
``drain`` and an asynchronous ``add_requests`` have nothing to act on
there. Its ``engine`` attribute (``llm.llm_engine``) conforms to
``EngineView``.

The errors a client raises are defined here (torch-free, no HTTP): the
server maps them to its status codes (``entrypoints/openai/engine_errors.py``).
This module imports no torch, so a client can be typed without loading one.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.loader.generation_defaults import GenerationDefaults
    from pagedllm.loader.model_config import ModelArchConfig
    from pagedllm.loader.tokenizer import Tokenizer
    from pagedllm.outputs import RequestOutput
    from pagedllm.sampling_params import SamplingParams
    from pagedllm.structured_output.compiler import GrammarCompiler

# A prompt as an engine client queues it: (text or None, token ids), tokenized off the engine's thread.
Prompt = tuple[str | None, list[int]]


# --- errors ------------------------------------------------------------------------


class EngineStepError(RuntimeError):
    """The engine step that carried this request failed; the request is lost."""


class EngineDeadError(RuntimeError):
    """The engine has stopped (shutdown or a crash), or no engine serves (every replica down)."""


class AdmissionError(RuntimeError):
    """A client refused a request before queueing it (its waiting limit); the server maps the subclasses."""


class TooManyPromptsError(AdmissionError):
    """The request has more prompts than the client ever queues at once: it can never be admitted."""


class EngineOverloadedError(AdmissionError):
    """Too many requests wait for their first token now; retry after ``retry_after`` seconds.

    Args:
        message: what the client is told.
        retry_after: seconds to wait before retrying.
    """

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


# --- the protocol ------------------------------------------------------------------


class EngineView(Protocol):
    """What the server reads of an engine without stepping it: ``LLMEngine`` or the data-parallel
    ``ServingFrontend`` (configuration, tokenizer and checks, no model)."""

    config: EngineConfig
    model_config: ModelArchConfig
    generation_defaults: GenerationDefaults
    tokenizer: Tokenizer
    grammar_compiler: GrammarCompiler

    def check_prompt_len(self, num_prompt_tokens: int, params: SamplingParams | None = None) -> None:
        """Raise ``ContextLengthError`` (a ValueError) if a prompt of ``num_prompt_tokens`` cannot be served."""
        ...

    def compile_grammar(self, params: SamplingParams, cancel: threading.Event | None = None) -> object:
        """Compile (and cache) ``params``' structured-output constraint; ValueError for a bad one."""
        ...


class RequestStream(Protocol):
    """One API request's engine requests (one per prompt) and their outputs, as ``add_requests`` returns them."""

    prompt_token_counts: list[int]

    @property
    def streams(self) -> Sequence[object]:
        """One entry per prompt (their number is what the handlers read)."""
        ...

    def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, cumulative output) as the engine makes them; raises EngineStepError / EngineDeadError."""
        ...

    def abort(self) -> None:
        """Abort every unfinished engine request of this API request (idempotent)."""
        ...


class EngineClient(Protocol):
    """An engine behind the server's handlers: admits, queues, streams and aborts requests; starts and stops.

    ``add_requests`` raises, besides what the engine's own checks raise
    (``ContextLengthError``, ValueError), ``TooManyPromptsError`` /
    ``EngineOverloadedError`` past ``max_waiting`` and ``EngineDeadError``
    while stopping or when no engine serves.
    """

    max_waiting: int | None
    draining: bool

    @property
    def engine(self) -> EngineView:
        """The configuration, tokenizer and checks of the engine(s) served."""
        ...

    @property
    def is_alive(self) -> bool:
        """An engine serves (with data parallelism: at least one replica)."""
        ...

    @property
    def has_work(self) -> bool:
        """Requests in flight (a snapshot)."""
        ...

    def start(self) -> None:
        """Start serving (the engine thread, or the replica processes); raises if it cannot."""
        ...

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving; requests in flight get an ``EngineDeadError``."""
        ...

    async def drain(self, timeout: float) -> None:
        """Refuse new requests, give those in flight ``timeout`` seconds, then stop."""
        ...

    async def add_requests(self, request_id: str, prompts: list[Prompt], params: SamplingParams) -> RequestStream:
        """Queue one engine request per prompt, all or none; the outputs come through the returned stream."""
        ...

    def abort(self, request_ids: list[str]) -> None:
        """Abort engine requests by id, wherever they run (fire and forget)."""
        ...

    def health_report(self) -> dict[str, Any] | None:
        """``/health``'s JSON body (each replica's state), or None when a bare 200 says it all."""
        ...
