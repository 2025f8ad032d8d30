"""The server's per-request metrics read streamed delta outputs right."""

from __future__ import annotations

import asyncio

from prometheus_client import generate_latest

from pagedllm.clients.async_engine import _RequestStream
from pagedllm.clients.metrics import ServerMetrics
from pagedllm.outputs import CompletionOutput, RequestOutput


def _out(choices: list[tuple[int, str | None]], finished: bool) -> RequestOutput:
    outputs = [CompletionOutput(index=i, text="x", token_ids=[7], finish_reason=r) for i, r in choices]
    return RequestOutput(request_id="r", prompt="p", prompt_token_ids=[1], outputs=outputs, finished=finished)


def test_a_choice_that_finished_early_still_names_the_finish_reason() -> None:
    # n=2 streamed as deltas: choice 0 stops first and is absent from the last output
    metrics = ServerMetrics("m")
    loop = asyncio.new_event_loop()
    try:
        stream = _RequestStream("r", 0, asyncio.Queue(), loop, owner=None, delta=True)  # type: ignore[arg-type]
        stream.observe(_out([(0, None), (1, None)], False), 1.0, metrics)
        stream.observe(_out([(0, "stop"), (1, None)], False), 2.0, metrics)
        stream.observe(_out([(1, "length")], True), 3.0, metrics)
    finally:
        loop.close()
    text = generate_latest(metrics.registry).decode()
    assert 'pagedllm:request_success_total{finished_reason="stop",model_name="m"} 1.0' in text
    assert 'finished_reason="length"' not in text
