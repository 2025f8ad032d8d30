"""The /kv page of a windowed and of a hybrid model: every KV cache group, the state slots, the snapshots.

The JSON comes from real engines (a tiny random Gemma 3 with a window of 8 tokens, a tiny random LFM2),
stepped by hand and published by ``KVSnapshotPublisher``, so its values are exact; they are derived by
hand from the window, the prompt lengths and the rules of docs/design/kv-cache-groups.md and
docs/hybrid-models.md. Then the page in headless Chromium draws one grid per group (``browser``).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import httpx
import pytest
from browser_helpers import chromium_driver
from conftest import TINY_WINDOW
from server_helpers import serve_in_thread, wait_for

from pagedllm import LLM, SamplingParams
from pagedllm.clients.kv_publisher import KVSnapshotPublisher
from pagedllm.entrypoints.openai.kv_page import KVState

pytestmark = pytest.mark.slow  # real engines and servers

BS = 4
ENGINE = dict(block_size=BS, max_model_len=256, num_threads=1, kv_cache_dtype="float32", max_num_seqs=2,
              itl_target_ms=None)


def published(llm: LLM) -> dict:
    """What /kv/state would answer now, checked against its documented model."""
    snap = json.loads(KVSnapshotPublisher().publish(llm.llm_engine).body)
    KVState.model_validate(snap)
    return snap


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def test_a_window_model_publishes_each_group_its_blocks_holes_and_layers(window_dirs: dict[str, str]) -> None:
    llm = LLM(window_dirs["gemma3"], num_kv_blocks=256, **ENGINE)
    engine = llm.llm_engine
    engine.add_request("w", {"prompt_token_ids": list(range(100, 118))}, greedy(8))
    engine.step()  # the 18-token prompt: 5 blocks in each group
    snap = published(llm)
    # Gemma 3's pattern (sliding, full, sliding, sliding, full): the 2 full layers set 2 rows a block,
    # the 3 windowed ones fill 2 groups, the last with one padded row
    assert [(g["group"], g["kind"], g["window"], g["layers"]) for g in snap["kv_groups"]] == [
        (0, "full", None, [1, 4]), (1, "window", TINY_WINDOW, [0, 2]), (2, "window", TINY_WINDOW, [3])]
    assert [g["used_blocks"] for g in snap["kv_groups"]] == [5, 5, 5]
    engine.step()  # decoding token 18 reads keys 11..18: blocks 0, 1 (keys 0..7) leave both windows
    snap = published(llm)
    [seq] = snap["requests"][0]["sequences"]
    tables = [seq["block_table"], *seq["group_tables"]]
    assert [t.count(-1) for t in tables] == [0, 2, 2] and [len(t) for t in tables] == [5, 5, 5]
    # the 4 full prompt blocks were published: the 2 given back per window group stay cached for a prefix hit
    assert [(g["used_blocks"], g["cached_blocks"], g["hole_entries"], g["released_blocks"])
            for g in snap["kv_groups"]] == [(5, 0, 0, 0), (3, 2, 2, 2), (3, 2, 2, 2)]
    for g, table in enumerate(tables):  # each block of a table is its group's in block_groups
        assert all(snap["block_groups"][b] == g for b in table if b != -1)
    assert snap["counters"]["window_released_blocks"] == 4 and snap["state"] is None


def test_a_hybrid_model_publishes_its_state_slots_and_snapshots(lfm2_dir: str) -> None:
    llm = LLM(lfm2_dir, num_kv_blocks=256, **ENGINE)
    engine = llm.llm_engine
    runner = engine.model_runner
    # three conv layers of 3 taps keep the last 2 inputs of 64 channels, float32
    assert runner.state_bytes_per_slot == 3 * 2 * 64 * 4
    prompt = list(range(200, 210))
    engine.add_request("a", {"prompt_token_ids": prompt}, greedy(20))
    engine.step()  # a's chunk stops at its snapshot point, 8 tokens: its state there is kept
    engine.add_request("b", {"prompt_token_ids": prompt[:8] + [7, 8, 9]}, greedy(20))
    engine.step()  # b hits a's 8 tokens and starts from the snapshot
    snap = published(llm)
    st = snap["state"]
    seqs = {r["id"]: r["sequences"][0] for r in snap["requests"]}
    assert seqs["b"]["num_cached_tokens"] == 8
    n = runner.num_state_slots
    assert (st["num_slots"], st["used_slots"], st["free_slots"]) == (n, 2, n - 2)
    assert (seqs["a"]["state_slot"], seqs["b"]["state_slot"]) == (0, 1)
    assert st["slot_holders"] == [{"slot": 0, "seq_id": seqs["a"]["seq_id"], "request_id": "a"},
                                  {"slot": 1, "seq_id": seqs["b"]["seq_id"], "request_id": "b"}]
    # one snapshot (a's state after 8 tokens) in the first snapshot slot, after the n running ones
    assert (st["snapshots"], st["snapshot_bytes"], st["snapshot_lru"]) == (1, 3 * 2 * 64 * 4, [n])
    assert st["num_snapshot_slots"] == runner.num_snapshot_slots
    assert st["num_checkpoint_slots"] == runner.num_checkpoint_slots == 0  # no speculative decoding
    # one group (the attention layer), full; a: 3 blocks, b: 3, the first 2 of them a's
    assert [(g["kind"], g["layers"], g["used_blocks"], g["shared_blocks"]) for g in snap["kv_groups"]] == [
        ("full", [2], 4, 2)]


# --- the page in a real browser ------------------------------------------------------------


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    yield from chromium_driver()


def served(model_dir: str) -> Iterator[str]:
    llm = LLM(model_dir, num_kv_blocks=256, **ENGINE)
    with serve_in_thread(llm.llm_engine, model_name="tiny") as url:
        yield url


@pytest.fixture(scope="module")
def window_server(window_dirs: dict[str, str]) -> Iterator[str]:
    yield from served(window_dirs["gemma3"])


@pytest.fixture(scope="module")
def hybrid_server(lfm2_dir: str) -> Iterator[str]:
    yield from served(lfm2_dir)


def background_request(url: str, prompt: str, max_tokens: int) -> threading.Thread:
    def one() -> None:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        httpx.post(f"{url}/v1/completions", json=body, timeout=120).raise_for_status()

    t = threading.Thread(target=one, daemon=True)
    t.start()
    return t


# the page's per-group grids as drawn, with the snapshot they show (read in one script: no redraw between)
GROUPS_READ = """
const groups = [...document.querySelectorAll('#groups .group')].map((d) => ({
  group: Number(d.dataset.group), title: d.querySelector('h3').textContent,
  blocks: [...d.querySelectorAll('.group-grid .cell')].map((c) => Number(c.dataset.block)),
  marked: [...d.querySelectorAll('.group-grid .cell.hl')].sort((a, b) => a.dataset.logical - b.dataset.logical)
    .map((c) => Number(c.dataset.block)),
  table: d.querySelector('.gtable').textContent}));
return {id: Number(document.body.dataset.snapshot || 0), state: state, groups: groups,
        stateShown: !document.getElementById('state-section').hidden,
        stateText: document.getElementById('state-list').textContent};
"""


def test_page_draws_one_grid_per_group_with_the_selected_tables(window_server: str, browser: object) -> None:
    drv = browser
    drv.get(f"{window_server}/kv")
    worker = background_request(window_server, "the KV cache " * 12, 150)

    def drawn_with_holes() -> dict | None:
        dom = drv.execute_script(GROUPS_READ)
        snap = dom["state"]
        if not snap or not snap["requests"] or not any(g["hole_entries"] for g in snap["kv_groups"]):
            return None
        # pin the request's sequence once (a second click would unpin it), then read the page in the same script
        dom = drv.execute_script("if (!pinned) document.querySelector(`.seq[data-request='${arguments[0]}']`)"
                                 ".click();" + GROUPS_READ, snap["requests"][0]["id"])
        return dom if dom["id"] == snap["snapshot_id"] and dom["state"]["requests"] else None

    dom = wait_for(drawn_with_holes, 60, "a snapshot with window holes drawn and a sequence selected")
    snap = dom["state"]
    assert [g["group"] for g in dom["groups"]] == [0, 1, 2]
    assert dom["groups"][1]["title"].startswith(f"group 1 · window {TINY_WINDOW} · layers 0 2")
    seq = snap["requests"][0]["sequences"][0]
    tables = [seq["block_table"], *seq["group_tables"]]
    for g, drawn in enumerate(dom["groups"]):
        # a group's grid: exactly the blocks block_groups gives it; the sequence's own outlined in logical order
        assert drawn["blocks"] == [b for b, owner in enumerate(snap["block_groups"]) if owner == g]
        assert drawn["marked"] == [b for b in tables[g] if b != -1]
        assert drawn["table"] == "table [" + ", ".join("-" if b == -1 else str(b) for b in tables[g]) + "]"
    assert tables[1][0] == -1 and "-" in dom["groups"][1]["table"]
    assert not dom["stateShown"]  # no state layers
    worker.join(120)


def test_page_lists_the_state_slots_of_a_hybrid_model(hybrid_server: str, browser: object) -> None:
    drv = browser
    drv.get(f"{hybrid_server}/kv")
    worker = background_request(hybrid_server, "the state slots " * 6, 150)

    def drawn_running() -> dict | None:
        dom = drv.execute_script(GROUPS_READ)
        snap = dom["state"]
        return dom if snap and snap["state"]["used_slots"] == 1 and dom["id"] == snap["snapshot_id"] else None

    dom = wait_for(drawn_running, 60, "a running hybrid sequence drawn")
    st, seq = dom["state"]["state"], dom["state"]["requests"][0]["sequences"][0]
    assert dom["stateShown"] and len(dom["groups"]) == 1
    assert dom["stateText"].startswith(f"slots 1 used, {st['num_slots'] - 1} free of {st['num_slots']}")
    assert f"slot 0 -> seq {seq['seq_id']} ({dom['state']['requests'][0]['id']})" in dom["stateText"]
    assert f"snapshots {st['snapshots']} of {st['num_snapshot_slots']} slots" in dom["stateText"]
    worker.join(120)
