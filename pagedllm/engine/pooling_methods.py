"""``LLM.embed / classify / score / encode``: pooling requests through the engine, vLLM's outputs back."""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.pooling.heads import (
    check_dimensions,
    class_probs,
    cosine,
    cross_encoder_score,
    embedding,
    yes_no_score,
)
from pagedllm.pooling.model_pooling import PoolingModel, resolve_pooling_model
from pagedllm.pooling.outputs import (
    ClassificationOutput,
    EmbeddingOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringOutput,
)
from pagedllm.pooling.params import PoolingParams, PoolingSamplingParams, engine_params
from pagedllm.pooling.prompts import pooling_prompts, reranker_prompt, score_pairs


class Pooler:
    """A pooling engine's head over an ``LLMEngine``: runs pooling requests, turns them into outputs."""

    def __init__(self, engine: LLMEngine) -> None:
        config = engine.config
        self.engine = engine
        self.model: PoolingModel = resolve_pooling_model(config.model, engine.model_config, config.convert,
                                                         config.pooler_config)
        # a yes/no reranker's requests ask the engine for these two logits at the last token (pooling/params.py)
        self.no_yes_ids: tuple[int, ...] = ()
        if self.model.task == "score":
            self.no_yes_ids = (self._single_token("no"), self._single_token("yes"))

    def _single_token(self, word: str) -> int:
        ids = self.engine.tokenizer.encode(word, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"convert='score' reads the logits of {word!r}, which is {len(ids)} tokens here")
        return ids[0]

    def params(self, truncate_prompt_tokens: int | None = None, logits: bool = False) -> PoolingSamplingParams:
        """The engine params of this model's pooling requests; ``logits``: a yes/no reranker's, which bring
        back the [no, yes] logits of the last token instead of its hidden state."""
        return engine_params(self.model.pooling_type, truncate_prompt_tokens, self.no_yes_ids if logits else ())

    def run(self, prompts: list[str | dict[str, Any]], truncate_prompt_tokens: int | None = None,
            logits: bool = False) -> list[tuple[list[int], torch.Tensor]]:
        """Each prompt's (token ids, pooled final hidden state, or [no, yes] logits with ``logits``), in order;
        every prompt is validated first."""
        engine = self.engine
        params = self.params(truncate_prompt_tokens, logits)
        checked = []
        for p in prompts:
            text, ids = engine.process_prompt(p, params)
            checked.append({"prompt": text, "prompt_token_ids": ids} if text is not None else {"prompt_token_ids": ids})
        request_ids: list[str] = []
        done: dict[str, Any] = {}
        try:
            for p in checked:
                rid = engine.new_request_id()
                engine.add_request(rid, p, params)
                request_ids.append(rid)
            while len(done) < len(request_ids):
                for out in engine.step():
                    if out.finished and out.request_id in request_ids:
                        done[out.request_id] = out
                if not engine.has_unfinished_requests() and len(done) < len(request_ids):
                    raise RuntimeError("the engine went idle before every pooling request finished")
        except BaseException:
            engine.abort_request([r for r in request_ids if r not in done])
            raise
        outs = [done[r] for r in request_ids]
        failed = [o for o in outs if o.error is not None or o.pooled is None]
        if failed:
            raise RuntimeError(f"{len(failed)} pooling requests failed; the first: {failed[0].error}")
        return [(o.prompt_token_ids, torch.tensor(o.pooled, dtype=torch.float32)) for o in outs]


class PoolingMethods:
    """The pooling half of ``LLM`` (``runner="pooling"``): mixed into it, reads its ``llm_engine``."""

    llm_engine: LLMEngine

    @property
    def pooler(self) -> Pooler:
        found = getattr(self, "_pooler", None)
        if found is None:
            if self.llm_engine.config.runner != "pooling":
                raise ValueError("embed / classify / score / encode need LLM(..., runner='pooling')")
            found = self._pooler = Pooler(self.llm_engine)
        return found

    def _needs(self, *tasks: str) -> Pooler:
        pooler = self.pooler
        if pooler.model.task not in tasks:
            raise ValueError(f"this model is converted to {pooler.model.task!r}; this call needs "
                             f"convert={' or '.join(repr(t) for t in tasks)}")
        return pooler

    def encode(self, prompts: Any, pooling_params: PoolingParams | None = None,  # noqa: ANN401
               use_tqdm: bool = False) -> list[PoolingRequestOutput[PoolingOutput]]:
        """Each prompt's pooled final hidden state (before normalisation or a head)."""
        params = pooling_params or PoolingParams()
        rows = self.pooler.run(pooling_prompts(prompts), params.truncate_prompt_tokens)
        return [PoolingRequestOutput(str(i), PoolingOutput(v), ids) for i, (ids, v) in enumerate(rows)]

    def embed(self, prompts: Any, pooling_params: PoolingParams | None = None,  # noqa: ANN401
              use_tqdm: bool = False) -> list[PoolingRequestOutput[EmbeddingOutput]]:
        """Each prompt's embedding (``outputs.embedding``), normalised and cut as the params and model say."""
        pooler = self._needs("embed")
        params = pooling_params or PoolingParams()
        check_dimensions(pooler.model, params.dimensions)
        rows = pooler.run(pooling_prompts(prompts), params.truncate_prompt_tokens)
        return [PoolingRequestOutput(str(i), EmbeddingOutput(embedding(v, pooler.model, params.normalize,
                                                                       params.dimensions)), ids)
                for i, (ids, v) in enumerate(rows)]

    def classify(self, prompts: Any, use_tqdm: bool = False,  # noqa: ANN401
                 ) -> list[PoolingRequestOutput[ClassificationOutput]]:
        """Each prompt's class probabilities (``outputs.probs``) from the sequence-classification head."""
        pooler = self._needs("classify")
        rows = pooler.run(pooling_prompts(prompts))
        return [PoolingRequestOutput(str(i), ClassificationOutput(class_probs(v, pooler.model)), ids)
                for i, (ids, v) in enumerate(rows)]

    def score(self, queries: Any, documents: Any, use_tqdm: bool = False,  # noqa: ANN401
              instruction: str | None = None) -> list[PoolingRequestOutput[ScoringOutput]]:
        """Relevance of each (query, document) pair (one query and N documents, or N and N).

        A classifier scores the pair as one sequence (cross-encoder); a
        yes/no reranker (convert="score") reads its prompt format's answer;
        an embedding model scores the cosine of the two embeddings (bi-encoder).
        """
        pairs = score_pairs(queries, documents)
        pooler = self.pooler
        task = pooler.model.task
        if task == "embed":
            texts = list(dict.fromkeys(t for pair in pairs for t in pair))
            vecs = dict(zip(texts, (v for _, v in pooler.run(texts))))
            return [PoolingRequestOutput(str(i), ScoringOutput(cosine(vecs[q], vecs[d])), [])
                    for i, (q, d) in enumerate(pairs)]
        if task == "score":
            rows = pooler.run([reranker_prompt(q, d, instruction) for q, d in pairs], logits=True)
            return [PoolingRequestOutput(str(i), ScoringOutput(yes_no_score(v)), ids)
                    for i, (ids, v) in enumerate(rows)]
        tok = self.llm_engine.tokenizer.hf
        prompts = [{"prompt_token_ids": tok(q, d)["input_ids"]} for q, d in pairs]
        rows = pooler.run(prompts)
        return [PoolingRequestOutput(str(i), ScoringOutput(cross_encoder_score(v, pooler.model)), ids)
                for i, (ids, v) in enumerate(rows)]
