"""How pooling prompts share the engine's work: a batch of prompts is one prefill-only step (no LM head, no
sample), and Qwen3-Embedding's query format (``Instruct: {task}\\nQuery:{query}``, its card's) lets a long
instruction shared by many queries be computed once and then read from the prefix cache (the block
manager's hit counter), the embeddings the same as an engine without a prefix cache computes."""

from __future__ import annotations

import pytest
import torch
from pooling_models import save_decoder

from pagedllm import LLM
from pagedllm.pooling.prompts import embedding_query

ENGINE = dict(max_model_len=256, num_kv_blocks=64, block_size=16, max_num_batched_tokens=256)
TASK = ("Given a question about how an inference engine manages memory, retrieve the passages of its documentation "
        "that answer the question, preferring passages that explain the mechanism over those that only name it")
QUERIES = ["what is paged attention?", "how are KV blocks shared?", "when is a block evicted?", "what is a slot?"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer) -> str:  # noqa: ANN001
    path = str(tmp_path_factory.mktemp("pool-instruct"))
    save_decoder(path, smollm_tokenizer)
    return path


def test_query_format_is_the_cards() -> None:
    assert embedding_query("retrieve passages", "what is X?") == "Instruct: retrieve passages\nQuery:what is X?"
    with pytest.raises(ValueError):
        embedding_query("", "q")


def test_shared_instruction_is_computed_once(folder: str, smollm_tokenizer) -> None:  # noqa: ANN001
    llm = LLM(folder, runner="pooling", convert="embed", enable_prefix_caching=True, **ENGINE)
    prompts = [embedding_query(TASK, q) for q in QUERIES]
    ids = [smollm_tokenizer.encode(p) for p in prompts]
    shared = next(i for i in range(min(map(len, ids))) if len({tuple(x[: i + 1]) for x in ids}) > 1)
    num_shared_blocks = shared // 16
    assert num_shared_blocks >= 2  # the instruction spans several blocks
    blocks = llm.llm_engine.block_manager
    first = llm.embed(prompts[0])[0].outputs.embedding
    hits = blocks.num_prefix_hits
    rest = [o.outputs.embedding for o in llm.embed(prompts[1:])]
    # every later query reads the instruction's full blocks from the cache instead of computing them
    assert blocks.num_prefix_hits - hits == (len(QUERIES) - 1) * num_shared_blocks * 16
    assert blocks.num_used_blocks == 0 and not llm.llm_engine.requests
    plain = LLM(folder, runner="pooling", convert="embed", enable_prefix_caching=False, **ENGINE)
    want = [o.outputs.embedding for o in plain.embed(prompts)]
    got = torch.tensor([first, *rest])
    assert torch.nn.functional.cosine_similarity(got, torch.tensor(want), dim=1).min() > 1 - 1e-5


def test_a_batch_is_one_prefill_step(folder: str) -> None:
    llm = LLM(folder, runner="pooling", convert="embed", enable_prefix_caching=False, **ENGINE)
    runner = llm.llm_engine.model_runner
    records = []
    execute = runner.execute

    def recorded(record):  # noqa: ANN001, ANN202
        records.append(record)
        return execute(record)

    runner.execute = recorded
    texts = [f"passage {i}: " + "paged blocks " * (i % 5 + 1) for i in range(12)]
    batched = [o.outputs.embedding for o in llm.embed(texts)]
    computed = [r for r in records if r.sequences]  # (a record may only tell the runner what finished)
    assert len(computed) == 1  # every prompt whole, in one step
    steps = computed[0].sequences
    assert len(steps) == len(texts) and all(s.pooling == "LAST" and not s.uniforms for s in steps)  # nothing sampled
    alone = [llm.embed(t)[0].outputs.embedding for t in texts]
    assert torch.nn.functional.cosine_similarity(torch.tensor(batched), torch.tensor(alone), dim=1).min() > 1 - 1e-5
