"""The pooling routes: ``/v1/embeddings``, ``/pooling``, ``/classify``, ``/score``, ``/v1/rerank`` and ``/v2/rerank``.

They answer on a ``--runner pooling`` server; a generating server answers
them 400, and a pooling server answers the generating routes 400
(``add_pooling_routes``). Each request's prompts go through the engine
thread as pooling requests (``pooling/params.py``); the heads of
``pooling/heads.py`` turn their pooled hidden states into vectors and scores.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Any

import torch
from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response

from pagedllm.engine.pooling_methods import Pooler
from pagedllm.engine.protocol import EngineClient, Prompt
from pagedllm.entrypoints.openai.engine_errors import to_api_error
from pagedllm.entrypoints.openai.guards import require_json
from pagedllm.entrypoints.openai.json_response import OpenAIJSONResponse
from pagedllm.entrypoints.openai.pooling_protocol import (
    ClassificationRequest,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from pagedllm.entrypoints.openai.prompts import PromptEncoder
from pagedllm.entrypoints.openai.protocol import APIError, ErrorResponse, bad_request
from pagedllm.entrypoints.openai.serving_engine import check_model
from pagedllm.pooling.heads import (
    check_dimensions,
    class_probs,
    cosine,
    cross_encoder_score,
    embedding,
    yes_no_score,
)
from pagedllm.pooling.params import PoolingSamplingParams
from pagedllm.pooling.prompts import reranker_prompt

# the generating routes a pooling server refuses
GENERATING_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"})
_ERRORS = {code: {"model": ErrorResponse, "description": what} for code, what in (
    (400, "A bad input (empty, wrong type, too long, dimensions over the model's) or a route this server's "
          "runner does not serve"),
    (404, "Unknown model"), (415, "Body not declared as JSON"), (429, "Too many requests waiting"),
    (503, "The engine is not running"))}


def _encode(vec: list[float], encoding_format: str) -> list[float] | str:
    """A vector as JSON floats, or base64 of its little-endian float32 bytes (what OpenAI's client decodes)."""
    if encoding_format == "base64":
        return base64.b64encode(torch.tensor(vec, dtype=torch.float32).numpy().astype("<f4").tobytes()).decode()
    return vec


class OpenAIServingPooling:
    """Runs pooling requests on the engine client and answers in each route's shape."""

    def __init__(self, client: EngineClient, prompts: PromptEncoder, served_names: tuple[str, ...]) -> None:
        self.client = client
        self.prompts = prompts
        self.served_names = served_names
        engine = client.engine
        self.pooler = Pooler(engine) if engine.config.runner == "pooling" else None

    def _check(self, model: str | None, *tasks: str) -> Pooler:
        check_model(model, self.served_names)
        if self.pooler is None:
            raise bad_request("this server generates text; start it with --runner pooling to embed or score",
                              None, "wrong_runner")
        if tasks and self.pooler.model.task not in tasks:
            raise bad_request(f"the served model is converted to {self.pooler.model.task!r}; this route needs "
                              f"--convert {' or '.join(tasks)}", None, "wrong_task")
        return self.pooler

    async def _tokenized(self, inputs: Any, param: str, truncate: int | None) -> list[Prompt]:  # noqa: ANN401
        """Each input (text, or token ids) tokenized and checked against the context; 400s for bad ones."""
        if isinstance(inputs, str) or (isinstance(inputs, list) and inputs and isinstance(inputs[0], int)):
            inputs = [inputs]
        if not inputs:
            raise bad_request(f"'{param}' must not be empty", param)
        params = self.pooler.params(truncate)
        try:
            return [await (self.prompts.text(x, params) if isinstance(x, str) else self.prompts.token_ids(x, params))
                    for x in inputs]
        except Exception as e:
            raise to_api_error(e, param) from e

    async def pooled(self, prompts: list[Prompt], param: str, params: PoolingSamplingParams | None = None,
                     ) -> list[torch.Tensor]:
        """Each prompt's pooled final hidden state (or what ``params`` ask for), in order, through the engine
        thread (one engine's, or a data-parallel replica's)."""
        params = params if params is not None else self.pooler.params()
        try:
            sub = await self.client.add_requests(f"pool-{uuid.uuid4().hex}", prompts, params)
        except Exception as e:
            raise to_api_error(e, param) from e
        found: dict[int, list[float]] = {}
        try:
            async for index, out in sub.outputs():
                if out.finished:
                    if out.error is not None or out.pooled is None:
                        raise APIError(500, f"a pooling request failed: {out.error}", "server_error", None)
                    found[index] = out.pooled
        finally:
            if not sub.done:
                sub.abort()
        return [torch.tensor(found[i], dtype=torch.float32) for i in range(len(prompts))]

    async def embeddings(self, req: EmbeddingRequest) -> dict[str, Any]:
        pooler = self._check(req.model, "embed")
        try:
            check_dimensions(pooler.model, req.dimensions)
        except ValueError as e:
            raise bad_request(str(e), "dimensions") from e
        prompts = await self._tokenized(req.input, "input", req.truncate_prompt_tokens)
        vecs = await self.pooled(prompts, "input")
        data = [{"object": "embedding", "index": i,
                 "embedding": _encode(embedding(v, pooler.model, req.normalize, req.dimensions), req.encoding_format)}
                for i, v in enumerate(vecs)]
        return self._listing(data, prompts)

    async def pooling(self, req: PoolingRequest) -> dict[str, Any]:
        self._check(req.model)
        prompts = await self._tokenized(req.input, "input", req.truncate_prompt_tokens)
        vecs = await self.pooled(prompts, "input")
        data = [{"object": "pooling", "index": i, "data": _encode(v.tolist(), req.encoding_format)}
                for i, v in enumerate(vecs)]
        return self._listing(data, prompts)

    async def classify(self, req: ClassificationRequest) -> dict[str, Any]:
        pooler = self._check(req.model, "classify")
        prompts = await self._tokenized(req.input, "input", req.truncate_prompt_tokens)
        vecs = await self.pooled(prompts, "input")
        data = []
        for i, v in enumerate(vecs):
            probs = class_probs(v, pooler.model)
            best = max(range(len(probs)), key=probs.__getitem__)
            data.append({"index": i, "label": pooler.model.labels[best],
                         "probs": probs, "num_classes": len(probs)})
        listing = self._listing(data, prompts, "classify")
        listing["usage"].update(completion_tokens=0, prompt_tokens_details=None)  # vLLM's usage shape
        return listing

    def _listing(self, data: list[dict[str, Any]], prompts: list[Prompt], kind: str = "pool") -> dict[str, Any]:
        num = sum(len(ids) for _, ids in prompts)
        return {"id": f"{kind}-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                "model": self.served_names[0], "data": data, "usage": {"prompt_tokens": num, "total_tokens": num}}

    async def scores(self, queries: list[str], documents: list[str], truncate: int | None,
                     ) -> tuple[list[float], int]:
        """Relevance of each (query, document) pair and the tokens it took: cosine of two embeddings, a
        classifier over the pair as one sequence, or the yes/no reranker's answer."""
        pooler = self.pooler
        task = pooler.model.task
        if task == "embed":
            texts = list(dict.fromkeys([*queries, *documents]))
            prompts = await self._tokenized(texts, "documents", truncate)
            vecs = dict(zip(texts, await self.pooled(prompts, "documents")))
            return [cosine(vecs[q], vecs[d]) for q, d in zip(queries, documents)], sum(len(i) for _, i in prompts)
        params = pooler.params(truncate, logits=task == "score")
        try:
            if task == "score":
                prompts = [await self.prompts.text(reranker_prompt(q, d), params) for q, d in zip(queries, documents)]
            else:
                tok = self.client.engine.tokenizer.hf
                pairs = await asyncio.to_thread(lambda: [tok(q, d)["input_ids"] for q, d in zip(queries, documents)])
                prompts = [await self.prompts.token_ids(ids, params) for ids in pairs]
        except Exception as e:
            raise to_api_error(e, "documents") from e
        vecs = await self.pooled(prompts, "documents", params)
        if task == "score":
            values = [yes_no_score(v) for v in vecs]
        else:
            values = [cross_encoder_score(v, pooler.model) for v in vecs]
        return values, sum(len(i) for _, i in prompts)

    async def score(self, req: ScoreRequest) -> dict[str, Any]:
        self._check(req.model, "embed", "classify", "score")
        queries = [req.text_1] if isinstance(req.text_1, str) else req.text_1
        documents = [req.text_2] if isinstance(req.text_2, str) else req.text_2
        if not queries or not documents:
            raise bad_request("'text_1' and 'text_2' must not be empty", "text_1" if not queries else "text_2")
        if len(queries) == 1:
            queries = queries * len(documents)
        elif len(queries) != len(documents):
            raise bad_request(f"{len(queries)} texts in text_1 for {len(documents)} in text_2: give one or as many",
                              "text_1")
        values, num = await self.scores(queries, documents, req.truncate_prompt_tokens)
        data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(values)]
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                "model": self.served_names[0], "data": data, "usage": {"prompt_tokens": num, "total_tokens": num}}

    async def rerank(self, req: RerankRequest, cohere: bool) -> dict[str, Any]:
        self._check(req.model, "embed", "classify", "score")
        if not req.documents:
            raise bad_request("'documents' must not be empty", "documents")
        values, num = await self.scores([req.query] * len(req.documents), req.documents, req.truncate_prompt_tokens)
        order = sorted(range(len(values)), key=lambda i: -values[i])[: req.top_n or len(values)]
        # Jina returns the documents unless told not to; Cohere's v2 only when asked
        with_docs = req.return_documents if req.return_documents is not None else not cohere
        results = [{"index": i, "relevance_score": values[i], **({"document": {"text": req.documents[i]}}
                                                                   if with_docs else {})} for i in order]
        rid = f"rerank-{uuid.uuid4().hex}"
        if cohere:
            return {"id": rid, "results": results,
                    "meta": {"api_version": {"version": "2"}, "billed_units": {"search_units": 1}}}
        return {"id": rid, "model": self.served_names[0], "usage": {"total_tokens": num}, "results": results}


def add_pooling_routes(app: FastAPI, client: EngineClient, prompts: PromptEncoder,
                       served_names: tuple[str, ...]) -> None:
    """The pooling routes on ``app``; on a pooling server, the generating routes answer 400."""
    serving = OpenAIServingPooling(client, prompts, served_names)
    json_body = [Depends(require_json)]

    if serving.pooler is not None:
        @app.middleware("http")
        async def refuse_generation(request: Request, call_next: Any) -> Response:  # noqa: ANN401
            if request.url.path in GENERATING_PATHS:
                err = bad_request(f"this server runs --runner pooling: {request.url.path} needs a generating "
                                  "server", None, "wrong_runner")
                return OpenAIJSONResponse(err.body(), status_code=400)
            return await call_next(request)

    # a generating server answers these 400 but does not describe them: its schema lists what it serves
    described = serving.pooler is not None

    @app.post("/v1/embeddings", dependencies=json_body, responses=_ERRORS, include_in_schema=described)
    async def embeddings(req: EmbeddingRequest) -> dict[str, Any]:
        """OpenAI's embeddings: one vector per input (float or base64), ``dimensions`` for Matryoshka models."""
        return await serving.embeddings(req)

    @app.post("/pooling", dependencies=json_body, responses=_ERRORS, include_in_schema=described)
    async def pooling(req: PoolingRequest) -> dict[str, Any]:
        """vLLM's pooling: each input's pooled final hidden state, before normalisation or a head."""
        return await serving.pooling(req)

    @app.post("/classify", dependencies=json_body, responses=_ERRORS, include_in_schema=described)
    async def classify(req: ClassificationRequest) -> dict[str, Any]:
        """vLLM's classify: each input's class probabilities, most likely label and number of classes
        (a ``--convert classify`` server: a sequence-classification checkpoint)."""
        return await serving.classify(req)

    @app.post("/score", dependencies=json_body, responses=_ERRORS, include_in_schema=described)
    async def score(req: ScoreRequest) -> dict[str, Any]:
        """vLLM's score: relevance of text_1 (one, or N) to each of text_2."""
        return await serving.score(req)

    @app.post("/v1/rerank", dependencies=json_body, responses=_ERRORS, include_in_schema=described)
    async def rerank_v1(req: RerankRequest) -> dict[str, Any]:
        """Jina's rerank: documents by relevance to the query, best first (``top_n``, ``return_documents``)."""
        return await serving.rerank(req, cohere=False)

    @app.post("/v2/rerank", dependencies=json_body, responses=_ERRORS, include_in_schema=described)
    async def rerank_v2(req: RerankRequest) -> dict[str, Any]:
        """Cohere's rerank (v2): documents by relevance to the query, best first."""
        return await serving.rerank(req, cohere=True)
