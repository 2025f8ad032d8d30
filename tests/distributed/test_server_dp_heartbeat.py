"""A data-parallel replica that stops answering (SIGSTOP) is noticed by its missing heartbeats and replaced.

``pagedllm serve --data-parallel-size 2 --replica-heartbeat-timeout 3`` runs
for real on loopback, driven by the official ``openai`` client. One replica
is frozen with SIGSTOP while streams run on both: within the timeout it is
reported down (``/metrics``, ``/health``), its streams that had tokens end
with an error event, requests routed to it meanwhile (no output yet) move
to the other replica and complete, and a fresh process takes its place.
The first tests need no server: the timeout's checks and which requests move.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from openai import OpenAI
from server_helpers import free_port, launch_server, metrics, stop_server, wait_healthy

from pagedllm.clients.data_parallel.replica_client import (
    LostRequests,
    _take_lost,
    check_heartbeat_timeout,
)
from pagedllm.loader import bundled_model_path
from pagedllm.sampling_params import SamplingParams

TIMEOUT_S = 3.0
ENGINE = ["--num-kv-blocks", "256", "--max-model-len", "1024", "--num-threads", "1"]
MODEL = os.path.basename(bundled_model_path())


@pytest.mark.parametrize("bad", [0, 0.5, -3, float("inf"), float("nan"), True, "3"])
def test_heartbeat_timeout_rejects_unusable_values(bad: object) -> None:
    with pytest.raises(ValueError, match="heartbeat timeout"):
        check_heartbeat_timeout(bad)  # type: ignore[arg-type]


def test_heartbeat_timeout_flag_needs_replicas(capsys: pytest.CaptureFixture[str]) -> None:
    """Refused before the model loads (in this process: the CLI's own exit status and message)."""
    from pagedllm.entrypoints import cli

    assert cli.main(["serve", "--port", str(free_port()), "--replica-heartbeat-timeout", "3"]) == 2
    assert "--replica-heartbeat-timeout needs --data-parallel-size > 1" in capsys.readouterr().err


class _Sink:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id

    def put(self, item: object) -> None:
        raise AssertionError("a stream taken to move must not be failed here")


def test_only_requests_without_output_move_and_at_most_once() -> None:
    params = SamplingParams(max_tokens=4)
    streams = {rid: _Sink(rid) for rid in ("a-0", "a-1", "b-0", "c-0", "d-0")}
    unanswered: concurrent.futures.Future = concurrent.futures.Future()
    pending = {7: unanswered}
    calls = {7: ["a-0", "a-1"]}  # an add the stuck replica never answered: both its prompts move together
    unstarted = {
        "a-0": ((None, [1]), params, 0), "a-1": ((None, [2]), params, 0),
        "b-0": ((None, [3]), params, 0),  # answered, no output yet: moves alone
        "d-0": ((None, [4]), params, 1),  # moved once already: fails here
    }  # "c-0" streamed tokens: fails
    lost = _take_lost(streams, pending, calls, unstarted)  # type: ignore[arg-type]
    by_ids = {tuple(s.request_id for s in item.streams): item for item in lost}
    assert set(by_ids) == {("a-0", "a-1"), ("b-0",)}
    whole: LostRequests = by_ids[("a-0", "a-1")]
    assert whole.answer is unanswered and whole.prompts == [(None, [1]), (None, [2])]
    assert by_ids[("b-0",)].answer is None
    assert set(streams) == {"c-0", "d-0"} and not pending, "what did not move is left to fail"


# --- the real server -------------------------------------------------------------------


def replica_figure(m: dict[str, float], name: str, replica: int) -> float:
    return m.get(f'pagedllm:replica_{name}{{"replica": "{replica}"}}', 0.0)


def replica_pids(log: Path) -> dict[int, int]:
    """The latest pid of each replica, from the server log's start lines."""
    return {int(i): int(p) for i, p in re.findall(r"data-parallel replica (\d+) started \(pid (\d+)", log.read_text())}


def wait_for(check: object, timeout: float, step: float = 0.1) -> float:
    """Seconds until ``check()`` is true; fails after ``timeout``."""
    start = time.monotonic()
    while not check():  # type: ignore[operator]
        assert time.monotonic() - start < timeout, "timed out"
        time.sleep(step)
    return time.monotonic() - start


@pytest.fixture(scope="module")
def dp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    log = tmp_path_factory.mktemp("dp_heartbeat") / "dp.log"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = launch_server(["--port", str(port), *ENGINE, "--data-parallel-size", "2",
                          "--replica-heartbeat-timeout", str(TIMEOUT_S)], log)
    frozen: list[int] = []
    try:
        wait_healthy(url, proc, log)
        yield {"url": url, "proc": proc, "log": log, "frozen": frozen,
               "client": OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)}
    finally:
        for pid in frozen:  # never leave a stopped process behind, whatever failed
            if psutil.pid_exists(pid):
                os.kill(pid, signal.SIGKILL)
        stop_server(proc)


def _stream(client: OpenAI, i: int, outcome: list, first: threading.Event) -> None:
    try:
        stream = client.completions.create(model=MODEL, prompt=f"Story {i}: once upon a time", max_tokens=120,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True})
        text = ""
        for c in stream:
            first.set()
            text += c.choices[0].text if c.choices else ""
        outcome[i] = "done" if text else "empty"
    except openai.APIError as e:
        outcome[i] = f"error: {e}"
    finally:
        first.set()


def _start_streams(client: OpenAI, num: int) -> tuple[list[threading.Thread], list]:
    outcome: list[str | None] = [None] * num
    firsts = [threading.Event() for _ in range(num)]
    threads = [threading.Thread(target=_stream, args=(client, i, outcome, firsts[i])) for i in range(num)]
    for t in threads:
        t.start()
    for e in firsts:
        assert e.wait(120)
    return threads, outcome


def test_a_stopped_replica_is_reported_its_requests_fail_or_move_and_it_is_replaced(dp: dict) -> None:
    url, client, log = dp["url"], dp["client"], dp["log"]
    assert httpx.get(f"{url}/health", timeout=10).json()["status"] == "ok"
    threads, outcome = _start_streams(client, 4)
    m = metrics(url)
    loads = [replica_figure(m, "requests_in_flight", r) for r in (0, 1)]
    assert all(n > 0 for n in loads), loads
    # the less loaded one: of the next two requests at least one is routed to it (least load, then turns)
    victim = 0 if loads[0] <= loads[1] else 1
    survivor = 1 - victim
    on_victim = int(loads[victim])
    old_pid = replica_pids(log)[victim]
    os.kill(old_pid, signal.SIGSTOP)
    dp["frozen"].append(old_pid)
    stopped_at = time.monotonic()
    answers: list[str | None] = [None, None]

    def window(i: int) -> None:  # sent while the stopped replica still counts as up
        answers[i] = client.completions.create(model=MODEL, prompt=f"Window {i}: hello", max_tokens=3,
                                               temperature=0).choices[0].text

    late = [threading.Thread(target=window, args=(i,)) for i in range(2)]
    for t in late:
        t.start()
    wait_for(lambda: replica_figure(metrics(url), "up", victim) == 0, TIMEOUT_S + 15)
    detected_after = time.monotonic() - stopped_at
    # heartbeats every 0.75 s: not before the timeout less one beat, and not long after it
    assert TIMEOUT_S - 1 <= detected_after <= TIMEOUT_S + 10, detected_after
    health = httpx.get(f"{url}/health", timeout=10)
    assert health.status_code == 200, "one replica still serves"
    body = health.json()
    assert body["status"] == "degraded" and body["replicas_up"] == 1
    assert body["replicas"][victim]["state"] == "restarting" and body["replicas"][victim]["heartbeat_timeouts"] == 1
    assert "heartbeat timeout" in body["replicas"][victim]["last_failure"]
    assert body["replicas"][survivor]["state"] == "up"
    # new requests go to the survivor meanwhile
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0).choices[0].text
    for t in [*threads, *late]:
        t.join(120)
    assert all(a for a in answers), "requests routed to the stopped replica moved and completed"
    assert f"from stuck replica {victim}" in log.read_text()
    errors = [o for o in outcome if o and o.startswith("error")]
    assert len(errors) == on_victim and outcome.count("done") == 4 - on_victim, outcome
    assert all(f"replica {victim} stopped answering" in e for e in errors), errors
    # replaced: a new process, up again, counted
    wait_for(lambda: replica_figure(metrics(url), "up", victim) == 1, 150, step=0.5)
    m = metrics(url)
    assert replica_figure(m, "restarts_total", victim) == 1
    assert replica_figure(m, "heartbeat_timeouts_total", victim) == 1
    assert replica_figure(m, "heartbeat_timeouts_total", survivor) == 0
    assert replica_pids(log)[victim] != old_pid and not psutil.pid_exists(old_pid)
    assert httpx.get(f"{url}/health", timeout=10).json()["status"] == "ok"
    gen = replica_figure(m, "generation_tokens_total", victim)
    for i in range(4):  # equal loads take turns: some land on the new process
        client.completions.create(model=MODEL, prompt=[4000 + i], max_tokens=2, temperature=0)
    wait_for(lambda: replica_figure(metrics(url), "generation_tokens_total", victim) > gen, 10)
    # no block left held anywhere once all is done
    wait_for(lambda: all(replica_figure(metrics(url), "kv_cache_usage_perc", r) == 0 for r in (0, 1)), 15)


def test_shutdown_after_a_replacement_leaves_no_child(dp: dict) -> None:
    proc = dp["proc"]
    children = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [p.pid for p in alive]
    text = dp["log"].read_text()
    assert "Application shutdown complete" in text
    assert "Traceback" not in text, text[-3000:]
