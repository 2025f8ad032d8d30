"""KVSnapshotPublisher: rate-limited while the engine works, one last snapshot when it goes idle."""

from __future__ import annotations

import json

import pytest

from pagedllm.clients import kv_publisher
from pagedllm.clients.kv_publisher import KVSnapshotPublisher
from pagedllm.engine.block_manager import BlockManager
from pagedllm.engine.scheduler import Scheduler
from pagedllm.engine.sequence import Sequence, SequenceStatus


class FakeRunner:
    """What the publisher reads of a ModelRunner: a block's bytes and the pool's."""

    kv_bytes_per_block = 1000
    kv_cache_bytes = 9 * 1000  # 8 blocks and the runner's padding block


class FakeEngine:
    """What the publisher reads of an LLMEngine: its scheduler, its runner's bytes and whether work is left."""

    def __init__(self) -> None:
        self.scheduler = Scheduler(BlockManager(8, 4), max_num_seqs=4, max_num_batched_tokens=64)
        self.model_runner = FakeRunner()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [100.0]
    monkeypatch.setattr(kv_publisher.time, "monotonic", lambda: now[0])
    return now


def test_rate_limited_while_busy_and_published_once_when_idle(clock: list[float]) -> None:
    engine, pub = FakeEngine(), KVSnapshotPublisher(min_interval=0.25)
    seq = Sequence([1, 2, 3, 4, 5], 4, request_id="r")
    engine.scheduler.add(seq)
    assert pub.maybe_publish(engine)  # the first call publishes
    assert pub.latest is not None and pub.latest.snapshot_id == 1
    engine.scheduler.update(engine.scheduler.schedule())
    clock[0] += 0.1
    assert not pub.maybe_publish(engine)  # within the interval: nothing built
    assert json.loads(pub.latest.body)["counters"]["used_blocks"] == 0
    clock[0] += 0.2
    assert pub.maybe_publish(engine)
    body = json.loads(pub.latest.body)
    assert body["snapshot_id"] == 2 and body["requests"][0]["sequences"][0]["block_table"] == [0, 1]
    # the runner's bytes: two blocks written of a pool reserved whole
    assert body["memory"] == {"bytes_per_block": 1000, "reserved_bytes": 9000, "resident_blocks": 2,
                              "resident_bytes": 2000}
    # the request ends 10 ms later: the idle pool is published at once, past the rate limit
    engine.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
    clock[0] += 0.01
    assert pub.maybe_publish(engine)
    assert json.loads(pub.latest.body)["counters"]["used_blocks"] == 0
    # idle and nothing changed: no more snapshots, however long it waits
    clock[0] += 10
    assert not pub.maybe_publish(engine)
    assert pub.num_published == 3


def test_negative_interval_is_refused() -> None:
    with pytest.raises(ValueError):
        KVSnapshotPublisher(min_interval=-1)


def test_a_failing_snapshot_stops_publishing_not_the_engine(clock: list[float], monkeypatch: pytest.MonkeyPatch) -> None:
    engine, pub = FakeEngine(), KVSnapshotPublisher()
    assert pub.maybe_publish(engine)

    def broken(scheduler: Scheduler, *figures: int) -> dict:
        raise KeyError("a bug")

    monkeypatch.setattr(kv_publisher, "build_kv_snapshot", broken)
    engine.scheduler.add(Sequence([1, 2], 4))
    clock[0] += 1
    assert not pub.maybe_publish(engine)  # no exception reaches the engine loop
    assert pub.failed and pub.latest.snapshot_id == 1  # the last good snapshot stays readable
    clock[0] += 1
    assert not pub.maybe_publish(engine)
