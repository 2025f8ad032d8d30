"""``bench memory --html``: per-block fill levels, the report's data, and the page in headless Chromium.

Fill levels are worked out by hand: a 5-token prompt in 4-slot blocks fills
block 0 and one slot of block 1; the contiguous allocator also reserves the
prompt's maximum length (12 tokens: a third, empty block).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from browser_helpers import chromium_driver

from pagedllm.bench.memory_report import downsample, render_report, report_data, write_report
from pagedllm.engine.block_manager import BlockManager
from pagedllm.engine.contiguous_allocator import ContiguousAllocator
from pagedllm.engine.kv_snapshot import fill_levels
from pagedllm.engine.sequence import Sequence


def test_fill_levels_paged_and_contiguous() -> None:
    paged, contiguous = BlockManager(6, 4), ContiguousAllocator(6, 4)
    a, b = Sequence(list(range(5)), 4), Sequence(list(range(5)), 4)
    b.reserve_len = 12
    assert paged.allocate(a) and contiguous.allocate(b)
    assert (a.block_table, b.block_table) == ([0, 1], [0, 1, 2])
    assert fill_levels(paged.ref_counts, 4, [a]) == "00...."  # held, nothing computed yet
    a.num_computed_tokens = b.num_computed_tokens = 5
    assert fill_levels(paged.ref_counts, 4, [a]) == "41...."
    assert fill_levels(contiguous.ref_counts, 4, [b]) == "410..."
    # 16-slot blocks go past one decimal digit: base 36
    big = BlockManager(2, 16)
    c = Sequence(list(range(30)), 16)
    assert big.allocate(c)
    c.num_computed_tokens = 30
    assert fill_levels(big.ref_counts, 16, [c]) == "ge"
    with pytest.raises(ValueError):
        fill_levels([0], 36, [])


def test_downsample_keeps_the_ends_and_the_limit() -> None:
    frames = [(float(i), ".", 0) for i in range(1001)]
    kept = downsample(frames, 11)
    assert [t for t, _, _ in kept] == [0.0, 100.0, 200.0, 300.0, 400.0, 500.0, 600.0, 700.0, 800.0, 900.0, 1000.0]
    assert downsample(frames[:5], 11) == frames[:5]


def embedded(html: str) -> dict:
    m = re.search(r'<script id="report-data" type="application/json">(.*?)</script>', html, re.S)
    assert m is not None
    return json.loads(m.group(1))


def test_report_is_self_contained_and_escapes_its_data() -> None:
    frames = [(0.0, "4...", 1), (0.5, "44..", 1), (1.0, "....", 0)]
    summary = {"waste_fraction": 0.1, "label": "</script><script>alert(1)</script>"}
    html = render_report(report_data({"paged": (frames, summary)}, 4, 4))
    assert "</script><script>alert" not in html
    assert not re.search(r"(src|href)=\"?(https?:)?//", html)  # nothing fetched
    data = embedded(html)
    assert data["runs"][0]["fill"] == ["4...", "44..", "...."] and data["runs"][0]["summary"] == summary
    with pytest.raises(ValueError):
        report_data({"bad": ([(0.0, "4.", 1)], {})}, 4, 4)


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    yield from chromium_driver()


SUMMARY = {"waste_fraction": 0.5, "peak_running": 2, "mean_running": 1.5, "num_preemptions": 0, "num_steps": 3,
           "output_tokens_per_s": 10.0, "elapsed_s": 2.0}


def test_report_replays_in_a_browser(browser: object, tmp_path: Path) -> None:
    contiguous = [(0.0, "00000000", 1), (1.0, "40004000", 2), (2.0, "........", 0)]
    paged = [(0.0, "0.......", 1), (0.5, "4241....", 2), (1.0, "........", 0)]
    path = tmp_path / "report.html"
    write_report(str(path), {"contiguous": (contiguous, SUMMARY), "paged": (paged, SUMMARY)}, 4, 8)
    drv = browser
    drv.get(path.as_uri())
    read = (
        "return [...document.querySelectorAll('.run')].map(r => ({title: r.querySelector('h2').textContent,"
        " cells: r.querySelectorAll('.cell').length, now: r.querySelector('.now').textContent,"
        " frame: Number(r.querySelector('.now').dataset.frame)}));"
    )
    runs = drv.execute_script(read)
    assert [r["title"] for r in runs] == ["contiguous", "paged"] and [r["cells"] for r in runs] == [8, 8]
    assert [r["frame"] for r in runs] == [0, 0]
    # scrub to 1.2 s (60% of the 2 s replay): contiguous shows its 1.0 s frame, paged its last (all free)
    drv.execute_script("const s = document.getElementById('scrub'); s.value = 600; s.dispatchEvent(new Event('input'));")
    runs = drv.execute_script(read)
    assert [r["frame"] for r in runs] == [1, 2]
    assert "2 requests running; slots 8 written, 24 reserved but empty, 0 free" in runs[0]["now"]
    assert "0 requests running; slots 0 written, 0 reserved but empty, 32 free" in runs[1]["now"]
    drv.save_screenshot(str(tmp_path / "report.png"))
