"""The pooling runner under tensor parallelism: two real ranks (gloo, processes) against one process and transformers.

The checkpoints are the pooling tests' tiny random Qwen3s (``tests/pooling_models.py``: 4 query heads on 2 KV
heads, so one KV head per rank; a 49,152-row vocabulary, 24,576 rows per rank). Each convert mode runs on
``test_tensor_parallel.py``'s two-rank engines (one alive at a time, one thread per rank, float32 activations
and KV cache) and on one process of the same settings, with prompts prefilled in chunks
(``max_num_batched_tokens=32``) so a pooled prompt spans steps:

- ``embed``: the final norm's output is whole on every rank (the row-parallel projections all-reduce), so
  rank 0's pooled rows (last / mean / first token) are one process's to float rounding;
  also the bundled GGUF file (3 KV heads: 2 + 1 per rank; a tied embedding split by vocabulary rows);
- ``classify``: the classifier's ``score.weight`` is read apart on rank 0 and applied there, whole
  (replicated: no rank holds a slice of it); the workers load the decoder alone;
- ``score`` (Qwen3-Reranker's yes/no logits): each rank's LM head holds its slice of the vocabulary and the
  head call gathers the slices, so the ``no`` / ``yes`` ids land in different ranks' halves here and both
  logits still come back to rank 0.

The oracle beside one process is transformers' own forward (its last hidden state pooled by hand, its
classification logits, its LM head's yes / no logits on the reranker's prompt).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from pooling_models import save_classifier, save_decoder
from server_helpers import served
from test_tensor_parallel import TwoRankEngines, _restore_threads, _tp, two_ranks  # noqa: F401

from pagedllm.distributed.shard_plan import ShardPlan
from pagedllm.loader import load_model_config
from pagedllm.pooling.params import PoolingParams
from pagedllm.pooling.prompts import reranker_prompt

TEXTS = ["The cat sat on the mat, and then it sat on the mat again for a long while. " * 2,
         "Paged attention keeps KV blocks.", "hi"]
QUERY = "what is paged attention?"
DOCS = ["KV blocks are paged.", "The weather is nice today, isn't it?", "Bananas are yellow.", "no"]
CHUNKED = dict(block_size=16, max_num_batched_tokens=32)
LABELS = {0: "neg", 1: "neutral", 2: "pos"}


@pytest.fixture(scope="module")
def decoder(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer) -> tuple[str, torch.nn.Module]:  # noqa: ANN001
    path = str(tmp_path_factory.mktemp("tp-pool-qwen3"))
    return path, save_decoder(path, smollm_tokenizer)


@pytest.fixture(scope="module")
def classifier(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer) -> tuple[str, torch.nn.Module]:  # noqa: ANN001
    path = str(tmp_path_factory.mktemp("tp-pool-cls"))
    return path, save_classifier(path, smollm_tokenizer, num_labels=3, id2label=LABELS)


def _pair(two_ranks: TwoRankEngines, path: str, **kwargs: object) -> tuple:  # noqa: F811
    """(one process's engine, the shared two-rank engine) of ``path`` with the same pooling settings."""
    settings = dict(runner="pooling", **CHUNKED, **kwargs)
    return _tp(path, 1, **settings), two_ranks.shared(path, **settings)


def _hf_hidden(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model.model(input_ids=torch.tensor([ids])).last_hidden_state[0].double()


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0))


@pytest.mark.parametrize("pooling", ["LAST", "MEAN", "CLS"])
def test_embeddings_on_two_ranks_equal_one_process(two_ranks: TwoRankEngines,  # noqa: F811
                                                   decoder: tuple[str, torch.nn.Module], pooling: str) -> None:
    path, hf = decoder
    one, two = _pair(two_ranks, path, convert="embed", pooler_config={"pooling_type": pooling, "normalize": False})
    for normalize in (False, True):
        want = one.embed(TEXTS, PoolingParams(normalize=normalize))
        got = two.embed(TEXTS, PoolingParams(normalize=normalize))
        for w, g in zip(want, got):
            assert g.prompt_token_ids == w.prompt_token_ids
            a, b = torch.tensor(g.outputs.embedding), torch.tensor(w.outputs.embedding)
            assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)
            h = _hf_hidden(hf, g.prompt_token_ids)
            ref = {"LAST": h[-1], "MEAN": h.mean(dim=0), "CLS": h[0]}[pooling]
            assert _cos(a, ref) > 1 - 1e-6
            assert float(a.norm()) == pytest.approx(1.0 if normalize else float(ref.norm()), rel=1e-4)
    assert len(got[0].prompt_token_ids) > 32  # the long prompt was pooled over several chunks, on both ranks
    cut = two.embed(TEXTS[1], PoolingParams(dimensions=16))[0].outputs.embedding
    assert cut == pytest.approx(one.embed(TEXTS[1], PoolingParams(dimensions=16))[0].outputs.embedding, abs=1e-5)
    # a bi-encoder's scores: the cosine of two embeddings made on the two ranks
    assert [o.outputs.score for o in two.score(QUERY, DOCS)] == pytest.approx(
        [o.outputs.score for o in one.score(QUERY, DOCS)], abs=1e-5)


def test_bundled_gguf_embeddings_on_two_ranks(two_ranks: TwoRankEngines) -> None:  # noqa: F811
    """SmolLM2's 3 KV heads split unevenly (2 + 1) and its tied, vocabulary-split embedding: mean-pooled
    embeddings of the GGUF file (float32 activations) on two ranks are one process's."""
    one, two = _pair(two_ranks, None, convert="embed", pooler_config={"pooling_type": "MEAN", "normalize": True})
    for w, g in zip(one.embed(TEXTS), two.embed(TEXTS)):
        assert g.prompt_token_ids == w.prompt_token_ids
        assert _cos(torch.tensor(g.outputs.embedding), torch.tensor(w.outputs.embedding)) > 1 - 1e-5


def test_sequence_classifier_on_two_ranks(two_ranks: TwoRankEngines,  # noqa: F811
                                          classifier: tuple[str, torch.nn.Module], smollm_tokenizer) -> None:  # noqa: ANN001
    """``classify`` probabilities and cross-encoder scores (the last label's probability) of a 3-label head."""
    path, hf = classifier
    one, two = _pair(two_ranks, path, convert="classify")
    got, want = two.classify(TEXTS), one.classify(TEXTS)
    for g, w in zip(got, want):
        with torch.no_grad():
            probs = torch.softmax(hf(input_ids=torch.tensor([g.prompt_token_ids])).logits[0].double(), dim=-1)
        assert g.outputs.num_classes == 3
        assert g.outputs.probs == pytest.approx(w.outputs.probs, abs=1e-5)
        assert g.outputs.probs == pytest.approx(probs.tolist(), abs=1e-5)
    scores = [o.outputs.score for o in two.score(QUERY, DOCS)]
    assert scores == pytest.approx([o.outputs.score for o in one.score(QUERY, DOCS)], abs=1e-5)
    for d, s in zip(DOCS, scores):
        ids = smollm_tokenizer(QUERY, d)["input_ids"]
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([ids])).logits[0].double()
        assert s == pytest.approx(float(torch.softmax(logits, dim=-1)[-1]), abs=1e-5)


def _hf_yes_no(hf: torch.nn.Module, tokenizer, query: str, docs: list[str],  # noqa: ANN001
               no_yes: tuple[int, int] | None = None) -> list[float]:
    no_id, yes_id = no_yes or [tokenizer.encode(w, add_special_tokens=False)[0] for w in ("no", "yes")]
    out = []
    for d in docs:
        ids = tokenizer.encode(reranker_prompt(query, d), add_special_tokens=False)
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([ids])).logits[0, -1].double()
        out.append(float(torch.softmax(torch.stack([logits[no_id], logits[yes_id]]), dim=0)[1]))
    return out


def test_yes_no_reranker_on_two_ranks(two_ranks: TwoRankEngines,  # noqa: F811
                                      decoder: tuple[str, torch.nn.Module], smollm_tokenizer) -> None:  # noqa: ANN001
    """Qwen3-Reranker's score: the LM head's no / yes logits at the last prompt token, gathered over the
    ranks' vocabulary slices, batched (several prompts reach their last token in one step) and alone."""
    path, hf = decoder
    one, two = _pair(two_ranks, path, convert="score")
    want = _hf_yes_no(hf, smollm_tokenizer, QUERY, DOCS)
    batched = [o.outputs.score for o in two.score(QUERY, DOCS)]
    assert batched == pytest.approx([o.outputs.score for o in one.score(QUERY, DOCS)], abs=1e-5)
    assert batched == pytest.approx(want, abs=1e-5)
    alone = [two.score(QUERY, d)[0].outputs.score for d in DOCS[:2]]
    assert alone == pytest.approx(want[:2], abs=1e-5)
    # "no" and "yes" are both in rank 0's half of SmolLM2's vocabulary: read one logit from each rank's half
    # (the ids the pooler asks the engine for), so the two halves' gather is what brings them back
    plans = [ShardPlan.make(load_model_config(path), r, 2) for r in range(2)]
    assert [p.vocab for p in plans] == [(0, 24576), (24576, 24576)]
    ids = (two.pooler.no_yes_ids[0], 40000)
    assert ids[0] < 24576
    saved, two.pooler.no_yes_ids = two.pooler.no_yes_ids, ids
    try:
        split = [o.outputs.score for o in two.score(QUERY, DOCS)]
    finally:
        two.pooler.no_yes_ids = saved
    assert split == pytest.approx(_hf_yes_no(hf, smollm_tokenizer, QUERY, DOCS, ids), abs=1e-5)
    assert split != pytest.approx(batched, abs=1e-3)  # another logit was read: the check is not vacuous
    assert not two.llm_engine.requests and two.llm_engine.block_manager.num_used_blocks == 0


@pytest.mark.slow  # a server process with its own worker rank
def test_rerank_route_of_a_two_rank_server(two_ranks: TwoRankEngines,  # noqa: F811
                                           decoder: tuple[str, torch.nn.Module], smollm_tokenizer,  # noqa: ANN001
                                           tmp_path: Path) -> None:
    """``pagedllm serve --tensor-parallel-size 2 --runner pooling --convert score``: ``/v1/rerank`` orders the
    documents by transformers' yes/no scores and returns them."""
    two_ranks.close()  # the server's ranks take this machine's cores
    path, hf = decoder
    want = _hf_yes_no(hf, smollm_tokenizer, QUERY, DOCS)
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])
    server: Iterator[str] = served([path, "--tensor-parallel-size", "2", "--runner", "pooling", "--convert", "score",
                                    "--num-threads", "1", "--num-kv-blocks", "64", "--max-model-len", "256",
                                    "--kv-cache-dtype", "float32"], tmp_path)
    url = next(server)
    try:
        resp = httpx.post(url + "/v1/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 3}, timeout=120)
        assert resp.status_code == 200, resp.text
        results = resp.json()["results"]
        assert [r["index"] for r in results] == order[:3]
        assert [r["relevance_score"] for r in results] == pytest.approx([want[i] for i in order[:3]], abs=1e-5)
        assert results[0]["document"]["text"] == DOCS[order[0]]
    finally:
        server.close()
