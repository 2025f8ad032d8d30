"""StepGraph: a recorded function replayed on static buffers equals the function, or is refused."""

from __future__ import annotations

import pytest
import torch

from pagedllm.runner.step_graph import CaptureError, StepGraph

WEIGHT = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))  # owned: the graph reads it as it is
STATE = torch.zeros(3, 6)  # owned and written in place, as a KV cache is


def _layered(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Views, in-place ops, an op with two results, an empty buffer and enough layers for buffers to be shared."""
    h = x @ WEIGHT.t()  # [rows, 6]
    for _ in range(4):
        gate, up = h.view(-1, 2, 3).unbind(1)  # views
        h = torch.cat([torch.sigmoid(gate) * up, up], dim=1)  # new tensors
        h.add_(1.0)  # in place
        values, _ = h.topk(2, dim=1)  # two results
        out = torch.empty_like(h)
        torch.mul(h, values[:, :1], out=out)  # writes the empty buffer
        h = out
    STATE.index_copy_(0, index, h)  # written into owned memory at the step's rows
    return h.sum(dim=1, keepdim=True) + STATE.sum()


def test_replay_equals_the_function_on_new_inputs() -> None:
    gen = torch.Generator().manual_seed(1)
    x0, i0 = torch.randn(2, 4, generator=gen), torch.tensor([0, 2])
    STATE.zero_()
    graph, first = StepGraph.capture(_layered, [x0, i0], [WEIGHT, STATE])
    STATE.zero_()
    torch.testing.assert_close(first, _layered(x0, i0))
    assert len(graph.nodes) < graph.num_recorded  # views and the empty buffer were dropped
    # buffers of layers whose uses do not overlap are shared
    assert graph.num_buffers < sum(1 for n in graph.nodes if n.copy_to is not None or n.copies)
    for seed in (2, 3):
        x, i = torch.randn(2, 4, generator=gen), torch.tensor([seed % 3, (seed + 1) % 3])
        state = STATE.clone()
        got = graph.replay([x, i]).clone()
        replayed_state = STATE.clone()
        STATE.copy_(state)
        want = _layered(x, i)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(replayed_state, STATE)
    assert graph.replay([x0, i0]) is graph.result  # a static buffer, overwritten by every replay


def test_replay_refuses_inputs_of_other_shapes() -> None:
    graph, _ = StepGraph.capture(_layered, [torch.randn(2, 4), torch.tensor([0, 1])], [WEIGHT, STATE])
    with pytest.raises(ValueError, match="other shapes"):
        graph.replay([torch.randn(3, 4), torch.tensor([0, 1, 2])])
    with pytest.raises(ValueError, match="other shapes"):
        graph.replay([torch.randn(2, 4).double(), torch.tensor([0, 1])])


def test_a_tensor_made_outside_the_record_is_refused() -> None:
    foreign = torch.randn(4)  # neither an input, an op's result nor owned

    def uses_foreign(x: torch.Tensor) -> torch.Tensor:
        return x * foreign

    with pytest.raises(CaptureError, match="neither an input"):
        StepGraph.capture(uses_foreign, [torch.randn(2, 4)], [WEIGHT])


def test_reading_a_tensor_into_python_is_refused() -> None:
    def data_dependent(x: torch.Tensor) -> torch.Tensor:
        return x[: int(x.abs().argmax())]  # a shape taken from the values

    with pytest.raises(CaptureError, match="into Python"):
        StepGraph.capture(data_dependent, [torch.randn(5)], [])


def test_a_function_must_return_a_tensor_an_op_made() -> None:
    with pytest.raises(CaptureError, match="one tensor"):
        StepGraph.capture(lambda x: (x + 1, x + 2), [torch.randn(2)], [])
    with pytest.raises(CaptureError, match="no recorded op"):
        StepGraph.capture(lambda x: WEIGHT, [torch.randn(2)], [WEIGHT])
