"""The pooling routes under ``pagedllm serve --data-parallel-size 2`` (two replica processes, one core each) on
the bundled model: embeddings and cosine scores (``--convert embed``), and the yes/no reranker
(``--convert score``), whose [no, yes] logits each replica's engine takes at the last prompt token. The
expected values come from one in-process engine of the same settings (``LLM.embed`` / ``LLM.score``)."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
from server_helpers import served

from pagedllm import LLM

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
TEXTS = ["Paged attention keeps the KV cache in blocks.", "Bananas are yellow.", "The KV cache grows with context.",
         "hi there"]
QUERY = "what is paged attention?"
ENGINE = dict(num_kv_blocks=64, max_model_len=256, num_threads=1)
FLAGS = ["--num-kv-blocks", "64", "--max-model-len", "256", "--num-threads", "1", "--data-parallel-size", "2",
         "--runner", "pooling"]


def _post(url: str, route: str, body: dict) -> dict:
    resp = httpx.post(url + route, json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _dp_server(tmp: Path, convert: str):  # noqa: ANN202
    return served([*FLAGS, "--convert", convert], tmp)


def test_embed_and_score_routes_with_two_replicas(tmp_path: Path) -> None:
    llm = LLM(runner="pooling", convert="embed", **ENGINE)
    want = [o.outputs.embedding for o in llm.embed(TEXTS)]
    want_scores = [o.outputs.score for o in llm.score(QUERY, TEXTS)]
    del llm
    server = _dp_server(tmp_path, "embed")
    url = next(server)
    try:
        # several requests at once: the router spreads them over both replicas
        got = [d["embedding"] for d in _post(url, "/v1/embeddings", {"input": TEXTS})["data"]]
        np.testing.assert_allclose(got, want, atol=1e-4)
        scores = [d["score"] for d in _post(url, "/score", {"text_1": QUERY, "text_2": TEXTS})["data"]]
        assert scores == pytest.approx(want_scores, abs=1e-4)
        ranked = _post(url, "/v1/rerank", {"query": QUERY, "documents": TEXTS, "top_n": 2})["results"]
        assert [r["index"] for r in ranked] == sorted(range(len(TEXTS)), key=lambda i: -want_scores[i])[:2]
    finally:
        server.close()


def test_yes_no_reranker_with_two_replicas(tmp_path: Path) -> None:
    llm = LLM(runner="pooling", convert="score", **ENGINE)
    want = [o.outputs.score for o in llm.score(QUERY, TEXTS)]
    del llm
    server = _dp_server(tmp_path, "score")
    url = next(server)
    try:
        cohere = _post(url, "/v2/rerank", {"query": QUERY, "documents": TEXTS})["results"]
        order = sorted(range(len(TEXTS)), key=lambda i: -want[i])
        assert [r["index"] for r in cohere] == order
        assert [r["relevance_score"] for r in cohere] == pytest.approx([want[i] for i in order], abs=1e-4)
        scores = [d["score"] for d in _post(url, "/score", {"text_1": QUERY, "text_2": TEXTS})["data"]]
        assert scores == pytest.approx(want, abs=1e-4)
    finally:
        server.close()
