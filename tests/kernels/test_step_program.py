"""StepProgram: a traced step's kernels run in one parallel region compute exactly what the ops compute.

A function built from every op a program has a node kind for (and one it
has not, ``torch.mul``) is traced with torch.fx, lowered to programs,
and replayed on new inputs: the replay must equal the function called op
by op, bit for bit (the program runs the ops' own team functions on the
same rows). Then what a program refuses: unknown ops, tensors its checks
reject, and, at every run, indices outside their tables.
"""

from __future__ import annotations

import pytest
import torch
from conftest import CapturingLLM as LLM  # decode steps captured from the first, as the tests mean

from pagedllm.kernels import load_kernels
from pagedllm.layers.attention import AttentionMetadata
from pagedllm.layers.kv_quant import is_quantized, quantize_heads
from pagedllm.layers.quantization.quantized_linear import pack_groups, quantize_groups
from pagedllm.runner.capture.decode_graph import (
    CaptureError,
    DecodeGraph,
    PythonCall,
    check_constants,
    input_symbols,
    lower,
    num_programs,
    trace,
)
from pagedllm.runner.capture.step_program import native_calls
from pagedllm.runner.kv_cache import cache_head_width

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 80, 4, 2, 16, 96, 50
BLOCK_SIZE, NUM_BLOCKS, TABLE_WIDTH = 4, 12, 3


@pytest.fixture(scope="module")
def ops():  # noqa: ANN201
    lib = load_kernels()
    assert lib is not None, "the native kernels must build on the test machine"
    return lib


class _Weights:
    """A tiny decoder layer's weights (every linear kind) and a KV cache, owned by the graph."""

    def __init__(self, ops, kv_dtype: torch.dtype = torch.float32) -> None:  # noqa: ANN001
        gen = torch.Generator().manual_seed(0)
        qkv_size = (HEADS + 2 * KV_HEADS) * HEAD_DIM

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen)

        self.embed = rand(VOCAB, HIDDEN)
        self.cos, self.sin = rand(64, HEAD_DIM), rand(64, HEAD_DIM)
        self.norm, self.q_norm, self.k_norm = rand(HIDDEN), rand(HEAD_DIM), rand(HEAD_DIM)
        self.qkv = ops.pack_panels(rand(qkv_size, HIDDEN) * 0.1)
        self.qkv_bias = rand(qkv_size)
        self.o = ops.pack_panels_bf16(rand(HIDDEN, HEADS * HEAD_DIM) * 0.1)
        self.gate_up = ops.pack_panels(rand(2 * INTER, HIDDEN) * 0.1)
        self.down = pack_groups(*quantize_groups(rand(HIDDEN, INTER) * 0.1, 4, 32), 4)  # int4, groups of 32
        self.sinks = rand(HEADS)  # attention-sink logits (gpt-oss): an argument of the decode node
        # [num_blocks, block_size, kv_heads, head_dim] (int8: head_dim values and a float32 scale's 4 bytes;
        # int4 (uint8): head_dim / 2 bytes of nibbles and the scale's)
        width = cache_head_width(HEAD_DIM, kv_dtype)
        self.k_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, width, dtype=kv_dtype)
        self.v_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, width, dtype=kv_dtype)

    def owned(self) -> list[torch.Tensor]:
        return [t for t in vars(self).values() if isinstance(t, torch.Tensor)]


def _layer(ops, w: _Weights, ids, positions, slots, tables, lens) -> torch.Tensor:  # noqa: ANN001
    """One decode layer written with every op a program runs, and torch.mul, which it does not."""
    q_size, kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    x = torch.embedding(w.embed, ids)  # [rows, hidden]
    cos, sin = w.cos[positions], w.sin[positions]  # [rows, head_dim]
    h = ops.add_rms_norm(x, None, w.norm, 1e-5)
    qkv = ops.packed_linear(h, w.qkv, w.qkv_bias, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    ops.qk_norm_rope(qkv, HEADS, KV_HEADS, HEAD_DIM, cos, sin, w.q_norm, w.k_norm, 1e-6)
    k = qkv[:, q_size : q_size + kv_size].view(-1, KV_HEADS, HEAD_DIM)
    v = qkv[:, q_size + kv_size :].view(-1, KV_HEADS, HEAD_DIM)
    ops.write_kv(k, v, w.k_cache, w.v_cache, slots)
    q = qkv[:, :q_size].view(-1, HEADS, HEAD_DIM).contiguous()
    attn = torch.empty_like(q)
    ops.paged_decode(q, w.k_cache, w.v_cache, tables, lens, HEAD_DIM**-0.5, attn, 0, w.sinks)
    o = ops.packed_linear_bf16(attn.flatten(1), w.o, None, HIDDEN)
    h = ops.add_rms_norm(x, o, w.norm, 1e-5)  # x += o in place, then the norm
    h = torch.mul(h, 0.5)  # no node kind: a Python call between two programs
    act = ops.silu_mul(ops.packed_linear(h, w.gate_up, None, 2 * INTER))
    x.add_(ops.quantized_linear(act, w.down, 4, 32, INTER, None))
    return ops.add_rms_norm(x, None, w.norm, 1e-5)


def _step(rows: int, seed: int) -> list[torch.Tensor]:
    """ids, positions, slots, block tables and lengths of ``rows`` decode tokens, tables scattered over the pool."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, TABLE_WIDTH * BLOCK_SIZE + 1, (rows,), generator=gen)
    tables = torch.stack([torch.randperm(NUM_BLOCKS, generator=gen)[:TABLE_WIDTH] for _ in range(rows)])
    positions = lens - 1
    slots = tables.gather(1, (positions // BLOCK_SIZE).unsqueeze(1)).squeeze(1) * BLOCK_SIZE + positions % BLOCK_SIZE
    ids = torch.randint(0, VOCAB, (rows,), generator=gen)
    return [ids, positions, slots, tables, lens]


def _fill_cache(w: _Weights, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    shape = (*w.k_cache.shape[:-1], HEAD_DIM)
    for cache in (w.k_cache, w.v_cache):
        x = torch.randn(shape, generator=gen)
        cache.copy_(quantize_heads(x, cache.dtype) if is_quantized(cache.dtype) else x)


def _graph(fn, w: _Weights, max_rows: int, native: bool = True) -> DecodeGraph:  # noqa: ANN001
    """``fn`` traced symbolically (2 rows, 3 table columns) and lowered at ``max_rows`` rows."""
    gm = trace(fn, _step(2, 0))
    check_constants(gm, w.owned())
    dims = input_symbols(gm)
    rows, width = dims[0][0], dims[3][1]
    bindings = {rows: max_rows, width: TABLE_WIDTH}
    return lower(gm, _step(max_rows, 0), rows, bindings, list(range(1, max_rows + 1)), native)


# 1 row: attention split by kv head; 9 rows: by sequence, and more than one 8-row tile; an int8 / int4
# (uint8) cache's write_kv / paged_decode nodes too
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8, torch.uint8])
@pytest.mark.parametrize("rows", [1, 9])
def test_programs_replay_the_ops_exactly(ops, rows: int, kv_dtype: torch.dtype) -> None:  # noqa: ANN001
    w = _Weights(ops, kv_dtype)
    graph = _graph(lambda *a: _layer(ops, w, *a), w, 12)
    # every op but torch.mul is a node of a program: program, mul, program
    assert num_programs(graph.runs) == 2 and len(graph.runs) == 3
    assert isinstance(graph.runs[1], PythonCall) and graph.runs[1].op is torch.ops.aten.mul.Tensor
    for seed in (3, 4):
        inputs = _step(rows, seed)
        _fill_cache(w, seed)
        got = graph.replay(inputs, rows).clone()
        got_k, got_v = w.k_cache.clone(), w.v_cache.clone()
        _fill_cache(w, seed)
        want = _layer(ops, w, *inputs)
        assert torch.equal(got, want)
        assert torch.equal(got_k, w.k_cache) and torch.equal(got_v, w.v_cache)


def test_a_program_refuses_what_its_ops_refuse(ops) -> None:  # noqa: ANN001
    program = torch.classes.pagedllm.StepProgram(3)
    x, weight = torch.randn(3, 8), torch.randn(8)
    with pytest.raises(ValueError, match="no node for op"):
        program.add("matmul", [x, weight], [], [])
    with pytest.raises(ValueError, match="expected 4 tensors"):
        program.add("add_rms_norm", [x, None, weight], [], [1e-5])
    with pytest.raises(ValueError, match="float32"):  # the eager op's own check
        program.add("add_rms_norm", [x.double(), None, weight, torch.empty(3, 8)], [], [1e-5])
    with pytest.raises(ValueError, match="shape"):  # an output of the wrong shape
        program.add("add_rms_norm", [x, None, weight, torch.empty(3, 9)], [], [1e-5])
    with pytest.raises(ValueError, match="rows of"):
        program.add("copy_rows", [torch.randn(4, 3).t(), torch.empty(3, 4)], [], [])
    with pytest.raises(ValueError, match="not over the program's 3 rows"):  # run(n) could not cut it
        program.add("add_rms_norm", [x[:2], None, weight, torch.empty(2, 8)], [], [1e-5])
    with pytest.raises(ValueError, match="not over the program's 3 rows"):
        program.add("add_", [weight, weight], [], [])
    assert program.num_nodes() == 0
    program.add("add_rms_norm", [x, None, weight, torch.empty(3, 8)], [], [1e-5])
    assert program.num_nodes() == 1
    for rows in (0, 4):
        with pytest.raises(ValueError, match="rows"):
            program.run(rows)
    with pytest.raises(ValueError, match="rows must be at least 1"):
        torch.classes.pagedllm.StepProgram(0)


@pytest.mark.parametrize("rows", [1, 5, 9])
@pytest.mark.parametrize("native", [True, False])
def test_a_graph_runs_its_first_rows_as_the_ops_run_those_rows(ops, rows: int, native: bool) -> None:  # noqa: ANN001
    """A graph lowered at 12 rows and 3 table columns, programs and Python calls (or Python calls alone), runs
    a step of fewer rows and narrower tables copied into its corner: exactly the ops on those rows; the other
    rows are left alone."""
    w = _Weights(ops)
    graph = _graph(lambda *a: _layer(ops, w, *a), w, 12, native)
    assert num_programs(graph.runs) == (2 if native else 0)
    graph.result.zero_()  # static buffers start uninitialised (NaN is not equal to itself)
    kept = graph.result[rows:].clone()
    inputs = _step(rows, 7)
    inputs[3] = inputs[3][:, :2]  # tables one column narrower than lowered
    inputs[4] = inputs[4].clamp(max=2 * BLOCK_SIZE)  # lengths that fit them
    inputs[1] = inputs[4] - 1
    tables, positions = inputs[3], inputs[1]
    inputs[2] = tables.gather(1, (positions // BLOCK_SIZE).unsqueeze(1)).squeeze(1) * BLOCK_SIZE + positions % BLOCK_SIZE
    _fill_cache(w, 8)
    got = graph.replay(inputs, rows).clone()
    got_k = w.k_cache.clone()
    _fill_cache(w, 8)
    assert torch.equal(got, _layer(ops, w, *inputs)) and torch.equal(got_k, w.k_cache)
    assert torch.equal(graph.result[rows:], kept)
    with pytest.raises(ValueError, match="do not fit"):
        graph.replay(_step(13, 3), 13)


def test_a_trace_refuses_what_a_step_cannot_replay(ops) -> None:  # noqa: ANN001
    """A tensor made in Python from the step, a value read into Python, a result that is not one tensor."""
    w = _Weights(ops)
    with pytest.raises(CaptureError, match="neither an input"):
        check_constants(trace(lambda *a: _layer(ops, w, *a) + torch.tensor([1.0]), _step(2, 0)), w.owned())
    with pytest.raises(CaptureError, match="cannot be traced"):
        trace(lambda ids, *a: w.embed[: int(ids.max())].sum(0) + ids, _step(2, 0))
    with pytest.raises(CaptureError, match="one tensor"):
        trace(lambda ids, *a: (ids, ids), _step(2, 0))


def test_a_program_checks_the_steps_indices_at_every_run(ops) -> None:  # noqa: ANN001
    """Slots, blocks, lengths and gathered ids are the step's values: checked before anything runs."""
    w = _Weights(ops)
    inputs = _step(2, 5)
    graph = _graph(lambda *a: _layer(ops, w, *a), w, 2)
    ids, positions, slots, tables, lens = inputs
    bad_steps = {
        "outside the KV cache": [ids, positions, slots + NUM_BLOCKS * BLOCK_SIZE, tables, lens],
        "outside the cache of": [ids, positions, slots, tables + NUM_BLOCKS, lens],
        "does not fit its block table": [ids, positions, slots, tables, lens + TABLE_WIDTH * BLOCK_SIZE],
        "outside the table": [ids + VOCAB, positions, slots, tables, lens],
    }
    for message, bad in bad_steps.items():
        before = w.k_cache.clone()
        with pytest.raises(ValueError, match=message):
            graph.replay(bad, 2)
        assert torch.equal(before, w.k_cache), message  # nothing was written
    graph.replay(inputs, 2)  # and a good step still runs


def test_only_known_ops_are_lowered() -> None:
    """pagedllm ops by their schema's arguments; aten ops the few a step moves rows with; nothing else."""
    x, out = torch.randn(2, 3), torch.empty(2, 3)
    aten, pagedllm = torch.ops.aten, torch.ops.pagedllm
    assert native_calls(aten.mul.Tensor, (x, x), {}, out) is None
    assert native_calls(aten.add_.Tensor, (x, x), {}, None) == [("add_", [x, x], [], [])]
    assert native_calls(aten.add_.Tensor, (x, x), {"alpha": 2}, None) is None  # not what the add node computes
    w, cos = torch.randn(3), torch.randn(2, 4)
    # tensors, ints and floats in schema order, the new result last; defaults filled in
    assert native_calls(pagedllm.add_rms_norm.default, (x, None, w, 1e-5), {}, out) == (
        [("add_rms_norm", [x, None, w, out], [], [1e-5])])
    assert native_calls(pagedllm.paged_decode.default, (x, x, x, x, x, 0.5, out), {}, None) == (
        [("paged_decode", [x, x, x, x, x, out, None], [0], [0.5])])
    assert native_calls(pagedllm.quantized_linear.default, (x, w, 4, 32, 3, None), {}, out) == (
        [("quantized_linear", [x, w, None, out], [4, 32, 3, 0], [])])
    assert native_calls(pagedllm.qk_norm_rope.default, (x, 1, 1, 4, cos, cos, None, None, 1e-6), {}, None) == (
        [("qk_norm_rope", [x, cos, cos, None, None], [1, 1, 4], [1e-6])])


def test_a_cat_of_a_fused_layers_parts_runs_in_the_program() -> None:
    """torch.cat along the last dimension (a GGUF q/k/v whose parts have different types) becomes one row copy per
    part into its columns: the program runs it, over all its rows or fewer, as torch.cat does."""
    parts = [torch.randn(5, n) for n in (64, 16, 16)]
    out = torch.empty(5, 96)
    cat = torch.ops.aten.cat.default
    calls = native_calls(cat, (parts, -1), {}, out)
    assert [c[0] for c in calls] == ["copy_rows"] * 3
    program = torch.classes.pagedllm.StepProgram(5)
    for call in calls:
        program.add(*call)
    for n in (5, 2):
        out.zero_()
        program.run(n)
        assert torch.equal(out[:n], torch.cat([p[:n] for p in parts], dim=-1)) and not out[n:].any()
    # along another dimension, or of parts that do not fill the output, it stays a Python call
    assert native_calls(cat, (parts[:1] * 2, 0), {}, torch.empty(10, 64)) is None
    assert native_calls(cat, (parts[1:], 1), {}, torch.empty(5, 40)) is None


def test_a_replayed_step_with_a_bad_block_is_refused(tiny_model_dirs: dict[str, str]) -> None:
    """Through the runner: a decode step whose table points outside the pool raises and writes nothing."""
    llm = LLM(tiny_model_dirs["llama"], num_kv_blocks=32, max_model_len=128, block_size=8)
    runner = llm.llm_engine.model_runner
    captured = runner.captured_decode
    num_blocks = runner.kv_cache.shape[2]  # the pool

    def meta(block: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=torch.tensor([block * 8]), block_tables=torch.tensor([[block]]),
            seq_lens_tensor=torch.tensor([1]), query_start_loc=[0, 1], seq_lens=[1], num_computed=[0],
            num_prefills=0, block_size=8,
        )

    ids, pos = torch.tensor([5]), torch.tensor([0])
    out = captured(ids, pos, meta(3))  # captured, then replayed below
    assert out.shape == (1, runner.model_config.hidden_size) and torch.isfinite(out).all()
    assert captured.graphs and all(num_programs(g.runs) == len(g.runs) == 1 for g in captured.graphs.values())
    before = runner.kv_cache.clone()
    with pytest.raises(ValueError, match="outside the"):
        captured(ids, pos, meta(num_blocks))
    assert torch.equal(before, runner.kv_cache)
    torch.testing.assert_close(captured(ids, pos, meta(3)), out)
