"""LLM(runner="pooling"): embeddings, classification and scores equal transformers' on tiny random Qwen3s.

The oracle is transformers' own forward: its last hidden state (after the final norm) pooled by hand
(last / mean / first token), its sequence-classification logits, and its LM head's yes / no logits on
Qwen3-Reranker's prompt. Engines are module-scoped and tiny; prompts are prefilled in chunks
(``max_num_batched_tokens=32``) so a pooled prompt spans steps.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from pooling_models import add_sentence_transformers, save_classifier, save_decoder

from pagedllm import LLM
from pagedllm.pooling.model_pooling import resolve_pooling_model
from pagedllm.pooling.params import PoolingParams
from pagedllm.pooling.prompts import reranker_prompt

TEXTS = ["The cat sat on the mat, and then it sat on the mat again for a long while. " * 2,
         "Paged attention keeps KV blocks.", "hi"]
ENGINE = dict(max_model_len=256, num_kv_blocks=48, block_size=16, max_num_batched_tokens=32)


def cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=0))


@pytest.fixture(scope="module")
def decoder(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer) -> tuple[str, torch.nn.Module]:  # noqa: ANN001
    path = str(tmp_path_factory.mktemp("pool-qwen3"))
    return path, save_decoder(path, smollm_tokenizer)


@pytest.fixture(scope="module")
def engines(decoder: tuple[str, torch.nn.Module]) -> dict[str, LLM]:
    """One embedding engine per pooling type (not normalised: each request chooses)."""
    path, _ = decoder
    return {pt: LLM(path, runner="pooling", convert="embed", pooler_config={"pooling_type": pt, "normalize": False},
                    **ENGINE) for pt in ("LAST", "MEAN", "CLS")}


def hf_pooled(model: torch.nn.Module, ids: list[int], pooling: str) -> torch.Tensor:
    with torch.no_grad():
        h = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
    return {"LAST": h[-1], "MEAN": h.mean(dim=0), "CLS": h[0]}[pooling]


@pytest.mark.parametrize("pooling", ["LAST", "MEAN", "CLS"])
@pytest.mark.parametrize("normalize", [False, True])
def test_embeddings_equal_transformers(engines: dict[str, LLM], decoder: tuple[str, torch.nn.Module],
                                       pooling: str, normalize: bool) -> None:
    llm, (_, hf) = engines[pooling], decoder
    batched = llm.embed(TEXTS, PoolingParams(normalize=normalize))
    alone = [llm.embed(t, PoolingParams(normalize=normalize))[0] for t in TEXTS]
    for b, a in zip(batched, alone):
        ref = hf_pooled(hf, b.prompt_token_ids, pooling)
        got = torch.tensor(b.outputs.embedding)
        assert b.outputs.hidden_size == 64
        assert cos(got, ref) > 1 - 1e-5
        assert abs(float(got.norm()) - (1.0 if normalize else float(ref.norm()))) < 1e-3 * max(1.0, float(ref.norm()))
        assert cos(torch.tensor(a.outputs.embedding), got) > 1 - 1e-5
    assert len(batched[0].prompt_token_ids) > 32  # the long prompt was pooled over several chunks


def test_encode_and_dimensions(engines: dict[str, LLM], decoder: tuple[str, torch.nn.Module]) -> None:
    llm, (_, hf) = engines["MEAN"], decoder
    raw = llm.encode(TEXTS[1])[0]
    ref = hf_pooled(hf, raw.prompt_token_ids, "MEAN")
    assert torch.allclose(raw.outputs.data, ref, atol=1e-4)
    cut = torch.tensor(llm.embed(TEXTS[1], PoolingParams(dimensions=16, normalize=True))[0].outputs.embedding)
    assert cut.shape == (16,)
    assert cos(cut, ref[:16]) > 1 - 1e-5 and abs(float(cut.norm()) - 1) < 1e-5
    with pytest.raises(ValueError, match="dimensions"):
        llm.embed(TEXTS[1], PoolingParams(dimensions=65))
    ids = llm.embed({"prompt_token_ids": raw.prompt_token_ids}, PoolingParams(normalize=False))[0]
    assert cos(torch.tensor(ids.outputs.embedding), ref) > 1 - 1e-5


def test_last_pooling_takes_prefix_hits(engines: dict[str, LLM], decoder: tuple[str, torch.nn.Module]) -> None:
    """A LAST-pooled prompt reuses a cached instruction prefix and still pools the right state."""
    llm, (_, hf) = engines["LAST"], decoder
    prefix = "Instruct: retrieve passages that answer the question about paged attention.\nQuery: " * 2
    llm.embed(prefix + "first")
    hits = llm.llm_engine.block_manager.num_prefix_hits
    out = llm.embed(prefix + "second one")[0]
    assert llm.llm_engine.block_manager.num_prefix_hits > hits
    assert cos(torch.tensor(out.outputs.embedding), hf_pooled(hf, out.prompt_token_ids, "LAST")) > 1 - 1e-5
    assert not llm.llm_engine.requests and llm.llm_engine.block_manager.num_used_blocks == 0  # every block back


def test_bad_inputs(engines: dict[str, LLM]) -> None:
    llm = engines["LAST"]
    for bad in ([], 3, [1.5], [["a"]]):
        with pytest.raises(ValueError):
            llm.embed(bad)
    with pytest.raises(ValueError, match="context length"):
        llm.embed("word " * 400)
    assert len(llm.embed("word " * 400, PoolingParams(truncate_prompt_tokens=100))[0].prompt_token_ids) == 100
    with pytest.raises(ValueError, match="runner='generate'"):
        llm.generate("hi")
    with pytest.raises(ValueError, match="classify"):
        llm.classify("hi")
    assert not llm.llm_engine.requests


def test_sentence_transformers_config(decoder: tuple[str, torch.nn.Module], tmp_path) -> None:  # noqa: ANN001
    path, _ = decoder
    copy = str(tmp_path / "st")
    shutil.copytree(path, copy)
    add_sentence_transformers(copy, "mean", normalize=False)
    from pagedllm.loader import load_model_config

    head = resolve_pooling_model(copy, load_model_config(copy), "auto", None)
    assert (head.task, head.pooling_type, head.normalize) == ("embed", "MEAN", False)
    plain = resolve_pooling_model(path, load_model_config(path), "auto", None)
    assert (plain.pooling_type, plain.normalize) == ("LAST", True)  # Qwen3-Embedding's


def test_cosine_score(engines: dict[str, LLM]) -> None:
    llm = engines["MEAN"]
    scores = [o.outputs.score for o in llm.score("Paged attention", ["Paged attention keeps KV blocks.", "hi"])]
    a, b, c = (torch.tensor(o.outputs.embedding) for o in llm.embed(
        ["Paged attention", "Paged attention keeps KV blocks.", "hi"]))
    assert scores == pytest.approx([cos(a, b), cos(a, c)], abs=1e-5)


def test_cross_encoder_equals_transformers(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer) -> None:  # noqa: ANN001
    path = str(tmp_path_factory.mktemp("pool-cls"))
    hf = save_classifier(path, smollm_tokenizer, num_labels=1)
    llm = LLM(path, runner="pooling", **ENGINE)  # convert="auto": a *ForSequenceClassification -> classify
    docs = ["KV blocks are paged.", "The weather is nice today, isn't it?", "no"]
    scores = [o.outputs.score for o in llm.score("what is paged attention?", docs)]
    for d, s in zip(docs, scores):
        ids = smollm_tokenizer("what is paged attention?", d)["input_ids"]
        with torch.no_grad():
            logit = hf(input_ids=torch.tensor([ids])).logits[0, 0]
        assert s == pytest.approx(float(torch.sigmoid(logit)), abs=1e-5)
    probs = llm.classify(docs[0])[0].outputs.probs
    assert probs == pytest.approx([1.0])
    many = str(tmp_path_factory.mktemp("pool-cls3"))
    hf3 = save_classifier(many, smollm_tokenizer, num_labels=3)
    out = LLM(many, runner="pooling", convert="classify", **ENGINE).classify(docs)
    for o in out:
        with torch.no_grad():
            want = torch.softmax(hf3(input_ids=torch.tensor([o.prompt_token_ids])).logits[0], dim=-1)
        assert o.outputs.num_classes == 3
        assert o.outputs.probs == pytest.approx(want.tolist(), abs=1e-5)


def test_yes_no_reranker_equals_transformers(decoder: tuple[str, torch.nn.Module], smollm_tokenizer) -> None:  # noqa: ANN001
    path, hf = decoder
    llm = LLM(path, runner="pooling", convert="score", **ENGINE)
    no_id, yes_id = (smollm_tokenizer.encode(w, add_special_tokens=False)[0] for w in ("no", "yes"))
    docs = ["KV blocks are paged.", "Bananas are yellow."]
    outs = llm.score("what is paged attention?", docs)
    for d, o in zip(docs, outs):
        ids = smollm_tokenizer.encode(reranker_prompt("what is paged attention?", d), add_special_tokens=False)
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([ids])).logits[0, -1]
        want = float(torch.softmax(torch.stack([logits[no_id], logits[yes_id]]), dim=0)[1])
        assert o.outputs.score == pytest.approx(want, abs=1e-5)


@pytest.mark.slow  # transformers parses the bundled GGUF (the session's hf_smollm, shared with other slow tests)
def test_bundled_model_embeddings_equal_transformers(hf_smollm) -> None:  # noqa: ANN001
    """SmolLM2-135M Q4_1 on float32 activations (transformers' own computation of the dequantized blocks)."""
    llm = LLM(runner="pooling", pooler_config={"pooling_type": "MEAN", "normalize": False},
              gguf_activations="float32", **ENGINE)
    for out in llm.embed(TEXTS[:2]):
        ref = hf_pooled(hf_smollm, out.prompt_token_ids, "MEAN")
        assert cos(torch.tensor(out.outputs.embedding), ref) > 1 - 1e-5
    last = LLM(runner="pooling", gguf_activations="float32", **ENGINE).embed(TEXTS[1])[0]
    ref = torch.nn.functional.normalize(hf_pooled(hf_smollm, last.prompt_token_ids, "LAST"), dim=0)
    assert cos(torch.tensor(last.outputs.embedding), ref) > 1 - 1e-5


def test_tiny_qwen2_embeddings_equal_transformers(tiny_model_dirs: dict[str, str]) -> None:
    from transformers import AutoModelForCausalLM

    path = tiny_model_dirs["qwen2"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, runner="pooling", pooler_config={"pooling_type": "MEAN"}, **ENGINE)
    for out in llm.embed(TEXTS):
        ref = torch.nn.functional.normalize(hf_pooled(hf, out.prompt_token_ids, "MEAN"), dim=0)
        assert cos(torch.tensor(out.outputs.embedding), ref) > 1 - 1e-5


@pytest.mark.parametrize("pooling", ["mean", pytest.param("lasttoken", marks=pytest.mark.slow),
                                     pytest.param("cls", marks=pytest.mark.slow)])
def test_sentence_transformers_encode(decoder: tuple[str, torch.nn.Module], tmp_path, pooling: str) -> None:  # noqa: ANN001
    """A folder with sentence-transformers' pooling config: ``LLM.embed`` (convert="auto" reads it) equals
    sentence-transformers' own ``encode`` of the same folder."""
    st = pytest.importorskip("sentence_transformers")
    path, _ = decoder
    copy = str(tmp_path / "st")
    shutil.copytree(path, copy)
    add_sentence_transformers(copy, pooling, normalize=True)
    want = st.SentenceTransformer(copy, device="cpu").encode(TEXTS[:2], batch_size=1, convert_to_tensor=True)
    got = LLM(copy, runner="pooling", **ENGINE).embed(TEXTS[:2])
    for g, w in zip(got, want):
        assert cos(torch.tensor(g.outputs.embedding), w) > 1 - 1e-5



def test_mean_sum_starts_again_after_a_preemption() -> None:
    """The engine's MEAN bookkeeping: a prompt recomputed from position 0 (after a preemption) drops its
    earlier partial sum; the step that completes the prompt divides by its length and ends the sequence."""
    from types import SimpleNamespace

    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.step_result import StepResult

    finished = []
    engine = SimpleNamespace(scheduler=SimpleNamespace(finish=lambda seq, status: finished.append(status)))
    req = SimpleNamespace(request_id="r", params=SimpleNamespace(pooling_type="MEAN"), pooled=None)
    seq = SimpleNamespace(num_prompt_tokens=4, stop_reason="x")

    def step(start: int, num: int, share: list[float]) -> object:
        s = SimpleNamespace(num_computed_tokens=start, num_new_tokens=num, seq=seq)
        return LLMEngine._add_pooled(engine, req, s, StepResult(pooled=share, pooled_start=start))

    assert step(0, 2, [10.0, 10.0]) is None and step(0, 2, [1.0, 2.0]) is None  # preempted, run again
    assert step(2, 2, [3.0, 6.0]) is None
    assert req.pooled == [1.0, 2.0] and len(finished) == 1
    req.pooled, req.params.pooling_type = None, "LAST"
    assert isinstance(step(0, 4, None), ValueError)  # a prompt that ended with nothing pooled fails alone
