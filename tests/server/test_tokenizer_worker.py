"""The server's tokenizer: short texts in the server process, long ones in its child process.

Both lanes must give what the model's Hugging Face tokenizer gives (the oracle,
transformers' conversion of the bundled GGUF), on either side of the length
that picks the lane, and a long text in the child must not hold up a short one.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from pagedllm.entrypoints.openai.tokenizer_worker import (
    SHORT_IDS,
    SHORT_TEXT_CHARS,
    TokenizerWorker,
)

pytestmark = pytest.mark.slow  # real servers or subprocesses: outside the fast tier

SENTENCE = "Ünïcödé text, 中文 and code: def f(x): return x ** 2\n"


@pytest.fixture(scope="module")
def hf_tok(smollm_tokenizer):  # noqa: ANN001, ANN201
    """transformers' conversion of the bundled GGUF's tokenizer: conftest's session-wide one (converted once)."""
    return smollm_tokenizer


@pytest.fixture(scope="module")
def worker(hf_tok):  # noqa: ANN001, ANN201
    w = TokenizerWorker(hf_tok)
    yield w
    w.close()


@pytest.mark.parametrize("num_chars", [SHORT_TEXT_CHARS - 1, SHORT_TEXT_CHARS, 3 * SHORT_TEXT_CHARS])
def test_both_lanes_encode_as_the_hf_tokenizer(worker: TokenizerWorker, hf_tok, num_chars: int) -> None:  # noqa: ANN001
    text = (SENTENCE * (num_chars // len(SENTENCE) + 1))[:num_chars]
    want = hf_tok.encode(text)
    count, ids = asyncio.run(worker.encode(text, add_special_tokens=True))
    assert (count, ids) == (len(want), want)
    count, ids = asyncio.run(worker.encode(text, add_special_tokens=True, limit=len(want)))
    assert (count, ids) == (len(want), None)  # refused from its count: no id list built
    count, ids_json, strs_json = asyncio.run(worker.tokenize_json(text, True, with_strs=True))
    assert count == len(want) and json.loads(ids_json) == want
    assert json.loads(strs_json) == hf_tok.convert_ids_to_tokens(want)


@pytest.mark.parametrize("num_ids", [SHORT_IDS - 1, SHORT_IDS + 1])
def test_both_lanes_decode_as_the_hf_tokenizer(worker: TokenizerWorker, hf_tok, num_ids: int) -> None:  # noqa: ANN001
    ids = (hf_tok.encode(SENTENCE * (num_ids // 10)) + [hf_tok.eos_token_id])[-num_ids:]
    assert len(ids) == num_ids
    assert asyncio.run(worker.decode(ids)) == hf_tok.decode(ids, skip_special_tokens=False)


def test_a_short_text_does_not_wait_for_a_long_one(worker: TokenizerWorker, hf_tok) -> None:  # noqa: ANN001
    long_text = SENTENCE * ((2 << 20) // len(SENTENCE))  # 2 MiB (4 before): still seconds in the child

    async def both() -> tuple[int, bool, int]:
        long_task = asyncio.create_task(worker.encode(long_text, add_special_tokens=False))
        await asyncio.sleep(0.2)  # the child is busy with it now
        count, _ = await worker.encode(SENTENCE, add_special_tokens=False)
        long_still_running = not long_task.done()
        long_count, _ = await long_task
        return count, long_still_running, long_count

    count, long_still_running, long_count = asyncio.run(both())
    assert count == len(hf_tok.encode(SENTENCE, add_special_tokens=False))
    assert long_count == len(hf_tok.encode(long_text, add_special_tokens=False))
    assert long_still_running  # one queue for both: the short text was answered after the long one


def test_concurrent_short_texts_each_get_their_own_ids(worker: TokenizerWorker, hf_tok) -> None:  # noqa: ANN001
    """The server thread pool's tokenizer is one object used by many threads at once: no answer may mix."""
    texts = [f"{i}: {SENTENCE * (1 + i % 7)}" for i in range(64)]

    async def all_at_once() -> list:
        return await asyncio.gather(*(worker.encode(t, add_special_tokens=False) for t in texts),
                                    *(worker.decode(hf_tok.encode(t, add_special_tokens=False)) for t in texts))

    results = asyncio.run(all_at_once())
    for text, (count, ids), decoded in zip(texts, results[:64], results[64:]):
        want = hf_tok.encode(text, add_special_tokens=False)
        assert (count, ids) == (len(want), want)
        assert decoded == hf_tok.decode(want, skip_special_tokens=False)
