"""Speculative decoding through ``pagedllm serve``: streamed greedy text is plain decoding's.

Two real servers in subprocesses, one per configuration (module-scoped):
one plain, one with ``--speculative-config`` (ngram, k = 4). The official
``openai`` client streams the same greedy code-repeat request from both; the
texts must be equal, and the speculating server's ``/metrics`` must count
accepted drafts, so the test cannot pass with speculation idle.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import pytest
from openai import OpenAI
from server_helpers import metrics, served
from spec_prompts import REPEAT

from pagedllm.loader import bundled_model_path

pytestmark = pytest.mark.slow  # real servers in subprocesses: outside the fast tier

ENGINE = ["--num-kv-blocks", "256", "--max-model-len", "1024", "--num-threads", "1", "--block-size", "4"]
# cost_model off: every proposal verified, so drafts run whatever this machine's timings say
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "cost_model": False}
MAX_TOKENS = 80


def _serve(tmp_path_factory: pytest.TempPathFactory, extra: list[str]) -> Iterator[str]:
    yield from served([*ENGINE, *extra], tmp_path_factory.mktemp("server"))


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from _serve(tmp_path_factory, [])


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from _serve(tmp_path_factory, ["--speculative-config", json.dumps(NGRAM)])


def _stream_chat(url: str, **extra: object) -> dict[int, tuple[str, str | None]]:
    """Each choice's streamed text and finish reason for the greedy code-repeat chat, through the openai client."""
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    stream = client.chat.completions.create(
        model=os.path.basename(bundled_model_path()), messages=REPEAT, temperature=0,
        max_tokens=MAX_TOKENS, stream=True, **extra,
    )
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            finish[choice.index] = choice.finish_reason or finish.get(choice.index)
    return {i: (texts[i], finish[i]) for i in sorted(texts)}


def test_streamed_greedy_text_with_ngram_equals_plain_server(plain_server, spec_server):
    want = _stream_chat(plain_server)
    before = metrics(spec_server).get("pagedllm:spec_decode_num_accepted_tokens_total", 0.0)
    got = _stream_chat(spec_server)
    assert got == want
    assert len(want[0][0]) > 40, "the reply is too short to have speculated"
    after = metrics(spec_server)
    assert after["pagedllm:spec_decode_num_accepted_tokens_total"] - before > 0, "no draft accepted: vacuous"
    assert after["pagedllm:spec_decode_num_draft_tokens_total"] >= after["pagedllm:spec_decode_num_accepted_tokens_total"]
    assert metrics(plain_server).get("pagedllm:spec_decode_num_draft_tokens_total", 0.0) == 0


def test_streamed_n2_equals_plain_server(plain_server, spec_server):
    """Two greedy choices, streamed: each choice's text is plain decoding's, and the choices speculated."""
    want = _stream_chat(plain_server, n=2)
    before = metrics(spec_server)["pagedllm:spec_decode_num_accepted_tokens_total"]
    got = _stream_chat(spec_server, n=2)
    assert got == want and len(got) == 2
    assert metrics(spec_server)["pagedllm:spec_decode_num_accepted_tokens_total"] - before > 0
