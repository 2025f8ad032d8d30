"""``pagedllm bench memory --html``: both block pools replayed over time in one self-contained page.

The chapter shows contiguous and paged allocation side by side as a
simulation; this page replays the real runs of the memory study. Each run's
frames are (seconds, one character per block, requests running), the block
characters from ``engine.kv_snapshot.fill_levels``: ``.`` free, else the
block's written slots in base 36, so a reserved block that holds nothing is
``0``. The page (``static/memory_report.html``) draws every block as a cell
filled from the bottom as far as it is written: what is reserved but empty
shows as the unfilled part.

Everything is inline (CSS, JS, the data as JSON): the file opens from disk,
without a server or a network.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

# at most this many frames per run in the page: enough for a smooth replay, a few hundred kB in all
MAX_FRAMES = 600
_DATA_MARK = "/*REPORT_DATA*/null"


def downsample(frames: list[tuple[float, str, int]], limit: int = MAX_FRAMES) -> list[tuple[float, str, int]]:
    """At most ``limit`` frames, evenly spread by index, always keeping the first and the last."""
    if limit < 2:
        raise ValueError(f"limit must be >= 2, got {limit}")
    if len(frames) <= limit:
        return list(frames)
    step = (len(frames) - 1) / (limit - 1)
    return [frames[round(i * step)] for i in range(limit)]


def report_data(
    replays: dict[str, tuple[list[tuple[float, str, int]], dict[str, Any]]], block_size: int, num_blocks: int
) -> dict[str, Any]:
    """The page's data: per run its label, summary and (downsampled) frames as parallel lists."""
    runs = []
    for label, (frames, summary) in replays.items():
        if any(len(fill) != num_blocks for _, fill, _ in frames):
            raise ValueError(f"{label}: every frame must have one character per block ({num_blocks})")
        kept = downsample(frames)
        runs.append({
            "label": label,
            "summary": summary,
            "t": [round(t, 3) for t, _, _ in kept],
            "fill": [fill for _, fill, _ in kept],
            "running": [r for _, _, r in kept],
        })
    return {"block_size": block_size, "num_blocks": num_blocks, "runs": runs}


def render_report(data: dict[str, Any]) -> str:
    """The page's HTML with ``data`` inlined (``</`` escaped, so no string can close the script)."""
    template = resources.files("pagedllm.bench").joinpath("static/memory_report.html").read_text()
    if _DATA_MARK not in template:
        raise RuntimeError("the report template has no data placeholder")
    payload = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    return template.replace(_DATA_MARK, payload)


def write_report(
    path: str, replays: dict[str, tuple[list[tuple[float, str, int]], dict[str, Any]]], block_size: int,
    num_blocks: int,
) -> None:
    """Write the replay page of ``replays`` (label -> (frames, summary)) to ``path``."""
    html = render_report(report_data(replays, block_size, num_blocks))
    with open(path, "w", encoding="utf-8") as f:
        f.write(html)
