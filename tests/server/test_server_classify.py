"""``POST /classify`` (vLLM's) on a ``--convert classify`` server: a tiny random three-label Qwen3 sequence
classifier, its probabilities against transformers' own forward (softmax of its logits), label = the argmax's
``id2label``; bad inputs are 400s in OpenAI's error shape. One in-thread server for the module."""

from __future__ import annotations

import httpx
import pytest
import torch
from pooling_models import save_classifier
from server_helpers import assert_openai_error, serve_in_thread

from pagedllm import LLM

pytestmark = pytest.mark.slow
TEXTS = ["Paged attention keeps the KV cache in blocks.", "Bananas are yellow.", "hi"]
ENGINE = dict(max_model_len=128, num_kv_blocks=32, block_size=16, max_num_batched_tokens=64)
LABELS = {0: "negative", 1: "neutral", 2: "positive"}


@pytest.fixture(scope="module")
def classify_server(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer):  # noqa: ANN001, ANN201
    path = str(tmp_path_factory.mktemp("srv-classify"))
    hf = save_classifier(path, smollm_tokenizer, num_labels=3, id2label=LABELS)
    want = []
    for t in TEXTS:
        ids = smollm_tokenizer.encode(t)
        with torch.no_grad():
            want.append((ids, torch.softmax(hf(input_ids=torch.tensor([ids])).logits[0], dim=-1).tolist()))
    llm = LLM(path, runner="pooling", convert="classify", **ENGINE)
    with serve_in_thread(llm.llm_engine, model_name="cls") as url:
        yield url, want


def test_classify_equals_transformers(classify_server) -> None:  # noqa: ANN001
    url, want = classify_server
    body = httpx.post(url + "/classify", json={"model": "cls", "input": TEXTS}).json()
    assert body["object"] == "list" and body["model"] == "cls" and body["id"].startswith("classify-")
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    for d, (_, probs) in zip(body["data"], want):
        assert d["num_classes"] == 3
        assert d["probs"] == pytest.approx(probs, abs=1e-5)
        assert d["label"] == LABELS[max(range(3), key=probs.__getitem__)]
    num = sum(len(ids) for ids, _ in want)
    assert body["usage"] == {"prompt_tokens": num, "total_tokens": num, "completion_tokens": 0,
                             "prompt_tokens_details": None}
    one = httpx.post(url + "/classify", json={"input": TEXTS[1]}).json()["data"]
    assert len(one) == 1 and one[0]["probs"] == pytest.approx(want[1][1], abs=1e-5)
    by_ids = httpx.post(url + "/classify", json={"input": [ids for ids, _ in want]}).json()["data"]
    assert [d["probs"] for d in by_ids] == [pytest.approx(p, abs=1e-5) for _, p in want]


def test_classify_bad_inputs_and_schema(classify_server) -> None:  # noqa: ANN001
    url, _ = classify_server
    for body in ({"input": []}, {"input": ""}, {"input": 3}, {"input": [1.5]}, {"input": [[-1]]}, {},
                 {"input": "word " * 300}, {"input": "hi", "truncate_prompt_tokens": 0}, {"input": "hi", "x": 1}):
        assert_openai_error(httpx.post(url + "/classify", json=body), 400)
    assert_openai_error(httpx.post(url + "/classify", json={"model": "nope", "input": "hi"}), 404)
    assert_openai_error(httpx.post(url + "/v1/embeddings", json={"input": "hi"}), 400, "wrong_task")
    ok = httpx.post(url + "/classify", json={"input": "word " * 300, "truncate_prompt_tokens": 40})
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == 40
    schema = httpx.get(url + "/openapi.json").json()
    route = schema["paths"]["/classify"]["post"]
    assert "400" in route["responses"]
    assert "ClassificationRequest" in schema["components"]["schemas"]
