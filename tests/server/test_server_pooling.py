"""The pooling routes of a ``--runner pooling`` server against ``LLM.embed`` / ``LLM.score`` of the same engine.

One in-thread server per model (a tiny random Qwen3 embedding model; a tiny Qwen3 sequence classifier for
the cross-encoder's rerank); the expected values are computed through the offline API before the server
takes the engine. The official ``openai`` client's default call sends ``encoding_format="base64"``.
"""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
from pooling_models import save_classifier, save_decoder
from server_helpers import assert_openai_error, serve_in_thread

from pagedllm import LLM
from pagedllm.pooling.params import PoolingParams

pytestmark = pytest.mark.slow
TEXTS = ["Paged attention keeps the KV cache in blocks.", "Bananas are yellow.", "hi there"]
QUERY = "what is paged attention?"
ENGINE = dict(max_model_len=128, num_kv_blocks=48, block_size=16, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def embed_server(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer):  # noqa: ANN001, ANN201
    path = str(tmp_path_factory.mktemp("srv-qwen3"))
    save_decoder(path, smollm_tokenizer)
    llm = LLM(path, runner="pooling", convert="embed", **ENGINE)
    expected = {
        "embed": [o.outputs.embedding for o in llm.embed(TEXTS)],
        "cut": [o.outputs.embedding for o in llm.embed(TEXTS, PoolingParams(dimensions=16))],
        "ids": [o.prompt_token_ids for o in llm.embed(TEXTS)],
        "raw": [o.outputs.data.tolist() for o in llm.encode(TEXTS)],
        "score": [o.outputs.score for o in llm.score(QUERY, TEXTS)],
    }
    with serve_in_thread(llm.llm_engine, model_name="emb") as url:
        yield url, expected


def test_openai_client_base64_and_float(embed_server) -> None:  # noqa: ANN001
    import openai

    url, expected = embed_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    default = client.embeddings.create(model="emb", input=TEXTS)  # base64 on the wire
    floats = client.embeddings.create(model="emb", input=TEXTS, encoding_format="float")
    for got in (default, floats):
        assert [d.index for d in got.data] == [0, 1, 2]
        np.testing.assert_allclose([d.embedding for d in got.data], expected["embed"], atol=1e-6)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(len(i) for i in expected["ids"])
    # LangChain's token-id input, and one list of ids
    by_ids = client.embeddings.create(model="emb", input=expected["ids"], encoding_format="float")
    np.testing.assert_allclose([d.embedding for d in by_ids.data], expected["embed"], atol=1e-6)
    one = client.embeddings.create(model="emb", input=expected["ids"][1], encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, expected["embed"][1], atol=1e-6)
    cut = client.embeddings.create(model="emb", input=TEXTS, dimensions=16, encoding_format="float")
    np.testing.assert_allclose([d.embedding for d in cut.data], expected["cut"], atol=1e-6)
    assert np.linalg.norm(cut.data[0].embedding) == pytest.approx(1.0, abs=1e-5)


def test_pooling_score_and_rerank(embed_server) -> None:  # noqa: ANN001
    url, expected = embed_server
    raw = httpx.post(url + "/pooling", json={"input": TEXTS, "encoding_format": "base64"}).json()
    got = [np.frombuffer(base64.b64decode(d["data"]), dtype="<f4") for d in raw["data"]]
    np.testing.assert_allclose(got, expected["raw"], atol=1e-5)
    score = httpx.post(url + "/score", json={"model": "emb", "text_1": QUERY, "text_2": TEXTS}).json()
    assert [d["score"] for d in score["data"]] == pytest.approx(expected["score"], abs=1e-5)
    order = sorted(range(3), key=lambda i: -expected["score"][i])
    jina = httpx.post(url + "/v1/rerank", json={"query": QUERY, "documents": TEXTS, "top_n": 2}).json()
    assert [r["index"] for r in jina["results"]] == order[:2]
    assert jina["results"][0]["document"]["text"] == TEXTS[order[0]]
    assert jina["usage"]["total_tokens"] > 0
    cohere = httpx.post(url + "/v2/rerank", json={"query": QUERY, "documents": TEXTS}).json()
    assert [r["index"] for r in cohere["results"]] == order
    assert "document" not in cohere["results"][0]
    assert [r["relevance_score"] for r in cohere["results"]] == pytest.approx([expected["score"][i] for i in order],
                                                                              abs=1e-5)


def test_bad_inputs_are_400s(embed_server) -> None:  # noqa: ANN001
    url, _ = embed_server
    for body in ({"input": []}, {"input": 3}, {"input": [1.5]}, {"input": [["a"]]}, {"input": ""},
                 {"input": "word " * 300}, {"input": "hi", "dimensions": 65}, {"input": "hi", "dimensions": 0},
                 {"input": "hi", "encoding_format": "int8"}):
        assert_openai_error(httpx.post(url + "/v1/embeddings", json=body), 400)
    assert_openai_error(httpx.post(url + "/v1/embeddings", json={"model": "nope", "input": "hi"}), 404)
    assert_openai_error(httpx.post(url + "/v1/rerank", json={"query": "q", "documents": []}), 400)
    assert_openai_error(httpx.post(url + "/v1/completions", json={"prompt": "hi"}), 400, "wrong_runner")
    ok = httpx.post(url + "/v1/embeddings", json={"input": "word " * 300, "truncate_prompt_tokens": 50})
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == 50
    paths = httpx.get(url + "/openapi.json").json()["paths"]
    assert {"/v1/embeddings", "/pooling", "/score", "/v1/rerank", "/v2/rerank"} <= set(paths)


def test_cross_encoder_rerank(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer) -> None:  # noqa: ANN001
    path = str(tmp_path_factory.mktemp("srv-cls"))
    save_classifier(path, smollm_tokenizer, num_labels=1)
    llm = LLM(path, runner="pooling", **ENGINE)
    scores = [o.outputs.score for o in llm.score(QUERY, TEXTS)]
    order = sorted(range(3), key=lambda i: -scores[i])
    with serve_in_thread(llm.llm_engine, model_name="rr") as url:
        res = httpx.post(url + "/v2/rerank", json={"query": QUERY, "documents": TEXTS, "top_n": 2,
                                                   "return_documents": True}).json()["results"]
        assert [r["index"] for r in res] == order[:2]
        assert [r["relevance_score"] for r in res] == pytest.approx([scores[i] for i in order[:2]], abs=1e-5)
        assert res[0]["document"] == {"text": TEXTS[order[0]]}
        assert_openai_error(httpx.post(url + "/v1/embeddings", json={"input": "hi"}), 400, "wrong_task")


def test_a_generating_server_refuses_pooling_routes() -> None:
    """The pooling routes of a generating server answer 400 (``wrong_runner``) and are not in its schema."""
    from types import SimpleNamespace

    from pagedllm.entrypoints.openai.protocol import APIError
    from pagedllm.entrypoints.openai.serving_pooling import OpenAIServingPooling

    client = SimpleNamespace(engine=SimpleNamespace(config=SimpleNamespace(runner="generate")))
    serving = OpenAIServingPooling(client, None, ("gen",))
    with pytest.raises(APIError) as e:
        serving._check("gen", "embed")
    assert e.value.status_code == 400 and e.value.code == "wrong_runner"
