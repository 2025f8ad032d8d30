"""A request that fails inside a data-parallel replica reaches its client with the engine's message once."""

from __future__ import annotations

from multiprocessing import Pipe

from pagedllm.clients.data_parallel.replica import _Outbox, _PipeStream
from pagedllm.clients.data_parallel.replica_client import ReplicaClient, ReplicaEvents
from pagedllm.config import EngineConfig
from pagedllm.engine.protocol import EngineStepError
from pagedllm.loader import bundled_model_path

PREFIX = "the engine failed on this request: "


class _Sink:
    """The server side's stream: keeps what it is handed."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.items: list = []

    def put(self, item: object) -> None:
        self.items.append(item)

    def observe(self, out: object, now: float, metrics: object) -> None:
        pass


def test_a_replica_failure_carries_the_engine_prefix_once() -> None:
    # the replica side: AsyncEngine's engine thread puts the failure on the request's pipe stream
    here, there = Pipe()
    outbox = _Outbox(there)
    _PipeStream("r1", outbox).put(EngineStepError(PREFIX + "ValueError: boom"))
    outbox.flush()
    kind, outputs, failures = here.recv()
    assert kind == "outputs" and outputs == []

    # the server side hands it to the request's stream
    events = ReplicaEvents(on_stats=lambda *a: None, on_up=lambda *a: None,
                           on_unresponsive=lambda *a: None, on_lost=lambda *a: None)
    client = ReplicaClient(0, EngineConfig(model=bundled_model_path()), None, False, None, events)
    sink = _Sink("r1")
    client.streams["r1"] = sink
    client._deliver(outputs, failures)
    (err,) = sink.items
    assert isinstance(err, EngineStepError)
    assert str(err) == PREFIX + "ValueError: boom"
    assert "r1" not in client.streams
