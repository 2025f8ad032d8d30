"""Speculative decoding through ``pagedllm serve``: streamed greedy text is plain decoding's.

Two real servers in subprocesses, one per configuration (module-scoped, started
together so that they load side by side): one plain, one with
``--speculative-config`` (ngram, k = 4). The official
``openai`` client streams the same greedy code-repeat request from both; the
texts must be equal, and the speculating server's ``/metrics`` must count
accepted drafts, so the test cannot pass with speculation idle.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI
from server_helpers import free_port, launch_server, metrics, stop_server, wait_healthy
from spec_prompts import REPEAT

from pagedllm.loader import bundled_model_path

pytestmark = pytest.mark.slow  # real servers in subprocesses: outside the fast tier

ENGINE = ["--num-kv-blocks", "256", "--max-model-len", "1024", "--num-threads", "1", "--block-size", "4"]
# cost_model off: every proposal verified, so drafts run whatever this machine's timings say
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "cost_model": False}
MAX_TOKENS = 80


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Both servers' URLs by name: launched at once (one core each while they load), then waited for."""
    launched: dict[str, tuple[str, subprocess.Popen, Path]] = {}
    try:
        for name, extra in (("plain", []), ("spec", ["--speculative-config", json.dumps(NGRAM)])):
            port, log = free_port(), tmp_path_factory.mktemp(name) / "server.log"
            launched[name] = (f"http://127.0.0.1:{port}", launch_server(["--port", str(port), *ENGINE, *extra], log), log)
        for url, proc, log in launched.values():
            wait_healthy(url, proc, log)
        yield {name: url for name, (url, _, _) in launched.items()}
    finally:
        for _, proc, _ in launched.values():
            stop_server(proc)


@pytest.fixture(scope="module")
def plain_server(servers: dict[str, str]) -> str:
    return servers["plain"]


@pytest.fixture(scope="module")
def spec_server(servers: dict[str, str]) -> str:
    return servers["spec"]


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
