"""An idle ``pagedllm serve`` gives its KV pages back: after a burst, only its cached prefixes stay resident.

The pool is reserved address space, backed by the OS where blocks are
written (``runner/kv_cache.py``). When the last request of a burst finishes,
the engine step that finished it gives back the pages of every block written
since and holding nothing (``LLMEngine._give_back_kv_pages``); blocks that
hold a cached prefix stay resident by design, so a later prompt can hit them.

The burst: 64 completions of unique 40-token prompts (token ids, first ids
all different, so no prompt hits another's blocks), 24 tokens each with EOS
ignored. In 16-token blocks a request computes K/V for 63 tokens: three full
blocks, published to the prefix cache, and a partial one, which is not.

- Prefix caching on (the default): idle, the server must hold exactly the 192
  cached blocks (``/kv/state``'s ``cached_blocks``, ``/metrics``' resident
  bytes). Little goes back: a request's partial block, freed when it ends, is
  handed out again to the requests still running (lowest id first), so only
  the partial blocks of those running at the end are left to give back
  (12 blocks' worth, 8.4 MiB, in the runs measured).
- Prefix caching off: nothing is cached, so idle nothing stays resident and
  every block the burst wrote goes back; the process's resident set must fall
  from its peak by about that much.

Both servers run with the default pool (half of what the weights leave of
free memory), as a user's would: resident is a small part of reserved. They
are started together (module-scoped), so that they load side by side.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI
from server_helpers import free_port, launch_server, metrics, stop_server, wait_healthy

from pagedllm.loader import bundled_model_path

pytestmark = pytest.mark.slow  # a real server in a subprocess

# 24 completion tokens (64 before): as many requests and blocks written at once, in fewer decode steps
NUM_REQUESTS, PROMPT_LEN, MAX_TOKENS, BLOCK_SIZE = 64, 40, 24, 16
# full blocks among the 63 tokens whose K/V each request computes (the last sampled token never runs)
CACHED_PER_REQUEST = (PROMPT_LEN + MAX_TOKENS - 1) // BLOCK_SIZE
# how long an idle server may take to show its pages given back (it does so in the step that drains it)
SETTLE_S = 15
# what an idle server's RSS may keep above its pre-burst figure besides its cached prefixes: the
# allocator's arenas that grew for the burst's activations (11-51 MiB measured on the bundled model)
RSS_SLACK = 96 * 2**20
RESIDENT, RESERVED = "pagedllm:kv_cache_resident_bytes", "pagedllm:kv_cache_reserved_bytes"


def rss(pid: int) -> int:
    """The process's resident set now, in bytes (``/proc/<pid>/status``)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def prompt(i: int) -> list[int]:
    """The i-th request's prompt: its own first token id, then ids no other prompt has in that order."""
    return [1000 + i] + [2000 + (i * 37 + k) % 5000 for k in range(PROMPT_LEN - 1)]


async def burst(url: str, model: str) -> list[int]:
    """All requests at once (one event loop, so they reach the engine together); their completion tokens."""
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    try:
        outs = await asyncio.gather(*(
            client.completions.create(model=model, prompt=prompt(i), max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True})
            for i in range(NUM_REQUESTS)
        ))
    finally:
        await client.close()
    return [o.usage.completion_tokens for o in outs]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[bool, tuple[str, subprocess.Popen]]]:
    """Both servers, prefix caching on (True) and off (False), each with the default pool: launched at once so
    that they load side by side, then each test bursts into its own while the other idles."""
    launched: dict[bool, tuple[str, subprocess.Popen, Path]] = {}
    try:
        for prefix_caching in (True, False):
            port, log = free_port(), tmp_path_factory.mktemp("give-back") / "server.log"
            flags = [] if prefix_caching else ["--no-prefix-caching"]
            proc = launch_server(["--port", str(port), "--num-threads", "1", *flags], log)  # the default pool
            launched[prefix_caching] = (f"http://127.0.0.1:{port}", proc, log)
        for url, proc, log in launched.values():
            wait_healthy(url, proc, log)
        yield {key: (url, proc) for key, (url, proc, _) in launched.items()}
    finally:
        for _, proc, _ in launched.values():
            stop_server(proc)


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-caching", "no-prefix-caching"])
def test_idle_server_after_a_burst_keeps_only_its_cached_prefixes(servers: dict, prefix_caching: bool) -> None:
    url, proc = servers[prefix_caching]
    before = metrics(url)
    assert before[RESIDENT] == 0  # nothing written yet: all of the pool is only reserved
    rss_before = rss(proc.pid)

    # the peaks while the burst runs: RSS often (cheap), the KV figure less often (an HTTP request)
    peak = {"rss": rss_before, "kv": 0.0}
    done = threading.Event()

    def watch_rss() -> None:
        while not done.is_set():
            peak["rss"] = max(peak["rss"], rss(proc.pid))
            time.sleep(0.01)

    def watch_kv() -> None:
        while not done.is_set():
            peak["kv"] = max(peak["kv"], metrics(url)[RESIDENT])
            time.sleep(0.1)

    watchers = [threading.Thread(target=w, daemon=True) for w in (watch_rss, watch_kv)]
    for w in watchers:
        w.start()
    try:
        tokens = asyncio.run(burst(url, os.path.basename(bundled_model_path())))
    finally:
        done.set()
        for w in watchers:
            w.join(30)
    assert tokens == [MAX_TOKENS] * NUM_REQUESTS

    # idle: within SETTLE_S, resident KV is the cached prefixes' blocks and nothing more
    deadline = time.monotonic() + SETTLE_S
    while True:
        after, snap = metrics(url), httpx.get(f"{url}/kv/state", timeout=10).json()
        mem, counters = snap["memory"], snap["counters"]
        cached_bytes = counters["cached_blocks"] * mem["bytes_per_block"]
        if (after[RESIDENT] == cached_bytes == mem["resident_bytes"] and counters["used_blocks"] == 0) \
                or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert counters["used_blocks"] == 0 and snap["requests"] == []
    # every full block, no more (none without prefix caching)
    assert counters["cached_blocks"] == (NUM_REQUESTS * CACHED_PER_REQUEST if prefix_caching else 0)
    assert after[RESIDENT] == mem["resident_bytes"] == cached_bytes, (after[RESIDENT], mem, counters)
    assert mem["resident_blocks"] == counters["cached_blocks"]
    assert after[RESERVED] == mem["reserved_bytes"] > 4 * cached_bytes  # the pool is mostly not resident

    # something was given back: at least the partial block of each request still running at the end
    # (without prefix caching, every block the burst held at once)
    released = peak["kv"] - after[RESIDENT]
    assert released >= (1 if prefix_caching else NUM_REQUESTS) * mem["bytes_per_block"], (peak["kv"], after)
    # ... and the process's resident set fell back: to its pre-burst figure plus the cached prefixes, and
    # (where enough went back to tell it from the allocator's noise) from its peak by what went back
    rss_idle = rss(proc.pid)
    mib = {k: round(v / 2**20, 1) for k, v in [("rss_before", rss_before), ("rss_peak", peak["rss"]),
           ("rss_idle", rss_idle), ("kv_peak", peak["kv"]), ("kv_idle", after[RESIDENT]),
           ("kv_reserved", after[RESERVED])]}
    print(f"MiB: {mib}")  # the figures, for -s
    assert rss_idle - rss_before <= cached_bytes + RSS_SLACK, (rss_before, rss_idle, cached_bytes)
    if not prefix_caching:
        assert peak["rss"] - rss_idle >= 0.75 * released, (peak["rss"], rss_idle, released)
