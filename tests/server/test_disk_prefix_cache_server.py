"""``pagedllm serve --kv-cache-dir``: a restarted server answers a repeated prompt from the blocks on disk.

The first server computes a ~1k-token prompt whole (nothing on disk yet)
and writes its full blocks; it stops. A second server on the same folder
gets the same request: it must answer with the same tokens and logprobs,
and its prefill must skip the blocks it read back (``/metrics``' computed
prompt tokens and disk hits). Both run batch-invariant, so a prompt computed
after a cached prefix gives the same bits as computed whole
(docs/batch-invariance.md) and the comparison is exact.
"""

from __future__ import annotations

import random
from pathlib import Path

import httpx
import pytest
from server_helpers import served

pytestmark = pytest.mark.slow  # two real servers in subprocesses, one after the other

BLOCK_SIZE = 16
PROMPT_LEN = 1001  # 62 full blocks to write and read back (2001 before: the count is not the point)
CACHED = (PROMPT_LEN - 1) // BLOCK_SIZE * BLOCK_SIZE  # every full block but the one holding the last token


def complete(url: str, ids: list[int]) -> tuple[list[str], list[float]]:
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "prompt": ids, "max_tokens": 6, "temperature": 0, "logprobs": 1}
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    assert resp.status_code == 200, resp.text
    lp = resp.json()["choices"][0]["logprobs"]
    return lp["tokens"], lp["token_logprobs"]


def disk_metrics(url: str) -> dict[str, float]:
    from server_helpers import metrics

    m = metrics(url)
    return {k.removeprefix("pagedllm:").removesuffix("_total"): v for k, v in m.items()
            if "kv_disk" in k or "prompt_tokens_computed" in k}


def test_restart_reads_the_prefix_from_disk(tmp_path: Path):
    cache_dir = tmp_path / "kv"
    args = ["--kv-cache-dir", str(cache_dir), "--batch-invariant", "--block-size", str(BLOCK_SIZE),
            "--max-model-len", "2048", "--num-kv-blocks", "160"]
    ids = [random.Random(7).randrange(100, 49000) for _ in range(PROMPT_LEN)]
    (tmp_path / "a").mkdir()
    for url in served(args, tmp_path / "a"):
        cold = complete(url, ids)
        first = disk_metrics(url)
    assert first["prompt_tokens_computed"] == PROMPT_LEN and first["kv_disk_hits"] == 0
    # the server stopped after its writer wrote what was queued (engine shutdown)
    assert len(list(cache_dir.glob("*/*.kvb"))) >= CACHED // BLOCK_SIZE
    (tmp_path / "b").mkdir()
    for url in served(args, tmp_path / "b"):
        warm = complete(url, ids)
        second = disk_metrics(url)
    assert warm == cold
    assert second["prompt_tokens_computed"] == PROMPT_LEN - CACHED
    assert second["kv_disk_hits"] == CACHED // BLOCK_SIZE and second["kv_disk_bytes_read"] > 0
