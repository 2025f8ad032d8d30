"""``pagedllm serve``: the OpenAI-compatible app, its routes and its uvicorn server.

The package follows the data flow of a request, as vLLM lays out
``entrypoints/openai/``::

    guards.py (Host, API key, body size)      -- ASGI middleware, before any route
    api_server.py (routes, pydantic bodies)   -- this module: the app, errors, uvicorn
      protocol.py (request models, APIError)  -- strict validation, OpenAI's error body
      serving_completion.py / serving_chat.py -- one handler class per generating route
        prompts.py -> tokenizer_worker.py     -- tokenize off the engine thread
        engine/protocol.py's EngineClient     -- the engine client, the only engine the routes see
          (clients/async_engine.py: one engine thread; clients/data_parallel/: N replica processes)
        engine_errors.py                      -- what the client raises, as HTTP answers
        logprobs.py, sse.py                   -- the answer, whole or as server-sent events (the engine's
                                                 deltas, engine/output_deltas.py, formatted)
      serving_tokenization.py                 -- /tokenize, /detokenize, /tokenizer_info
    clients/metrics.py                        -- Prometheus, fed by the engine client

A program that builds the app itself (``create_server_app``) starts the
tokenizer process with ``multiprocessing``'s spawn method, so its main
module needs the usual ``if __name__ == "__main__":`` guard.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
server-sent-event streaming), ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus), ``POST /tokenize``, ``POST /detokenize``,
``GET /tokenizer_info``, Anthropic's ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``
(``entrypoints/anthropic/``), and the live KV-cache page ``GET /kv`` with
``GET /kv/state`` and ``GET /kv/events`` (``kv_page.py``; off with ``--no-kv-page``);
``GET /openapi.json`` and ``GET /docs`` describe them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, PlainTextResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from swagger_ui_bundle import swagger_ui_path

from pagedllm.clients.async_engine import AsyncEngine
from pagedllm.clients.data_parallel.client import DataParallelEngine
from pagedllm.clients.data_parallel.replica_client import DEFAULT_HEARTBEAT_TIMEOUT_S
from pagedllm.clients.kv_publisher import KVSnapshotPublisher
from pagedllm.clients.metrics import ServerMetrics
from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.protocol import EngineClient
from pagedllm.entrypoints.anthropic.serving_messages import add_messages_routes
from pagedllm.entrypoints.openai.guards import (
    APIKeyMiddleware,
    BodyLimitMiddleware,
    HostCheckMiddleware,
    require_json,
)
from pagedllm.entrypoints.openai.json_response import OpenAIJSONResponse
from pagedllm.entrypoints.openai.kv_page import add_kv_routes
from pagedllm.entrypoints.openai.last_resort import LastResortMiddleware
from pagedllm.entrypoints.openai.prompts import PromptEncoder
from pagedllm.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    TokenizeRequest,
    describe_validation_error,
    served_model_schema,
)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_engine import check_model
from pagedllm.entrypoints.openai.serving_pooling import add_pooling_routes
from pagedllm.entrypoints.openai.serving_responses import add_responses_routes
from pagedllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from pagedllm.entrypoints.openai.settings import ServerSettings
from pagedllm.entrypoints.openai.sse import StreamWrites
from pagedllm.entrypoints.openai.tokenizer_worker import TokenizerWorker
from pagedllm.resolved_config import resolve_config

logger = logging.getLogger(__name__)

# the error answers every JSON route may give, for /openapi.json
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": what}
    for code, what in (
        (400, "Invalid request: malformed JSON, an unknown field, a wrong type or a bad value"),
        (401, "Missing or wrong API key (when the server has one)"),
        (404, "Unknown model"),
        (413, "Body over --max-request-bytes"),
        (415, "Body not declared as JSON"),
        (429, "Too many requests waiting (--max-waiting); retry after Retry-After seconds"),
        (500, "The engine failed on this request"),
        (503, "The server is shutting down"),
    )
}
_GENERATING = {
    **_ERRORS,
    200: {
        "description": "The answer; with ``stream: true`` a stream of server-sent events",
        "content": {"application/json": {}, "text/event-stream": {}},
    },
}


def _add_guards(app: FastAPI, settings: ServerSettings) -> None:
    """The middleware every request passes (``guards.py``), outermost first:
    Host check, CORS, API key, body size."""
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_bytes)
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)
    if settings.allowed_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=settings.allowed_origins, allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type", "X-Api-Key", "Anthropic-Version"],
        )
    if settings.host_check is not None:
        app.add_middleware(HostCheckMiddleware, allowed_hosts=settings.host_check)


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's body: ours, FastAPI's validation (400, never 422), routing, bugs.
    A bug's 500 is ``LastResortMiddleware``'s (outermost: the guards' bugs too), which keeps the connection."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> OpenAIJSONResponse:
        return OpenAIJSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> OpenAIJSONResponse:
        err = describe_validation_error(list(exc.errors()))
        return OpenAIJSONResponse(err.body(), status_code=err.status_code)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> OpenAIJSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        err = APIError(exc.status_code, str(exc.detail), kind, None)
        if exc.status_code == 400 and exc.__cause__ is not None:
            # FastAPI's "error parsing the body": bytes that are not UTF-8 JSON
            err = APIError(400, f"the request body is not valid JSON: {exc.__cause__}", kind, "invalid_json")
        return OpenAIJSONResponse(err.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))


def _add_docs(app: FastAPI) -> None:
    """``/docs``: Swagger UI from files installed with the package (``swagger-ui-bundle``), no CDN.

    FastAPI's own ``/docs`` loads Swagger UI from a CDN, which an offline
    machine cannot reach; these are the same files, served from here.
    """
    app.mount("/docs/static", StaticFiles(directory=str(swagger_ui_path)), name="swagger-ui")

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json", title=f"{app.title} - API",
            swagger_js_url="/docs/static/swagger-ui-bundle.js", swagger_css_url="/docs/static/swagger-ui.css",
            swagger_favicon_url="/docs/static/favicon-32x32.png",
        )


def _openapi_without_422(app: FastAPI, vocab_size: int) -> None:
    """FastAPI documents a 422 on every body route; this server answers 400 instead (``_ERRORS``).

    Token ids' maximum is the served vocabulary's last id (``served_model_schema``).
    """
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = served_model_schema(schema, vocab_size)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def build_app(
    async_engine: EngineClient, settings: ServerSettings, tokenizer: TokenizerWorker,
    metrics: ServerMetrics | None = None,
) -> FastAPI:
    """The FastAPI app; its lifespan starts and stops the engine (thread or replica processes) and the
    tokenizer process.

    Args:
        async_engine: the engine client (``engine/protocol.py``): ``AsyncEngine`` or ``DataParallelEngine``
            (not started yet); the routes see only the protocol.
        settings: names, key and limits.
        tokenizer: the tokenizer process; the app closes it when it stops.
        metrics: the metrics the client records (served at /metrics), or None.
    """
    engine = async_engine.engine
    if metrics is not None:
        metrics.watch_grammars(engine.grammar_compiler)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not async_engine.is_alive:
            await asyncio.to_thread(async_engine.start)
        try:
            yield
        finally:
            await asyncio.to_thread(async_engine.stop)
            await asyncio.to_thread(tokenizer.close)

    app = FastAPI(
        title="pagedllm", summary="An OpenAI-compatible LLM server", lifespan=lifespan, docs_url=None,
        redoc_url=None, default_response_class=OpenAIJSONResponse,
    )
    _add_docs(app)
    _add_guards(app, settings)
    _add_error_handlers(app)
    app.add_middleware(LastResortMiddleware)  # added last: outermost
    _openapi_without_422(app, engine.model_config.vocab_size)
    if settings.chat_template is not None:
        engine.tokenizer.set_chat_template(settings.chat_template)  # --chat-template: before anything reads it
    prompts = PromptEncoder(engine, tokenizer)
    name = settings.model_name
    # --default-max-tokens, else the model's max_new_tokens (generation_config.json), as vLLM caps a reply
    default_max_tokens = settings.default_max_tokens
    if default_max_tokens is None:
        default_max_tokens = engine.generation_defaults.values.get("max_tokens")
    completion = OpenAIServingCompletion(async_engine, prompts, name, default_max_tokens)
    chat = OpenAIServingChat(async_engine, prompts, name, settings.tool_call_parser, default_max_tokens,
                             settings.reasoning_parser, settings.enable_auto_tool_choice)
    completion.stream_writes = chat.stream_writes = StreamWrites(
        settings.stream_write_timeout_s,
        metrics.stream_write_timeouts.inc if metrics is not None else None,
    )
    completion.served_names = chat.served_names = settings.served_names
    _add_generating_routes(app, completion, chat)
    add_responses_routes(app, chat, settings)  # /v1/responses on the chat machinery (serving_responses.py)
    add_messages_routes(app, chat)  # Anthropic's /v1/messages (entrypoints/anthropic/)
    _add_info_routes(app, async_engine, settings, metrics)
    tokenization = OpenAIServingTokenization(
        prompts, tokenizer, name, engine.config.max_model_len, engine.model_config.vocab_size
    )
    tokenization.served_names = settings.served_names
    add_pooling_routes(app, async_engine, prompts, settings.served_names)  # embeddings, score, rerank
    json_body = [Depends(require_json)]

    @app.post("/tokenize", response_model=None, dependencies=json_body, responses=_ERRORS)
    async def tokenize(req: TokenizeRequest) -> Response:
        """Token ids of a prompt, or of a conversation through the chat template (vLLM's route)."""
        return await tokenization.tokenize(req)

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        """The tokenizer's special tokens and chat template (vLLM's route; lm-eval's remote tokenizer)."""
        return tokenization.tokenizer_info()

    @app.post("/detokenize", dependencies=json_body, responses=_ERRORS)
    async def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        """The text of token ids (vLLM's route)."""
        return await tokenization.detokenize(req)

    return app


def _add_generating_routes(app: FastAPI, completion: OpenAIServingCompletion, chat: OpenAIServingChat) -> None:
    json_body = [Depends(require_json)]

    @app.post("/v1/completions", response_model=None, dependencies=json_body, responses=_GENERATING)
    async def completions(req: CompletionRequest, request: Request) -> Response:
        """OpenAI's completions: text for each prompt (a string, token ids, or a list of either)."""
        return await completion.create(req, request)

    @app.post("/v1/chat/completions", response_model=None, dependencies=json_body, responses=_GENERATING)
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        """OpenAI's chat completions: the assistant's next message for a conversation."""
        return await chat.create(req, request)


def _add_info_routes(
    app: FastAPI, async_engine: EngineClient, settings: ServerSettings, metrics: ServerMetrics | None
) -> None:
    max_model_len = async_engine.engine.config.max_model_len

    def model_card(name: str) -> dict[str, Any]:
        return {
            "id": name, "object": "model", "created": settings.created, "owned_by": "pagedllm",
            "root": settings.model_path or settings.model_name, "parent": None, "max_model_len": max_model_len,
        }

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        """The served model (one per server), once under each of its names (``--served-model-name``)."""
        return {"object": "list", "data": [model_card(name) for name in settings.served_names]}

    @app.get("/v1/models/{model:path}", responses=_ERRORS)
    async def get_model(model: str) -> dict[str, Any]:
        """The served model, by any of its names; 404 for any other."""
        check_model(model, settings.served_names)
        return model_card(model)

    @app.get("/health", response_class=Response, responses={200: {"description": "The engine runs"}, 503: _ERRORS[503]})
    async def health() -> Response:
        """200 while the engine runs (with data parallelism: while one replica serves, with a JSON body
        of each replica's state, ``"status": "degraded"`` while some are down); 503 once it stopped or
        is shutting down."""
        if not async_engine.is_alive or async_engine.draining:
            err = APIError(503, "the engine is not running", "server_error", "engine_unavailable")
            return OpenAIJSONResponse(err.body(), status_code=503)
        report = async_engine.health_report()
        if report is not None:
            return OpenAIJSONResponse(report)
        return Response(status_code=200)

    @app.get("/metrics", response_class=PlainTextResponse, responses={404: _ERRORS[404]})
    async def prometheus_metrics() -> Response:
        """Prometheus metrics (404 when the server runs without them)."""
        if metrics is None:
            raise APIError(404, "metrics are disabled", "not_found_error", None)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)


def default_model_name(model_path: str) -> str:
    """The name a model is served under: its file or folder name."""
    return os.path.basename(os.path.normpath(model_path))


def create_server_app(engine: LLMEngine, settings: ServerSettings, enable_metrics: bool = True) -> FastAPI:
    """An app around ``engine``, with its own metrics registry and engine thread.

    ``app.state.async_engine`` is the engine wrapper (for ``make_uvicorn_server``).
    """
    metrics = ServerMetrics(settings.model_name) if enable_metrics else None
    if metrics is not None:
        metrics.update_from_engine(engine)
        expert_load = getattr(engine.model_runner, "expert_load", None)
        if expert_load is not None:  # a mixture of experts: its routing counts, read at each scrape
            metrics.watch_experts(expert_load.counts)
    async_engine = AsyncEngine(engine, metrics, settings.max_waiting)
    app = build_app(async_engine, settings, TokenizerWorker(engine.tokenizer.hf), metrics)
    app.state.async_engine = async_engine
    if settings.kv_page:
        publisher = KVSnapshotPublisher()
        publisher.publish(engine)  # the engine thread has not started: this thread may read it
        async_engine.between_steps.append(publisher.maybe_publish)
        add_kv_routes(app, publisher)
        app.state.kv_publisher = publisher
    return app


# seconds requests in flight get to finish when the server is asked to stop
SHUTDOWN_GRACE_S = 5.0


def make_uvicorn_server(app: FastAPI, settings: ServerSettings) -> Any:
    """A uvicorn server that drains the engine before closing connections.

    uvicorn alone would wait for open streams and then cancel them mid-flight;
    here requests in flight get ``SHUTDOWN_GRACE_S`` to finish, then end with
    an error event (streams) or a 503, and connections close cleanly. Its
    connections run ``http_protocol.py``'s h11 protocol (``settings.http_limits``).
    """
    import uvicorn

    from pagedllm.entrypoints.openai.http_protocol import make_protocol_class

    async_engine: EngineClient = app.state.async_engine

    class _DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets: list | None = None) -> None:
            await async_engine.drain(SHUTDOWN_GRACE_S)
            await super().shutdown(sockets)

    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, log_level=settings.log_level,
        timeout_graceful_shutdown=int(SHUTDOWN_GRACE_S), http=make_protocol_class(settings.http_limits),
    )
    return _DrainingServer(config)


def run_server(engine: LLMEngine, settings: ServerSettings) -> None:
    """Serve until interrupted (SIGINT/SIGTERM)."""
    app = create_server_app(engine, settings)
    logger.info("serving %s on http://%s:%d", settings.model_name, settings.host, settings.port)
    make_uvicorn_server(app, settings).run()


def create_dp_server_app(
    config: EngineConfig, settings: ServerSettings, num_replicas: int, enable_metrics: bool = True,
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
) -> FastAPI:
    """An app whose requests ``num_replicas`` engine processes serve (``clients/data_parallel/``).

    Nothing is started here: the app's lifespan starts the replicas (and
    stops them). This process loads the tokenizer, not the model.
    ``app.state.async_engine`` is the ``DataParallelEngine``; a replica silent for
    ``heartbeat_timeout`` seconds is killed and replaced.
    """
    metrics = ServerMetrics(settings.model_name) if enable_metrics else None
    if metrics is not None:
        metrics.batch_invariant.set(int(resolve_config(config).batch_invariant))
        metrics.block_size = config.block_size
    dp = DataParallelEngine(config, num_replicas, metrics, settings.max_waiting, settings.kv_page, heartbeat_timeout)
    app = build_app(dp, settings, TokenizerWorker(dp.engine.tokenizer.hf), metrics)
    app.state.async_engine = dp
    if settings.kv_page:
        add_kv_routes(app, dp.replicas)
    return app


def run_dp_server(
    config: EngineConfig, settings: ServerSettings, num_replicas: int,
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
) -> None:
    """Serve with ``num_replicas`` engine processes until interrupted (SIGINT/SIGTERM)."""
    app = create_dp_server_app(config, settings, num_replicas, heartbeat_timeout=heartbeat_timeout)
    logger.info("serving %s on http://%s:%d with %d data-parallel replicas", settings.model_name, settings.host,
                settings.port, num_replicas)
    make_uvicorn_server(app, settings).run()
