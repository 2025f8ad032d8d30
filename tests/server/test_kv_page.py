"""The live KV-cache page on a real server: ``/kv/state``, ``/kv/events``, and ``/kv`` in headless Chromium.

Servers run in-process (uvicorn on a thread, like test_server_openapi.py)
around the tiny random-weight Llama, with 40 blocks of 8 tokens, so a few
requests fill a visible part of the pool. The browser tests need Debian's
``chromium`` and ``chromium-driver`` (``make setup`` installs them with
apt-get when run as root) and selenium (the test extra); they skip, saying
so, where those are missing.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from browser_helpers import chromium_driver
from server_helpers import metrics, serve_in_thread, wait_for, wait_kv_free

pytestmark = pytest.mark.slow  # real servers or subprocesses: outside the fast tier

NUM_BLOCKS, BLOCK_SIZE = 40, 8
API_KEY = "sk-kv-test"


@contextlib.contextmanager
def kv_server(model_dir: str, api_key: str | None = None, kv_page: bool = True) -> Iterator[str]:
    """A real server on a thread around a small pool of ``model_dir``; yields its URL."""
    from pagedllm import LLM

    llm = LLM(model_dir, num_kv_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_model_len=256, num_threads=1)
    with serve_in_thread(llm.llm_engine, model_name="tiny", api_key=api_key, kv_page=kv_page) as url:
        yield url


@pytest.fixture(scope="module")
def open_server(tiny_model_dirs: dict[str, str]) -> Iterator[str]:
    with kv_server(tiny_model_dirs["llama"]) as url:
        yield url


@pytest.fixture(scope="module")
def keyed_server(tiny_model_dirs: dict[str, str]) -> Iterator[str]:
    with kv_server(tiny_model_dirs["llama"], api_key=API_KEY) as url:
        yield url


def state(url: str) -> dict:
    resp = httpx.get(f"{url}/kv/state", timeout=10)
    assert resp.status_code == 200, resp.text
    return resp.json()


def run_requests(url: str, headers: dict | None = None, n: int = 3, num_requests: int = 3,
                 max_tokens: int = 120) -> threading.Thread:
    """Completions of n samples each on a background thread (they share their prompt's blocks)."""

    def one(i: int) -> None:
        body = {"model": "tiny", "prompt": f"request {i} " + "the KV cache " * 6, "max_tokens": max_tokens,
                "n": n, "temperature": 1.0, "ignore_eos": True, "seed": i}
        httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120).raise_for_status()

    def all_of_them() -> None:
        workers = [threading.Thread(target=one, args=(i,)) for i in range(num_requests)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()

    t = threading.Thread(target=all_of_them, daemon=True)
    t.start()
    return t


# --- the JSON and the event stream ---------------------------------------------------------


def test_state_is_the_documented_model_and_matches_an_idle_pool(open_server: str) -> None:
    from pagedllm.entrypoints.openai.kv_page import KVState

    snap = KVState.model_validate(state(open_server))
    assert snap.num_blocks == NUM_BLOCKS and snap.block_size == BLOCK_SIZE
    assert len(snap.block_states) == NUM_BLOCKS == len(snap.ref_counts)
    assert set(snap.block_states) <= {"f", "c"} and snap.counters.used_blocks == 0 and snap.requests == []
    # the pool's bytes: reserved whole, resident only where a cached prefix is kept; /metrics says the same
    mem, figures = snap.memory, metrics(open_server)
    assert mem.bytes_per_block > 0 and mem.reserved_bytes >= NUM_BLOCKS * mem.bytes_per_block
    assert mem.resident_blocks == snap.counters.cached_blocks
    assert mem.resident_bytes == mem.resident_blocks * mem.bytes_per_block
    assert figures["pagedllm:kv_cache_reserved_bytes"] == mem.reserved_bytes
    assert figures["pagedllm:kv_cache_resident_bytes"] == mem.resident_bytes
    spec = httpx.get(f"{open_server}/openapi.json").json()
    ok = spec["paths"]["/kv/state"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert ok == {"$ref": "#/components/schemas/KVState"}
    assert "/kv/events" not in spec["paths"]  # endless: kept out of schema-driven clients' way


def read_events(url: str, until: Callable[[list[dict]], bool], timeout: float = 60) -> list[dict]:
    events: list[dict] = []
    with httpx.stream("GET", f"{url}/kv/events", timeout=timeout) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        deadline = time.monotonic() + timeout
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: "):]))
            # asked on pings too: the last snapshot may come before the condition's other part holds (the
            # idle pool's snapshot before the requests' client thread has returned), and none follows it
            if events and until(events):
                return events
            if time.monotonic() > deadline:
                break
    raise AssertionError(f"the stream ended without the expected snapshots: {[e['snapshot_id'] for e in events]}")


def test_events_follow_the_pool_while_requests_run(open_server: str) -> None:
    worker = run_requests(open_server)

    def busy_then_idle(events: list[dict]) -> bool:
        busy = [i for i, e in enumerate(events) if e["counters"]["used_blocks"] > 0]
        # the idle snapshot: no request queued. A snapshot between two requests (one done, the next still
        # waiting) also holds no block, but its pages are given back only once the engine has no request
        last = events[-1]
        return bool(busy) and not worker.is_alive() and last["requests"] == [] and last["counters"]["used_blocks"] == 0

    events = read_events(open_server, busy_then_idle)
    worker.join(60)
    ids = [e["snapshot_id"] for e in events]
    assert ids == sorted(set(ids))  # each event a newer snapshot
    busy = [e for e in events if e["counters"]["used_blocks"] > 0]
    # three samples share their prompt's blocks: shared blocks appear with ref count 3
    assert any(e["counters"]["shared_blocks"] > 0 for e in busy)
    for e in busy:
        held = {b for r in e["requests"] for s in r["sequences"] for b in s["block_table"]}
        assert held == {b for b, st in enumerate(e["block_states"]) if st in "hs"}
        for b, st in enumerate(e["block_states"]):
            assert (st == "s") == (e["ref_counts"][b] > 1)
        # a held block has been written: resident (and so may be a block freed while others still run)
        assert e["memory"]["resident_blocks"] >= e["counters"]["used_blocks"]
    # drained: the pages of blocks that hold nothing went back, the cached prefixes stay
    idle = events[-1]
    assert idle["memory"]["resident_blocks"] == idle["counters"]["cached_blocks"] > 0
    assert idle["memory"]["resident_bytes"] == idle["memory"]["resident_blocks"] * idle["memory"]["bytes_per_block"]
    # rate-limited while the engine works: a few a second at most
    times = [e["time"] for e in busy]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert all(g >= 0.2 for g in gaps), gaps
    assert wait_kv_free(open_server) == 0


def test_kv_routes_are_open_with_an_api_key_like_metrics(keyed_server: str) -> None:
    assert httpx.get(f"{keyed_server}/v1/models").status_code == 401
    assert httpx.get(f"{keyed_server}/metrics").status_code == 200
    assert httpx.get(f"{keyed_server}/kv").status_code == 200
    assert state(keyed_server)["num_blocks"] == NUM_BLOCKS


def test_no_kv_page_removes_the_routes(tiny_model_dirs: dict[str, str]) -> None:
    from pagedllm.entrypoints.cli import build_parser

    assert build_parser().parse_args(["serve", "--no-kv-page"]).kv_page is False
    with kv_server(tiny_model_dirs["llama"], kv_page=False) as url:
        for route in ("/kv", "/kv/state", "/kv/events"):
            assert httpx.get(f"{url}{route}", timeout=5).status_code == 404
        assert httpx.get(f"{url}/metrics").status_code == 200


# --- the page in a real browser ------------------------------------------------------------


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    yield from chromium_driver()


DOM_READ = r"""
const cells = [...document.querySelectorAll('#grid .cell')];
const count = (s) => cells.filter((c) => c.classList.contains('st-' + s)).length;
return {id: Number(document.body.dataset.snapshot || 0), n: cells.length,
        f: count('f'), c: count('c'), h: count('h'), s: count('s'),
        used: Number(document.getElementById('c-used').textContent),
        resident: Number(document.getElementById('c-resident').dataset.bytes),
        reserved: Number(document.getElementById('c-reserved').dataset.bytes),
        memory: document.getElementById('c-resident').parentElement.textContent.replace(/\s+/g, ' ').trim()};
"""


# the pinned sequence as the page holds it, and the cells it outlines, ordered by their logical number
SELECTION_READ = """
const seq = findSeq(pinned);
const marked = [...document.querySelectorAll('#grid .cell.hl')]
  .sort((a, b) => a.dataset.logical - b.dataset.logical).map((c) => Number(c.dataset.block));
return {id: state.snapshot_id, table: seq ? seq.block_table : [], marked: marked,
        slot: document.getElementById('slot-map').textContent};
"""


def dom_matches_state(drv: object, url: str, busy: bool) -> dict | None:
    """Read the DOM and /kv/state; when they show the same snapshot, check the cells against it."""
    dom = drv.execute_script(DOM_READ)
    snap = state(url)
    if dom["id"] != snap["snapshot_id"] or (busy and snap["counters"]["used_blocks"] == 0):
        return None
    states = snap["block_states"]
    assert dom["n"] == snap["num_blocks"]
    assert {k: dom[k] for k in "fchs"} == {k: states.count(k) for k in "fchs"}
    assert dom["used"] == snap["counters"]["used_blocks"]
    assert (dom["resident"], dom["reserved"]) == (snap["memory"]["resident_bytes"], snap["memory"]["reserved_bytes"])
    return snap


def test_page_draws_the_live_pool(open_server: str, browser: object, tmp_path: Path) -> None:
    drv = browser
    drv.get(f"{open_server}/kv")
    wait_for(lambda: drv.execute_script(DOM_READ)["n"] == NUM_BLOCKS, 30, "the grid")
    first_id = drv.execute_script(DOM_READ)["id"]
    worker = run_requests(open_server, max_tokens=150)
    snap = wait_for(lambda: dom_matches_state(drv, open_server, busy=True), 60, "a busy snapshot drawn")
    assert snap["snapshot_id"] > first_id
    # click the first running sequence: its blocks are outlined and numbered in logical order;
    # then ask for token 9's slot. One script, so no snapshot is drawn in between.
    seq = next(s for r in snap["requests"] for s in r["sequences"] if len(s["block_table"]) >= 2)
    rid = next(r["id"] for r in snap["requests"] if seq in r["sequences"])
    shown = drv.execute_script(
        "document.querySelector(`.seq[data-request='${arguments[0]}'][data-index='${arguments[1]}']`).click();"
        "const pos = document.getElementById('slot-pos'); pos.value = '9';"
        "pos.dispatchEvent(new Event('input'));" + SELECTION_READ,
        rid, seq["index"],
    )
    if shown["id"] == snap["snapshot_id"]:
        assert shown["table"] == seq["block_table"]
    assert shown["marked"] == shown["table"]
    block = shown["table"][1]  # token 9: logical block 1, offset 1
    assert "token 9 -> logical block 1, offset 1" in shown["slot"]
    assert f"slot {block} x {BLOCK_SIZE} + 1 = {block * BLOCK_SIZE + 1}" in shown["slot"]
    # the choice survives the next snapshots: the sequence's blocks (copied, preempted...) stay outlined
    wait_for(lambda: drv.execute_script(DOM_READ)["id"] > shown["id"], 30, "a later snapshot drawn")
    later = drv.execute_script(SELECTION_READ)
    assert later["marked"] == later["table"]
    drv.save_screenshot(str(tmp_path / "kv-busy.png"))
    assert (tmp_path / "kv-busy.png").stat().st_size > 10_000
    worker.join(120)
    snap = wait_for(lambda: dom_matches_state(drv, open_server, busy=False), 30, "the idle pool drawn")
    assert snap["counters"]["used_blocks"] == 0 and snap["counters"]["cached_blocks"] > 0
    # the memory counter, in words: resident (blocks) of reserved, a block's bytes
    memory = drv.execute_script(DOM_READ)["memory"]
    assert re.fullmatch(rf"memory [0-9.]+ [kMG]?B resident \({snap['memory']['resident_blocks']} blocks\) of "
                        r"[0-9.]+ [kMG]?B reserved, [0-9.]+ [kMG]?B a block", memory), memory


def test_page_works_on_a_keyed_server(keyed_server: str, browser: object, tmp_path: Path) -> None:
    drv = browser
    drv.get(f"{keyed_server}/kv")  # a browser sends no key: the page is open, as /metrics is
    wait_for(lambda: drv.execute_script(DOM_READ)["n"] == NUM_BLOCKS, 30, "the grid")
    worker = run_requests(keyed_server, headers={"Authorization": f"Bearer {API_KEY}"}, num_requests=2)
    wait_for(lambda: dom_matches_state(drv, keyed_server, busy=True), 60, "a busy snapshot drawn")
    assert drv.find_elements("css selector", "#requests .req")
    drv.save_screenshot(str(tmp_path / "kv-keyed.png"))
    worker.join(120)
