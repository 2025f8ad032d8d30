"""``pagedllm serve --data-parallel-size 2``, run for real on loopback, driven by the official ``openai`` client.

A subprocess server on the bundled model, ``dp``, with two replica processes
(one thread each, pinned to one core each), and ``single``, one engine of the
same settings in this process: the reference for greedy answers (the
server's answers are the engine's: tests/server). The tests
read the per-replica counters of ``/metrics`` (``replica`` label) to see where
requests went, kill a replica with SIGKILL mid-run, and stop the server to
check that no child process survives it. The tests run in file order; the
last one stops the ``dp`` server.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import psutil
import pytest
from openai import OpenAI
from server_helpers import free_port, launch_server, metrics, stop_server, wait_healthy

from pagedllm import LLM, SamplingParams
from pagedllm.loader import bundled_model_path

ENGINE = ["--num-kv-blocks", "256", "--max-model-len", "1024", "--num-threads", "1"]
MODEL = os.path.basename(bundled_model_path())


def _launch(tmp: Path, name: str, extra: list[str]) -> tuple[str, subprocess.Popen, Path]:
    port = free_port()
    log = tmp / f"{name}.log"
    return f"http://127.0.0.1:{port}", launch_server(["--port", str(port), *ENGINE, *extra], log), log


@pytest.fixture(scope="module")
def dp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    url, proc, log = _launch(tmp_path_factory.mktemp("dp"), "dp", ["--data-parallel-size", "2"])
    try:
        wait_healthy(url, proc, log)
        yield {"url": url, "proc": proc, "log": log,
               "client": OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)}
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def single() -> LLM:
    """One engine with the replicas' settings (ENGINE): what one replica answers alone."""
    return LLM(None, num_kv_blocks=256, max_model_len=1024, num_threads=1)


def replica_figure(m: dict[str, float], name: str, replica: int) -> float:
    return m.get(f'pagedllm:replica_{name}{{"replica": "{replica}"}}', 0.0)


def settled_metrics(url: str) -> dict[str, float]:
    """/metrics once every replica reported itself idle (stats arrive just after the last output)."""
    deadline = time.monotonic() + 10
    while True:
        m = metrics(url)
        busy = m["pagedllm:num_requests_running"] + m["pagedllm:num_requests_waiting"]
        if busy == 0 or time.monotonic() > deadline:
            time.sleep(0.3)  # one more stats period
            return metrics(url)
        time.sleep(0.1)


def replica_pids(log: Path) -> dict[int, int]:
    """The latest pid of each replica, from the server log's start lines."""
    pids = {}
    for index, pid in re.findall(r"data-parallel replica (\d+) started \(pid (\d+)", log.read_text()):
        pids[int(index)] = int(pid)
    return pids


def test_shared_prefix_goes_where_it_is_cached_and_others_spread(dp):
    url, client = dp["url"], dp["client"]
    prefix = list(range(2000, 2000 + 160))  # 10 full blocks of 16
    before = settled_metrics(url)
    client.completions.create(model=MODEL, prompt=prefix + [7, 8, 9], max_tokens=2, temperature=0)
    mid = settled_metrics(url)
    first = [r for r in (0, 1) if replica_figure(mid, "prefix_cache_queries_total", r)
             > replica_figure(before, "prefix_cache_queries_total", r)]
    assert len(first) == 1, "the first request ran on exactly one replica"
    home, other = first[0], 1 - first[0]
    for i in range(4):
        client.completions.create(model=MODEL, prompt=prefix + [100 + i, 200 + i], max_tokens=2, temperature=0)
    after = settled_metrics(url)

    def delta(name: str, r: int, a: dict = after, b: dict = mid) -> float:
        return replica_figure(a, name, r) - replica_figure(b, name, r)

    assert delta("prefix_cache_hits_total", home) == 4 * 160, "every follower hit the whole prefix there"
    assert delta("prefix_cache_queries_total", other) == 0, "nothing went to the other replica"
    # unrelated prompts: both replicas get some
    for i in range(6):
        client.completions.create(model=MODEL, prompt=[3000 + 50 * i + j for j in range(20)], max_tokens=2,
                                  temperature=0)
    spread = settled_metrics(url)
    for r in (0, 1):
        assert delta("prefix_cache_queries_total", r, spread, after) > 0, f"replica {r} got none"
    assert spread["pagedllm:prefix_cache_hits_total"] == sum(
        replica_figure(spread, "prefix_cache_hits_total", r) for r in (0, 1)
    )


def test_32_concurrent_streams_complete_and_equal_one_engine(dp, single: LLM):
    client = dp["client"]
    num = 32
    prompts = [f"Question {i}: what is {i} plus {i + 1}?" for i in range(num)]
    texts: list[str | None] = [None] * num
    before = settled_metrics(dp["url"])

    def one(i: int) -> None:
        stream = client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=6, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        texts[i] = "".join(c.choices[0].text for c in stream if c.choices)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(num)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert all(t is not None for t in texts), "some streams did not finish"
    after = settled_metrics(dp["url"])
    for r in (0, 1):  # both replicas worked
        assert replica_figure(after, "generation_tokens_total", r) > replica_figure(
            before, "generation_tokens_total", r)
    assert after["pagedllm:generation_tokens_total"] - before["pagedllm:generation_tokens_total"] == 6 * num
    expected = [o.outputs[0].text for o in single.generate(
        prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)]
    assert texts == expected


def test_killing_a_replica_fails_only_its_requests_and_it_comes_back(dp):
    url, client, log = dp["url"], dp["client"], dp["log"]
    num = 6
    outcome: list[str | None] = [None] * num
    first_chunk = [threading.Event() for _ in range(num)]

    def one(i: int) -> None:
        try:
            stream = client.completions.create(model=MODEL, prompt=f"Story {i}: once upon a time", max_tokens=300,
                                               temperature=0, stream=True, extra_body={"ignore_eos": True})
            text = ""
            for c in stream:
                first_chunk[i].set()
                text += c.choices[0].text if c.choices else ""
            outcome[i] = "done" if text else "empty"
        except openai.APIError as e:
            outcome[i] = f"error: {e}"
        finally:
            first_chunk[i].set()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(num)]
    for t in threads:
        t.start()
    for e in first_chunk:
        assert e.wait(120)
    m = metrics(url)
    on_victim = replica_figure(m, "requests_in_flight", 0)
    assert on_victim > 0 and replica_figure(m, "requests_in_flight", 1) > 0
    old_pid = replica_pids(log)[0]
    os.kill(old_pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while replica_figure(metrics(url), "up", 0) != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    # the server keeps answering meanwhile (replica 1)
    answer = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    assert answer.choices[0].text
    assert httpx_status(f"{url}/health") == 200
    for t in threads:
        t.join(180)
    errors = [o for o in outcome if o is not None and o.startswith("error")]
    assert len(errors) == on_victim, outcome
    assert outcome.count("done") == num - on_victim
    assert all("replica 0 stopped" in e for e in errors), errors
    # it comes back, with a new process, and serves again
    deadline = time.monotonic() + 180
    while replica_figure(metrics(url), "up", 0) != 1 and time.monotonic() < deadline:
        time.sleep(0.5)
    m = metrics(url)
    assert replica_figure(m, "up", 0) == 1 and replica_figure(m, "restarts_total", 0) == 1
    assert replica_pids(log)[0] != old_pid and not psutil.pid_exists(old_pid)
    gen = replica_figure(m, "generation_tokens_total", 0)
    for i in range(4):  # equal loads take turns: some land on replica 0
        client.completions.create(model=MODEL, prompt=[4000 + i], max_tokens=2, temperature=0)
    assert replica_figure(settled_metrics(url), "generation_tokens_total", 0) > gen


def httpx_status(url: str) -> int:
    import httpx

    return httpx.get(url, timeout=10).status_code


def test_shutdown_leaves_no_child_process(dp):
    proc = dp["proc"]
    children = psutil.Process(proc.pid).children(recursive=True)
    pids = set(replica_pids(dp["log"]).values())
    assert pids <= {c.pid for c in children}
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [p.pid for p in alive]
    text = dp["log"].read_text()
    assert "Application shutdown complete" in text
    assert "Traceback" not in text, text[-3000:]
