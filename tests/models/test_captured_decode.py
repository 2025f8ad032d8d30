"""Decode steps replayed from captured graphs compute what the model's modules compute, for every family."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from conftest import CapturingLLM as LLM  # decode steps captured from the first, as the tests mean
from decode_checks import CheckedDecode

from pagedllm import SamplingParams
from pagedllm.layers.attention import AttentionMetadata
from pagedllm.layers.linear import Linear
from pagedllm.layers.quantization.packed_linear import PackedLinearMethod
from pagedllm.runner.capture.captured_decode import CapturedDecode
from pagedllm.runner.capture.decode_graph import PythonCall, num_programs
from pagedllm.runner.model_runner import MAX_CAPTURED_ROWS


def _Checked(runner, tol: float = 1e-5) -> CheckedDecode:  # noqa: ANN001, N802
    """The runner's captured steps, checked against the eager model at every step."""
    return CheckedDecode(runner, runner.captured_decode, tol, tol)


@contextmanager
def _captured(runner, replacement):  # noqa: ANN001, ANN202
    """Swap the runner's captured decode (``_Checked``, None for eager) for the block, then restore it."""
    kept = runner.captured_decode
    runner.captured_decode = replacement
    try:
        yield replacement
    finally:
        runner.captured_decode = kept


def _prompts(num: int, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    # lengths cross block boundaries of the 8-token blocks used below
    return [
        {"prompt_token_ids": torch.randint(100, 40000, (int(n),), generator=gen).tolist()}
        for n in torch.randint(3, 40, (num,), generator=gen)
    ]


def _tokens(llm: LLM, prompts: list, params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


FORMATS = [("float32", "auto", None), ("float32", "float16", None), ("bfloat16", "auto", None),
           ("float32", "auto", "int8"), ("float32", "bfloat16", "int8"), ("float32", "auto", "int4"),
           ("float32", "int8", None), ("float32", "int4", None)]
# Qwen3 (head_dim 32 against the others' 16, q/k norms) replays in every format too: its heads take other
# cache and linear shapes. Qwen2 and Llama 3 differ from Llama only around the linears and in the RoPE table,
# with Llama's head and cache shapes: Qwen2's q/k/v biases in each weight format (float32, bfloat16, int8,
# int4), Llama 3's scaled RoPE table in float32 and bfloat16 activations; their caches are read and written
# by the kernels, at the shapes, that Llama's runs of every cache format (the fast tier) cover.
FAMILY_FORMATS = {
    "qwen2": [FORMATS[0], FORMATS[2], FORMATS[3], FORMATS[5]],
    "qwen3": FORMATS,
    "llama3": [FORMATS[0], FORMATS[2]],
}


# the fast tier replays Llama in every cache and weight format; the other families run in `make test`
@pytest.mark.parametrize(
    ("dtype", "kv_cache_dtype", "quantization", "arch"),
    [*((*f, "llama") for f in FORMATS),
     *(pytest.param(*f, a, marks=pytest.mark.slow) for a, formats in FAMILY_FORMATS.items() for f in formats)],
)
def test_replayed_steps_equal_eager(
    arch: str, dtype: str, kv_cache_dtype: str, quantization: str | None, tiny_model_dirs: dict[str, str]
) -> None:
    """Every linear method and cache dtype, steps of 12 and 2 sequences on one graph."""
    # no prefix caching: the second run of the same prompts must compute its prefills alike
    llm = LLM(tiny_model_dirs[arch], num_kv_blocks=160, max_model_len=256, block_size=8, dtype=dtype,
              kv_cache_dtype=kv_cache_dtype, quantization=quantization, enable_prefix_caching=False)
    runner = llm.llm_engine.model_runner
    assert isinstance(runner.captured_decode, CapturedDecode)
    # 20 tokens: each sequence's decode steps cross two or more of the 8-token blocks
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    # 12 sequences: attention split by sequence; 2: by (sequence, kv head)
    for num_seqs in (12, 2):
        with _captured(runner, _Checked(runner)) as checked:
            replayed = _tokens(llm, _prompts(num_seqs, 5), params)
        assert checked.num_calls == 19 and checked.num_rows[0] == num_seqs
        with _captured(runner, None):
            eager = _tokens(llm, _prompts(num_seqs, 5), params)
        assert replayed == eager
    # the whole decoder is one native program: every traced op has a node kind (int8 and int4
    # embeddings and linears too, one kernel for any number of rows), so one trace, lowered at the most
    # rows (MAX_CAPTURED_ROWS) and the widest tables (256 / 8 blocks), ran every step
    captured = runner.captured_decode
    assert captured.num_traces == 1 and sorted(captured.graphs) == [(1, MAX_CAPTURED_ROWS)]
    assert captured.graphs[(1, MAX_CAPTURED_ROWS)].inputs[3].shape == (MAX_CAPTURED_ROWS, 32)
    for graph in captured.graphs.values():
        assert len(graph.runs) == num_programs(graph.runs) == 1, graph.runs
    assert runner.captured_decode.failed is None
    assert llm.llm_engine.block_manager.num_free_blocks == 160


@pytest.mark.parametrize("linear_backend", ["onednn", "torch"])
def test_other_linear_backends_replay_equal_eager(linear_backend: str, tiny_model_dirs: dict[str, str]) -> None:
    """oneDNN's packed weights are opaque tensors (no storage): the graph holds them as they are."""
    llm = LLM(tiny_model_dirs["qwen2"], num_kv_blocks=64, max_model_len=256, block_size=8,
              linear_backend=linear_backend, enable_prefix_caching=False)
    runner = llm.llm_engine.model_runner
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with _captured(runner, _Checked(runner)) as checked:
        replayed = _tokens(llm, _prompts(3, 2), params)
    assert checked.num_calls == 11 and runner.captured_decode.failed is None
    # their matmuls have no program node: Python calls between programs of the other kernels
    for graph in runner.captured_decode.graphs.values():
        assert num_programs(graph.runs) > 1 and any(isinstance(r, PythonCall) for r in graph.runs)
    with _captured(runner, None):
        assert replayed == _tokens(llm, _prompts(3, 2), params)


class _TieredMethod(PackedLinearMethod):
    """Packed panels up to 4 rows (a program node), ``F.linear`` past them (a Python call): a linear method
    that changes kernels with the rows."""

    row_limits = (4,)

    def process_weights_after_loading(self, layer: Linear) -> None:
        dense = layer.weight.detach().float().contiguous()  # [out_features, in_features]
        super().process_weights_after_loading(layer)
        layer.register_buffer("dense", dense)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if x.numel() // layer.in_features <= self.row_limits[0]:
            return super().apply(layer, x)
        return F.linear(x, layer.dense, layer.bias)


def test_a_forward_that_branches_on_the_rows_is_traced_per_branch(
    tiny_model_dirs: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Up to the limit every step is programs; past it, Python matmuls. The trace's shape guards say which rows
    it holds for: one graph for 1..4 rows, a second trace for 5..64, and every step equals the eager model."""
    import pagedllm.runner.model_loader as model_loader

    monkeypatch.setattr(model_loader, "make_linear_method", lambda precision, linear: _TieredMethod())
    llm = LLM(tiny_model_dirs["llama"], num_kv_blocks=96, max_model_len=128, block_size=8,
              enable_prefix_caching=False)
    runner = llm.llm_engine.model_runner
    captured = runner.captured_decode
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with _captured(runner, _Checked(runner)) as checked:
        small = _tokens(llm, _prompts(2, 12), params)  # 2 rows: packed panels, one program
        assert captured.num_traces == 1 and list(captured.graphs) == [(1, 4)]
        assert len(captured.graphs[(1, 4)].runs) == 1
        large = _tokens(llm, _prompts(7, 13), params)  # past the limit: Python matmuls
        assert captured.num_traces == 2 and sorted(captured.graphs) == [(1, 4), (5, MAX_CAPTURED_ROWS)]
        again = _tokens(llm, _prompts(2, 12), params)
    assert checked.num_calls == 15 and again == small and captured.num_traces == 2
    with _captured(runner, None):
        assert large == _tokens(llm, _prompts(7, 13), params)
        assert small == _tokens(llm, _prompts(2, 12), params)


def test_one_trace_serves_a_batch_that_changes_every_step(tiny_model_dirs: dict[str, str]) -> None:
    """Requests of staggered lengths: the decode batch shrinks at every step, then a larger batch comes; one
    trace (the row count a symbol) runs them all, and the tokens equal the eager model's."""
    llm = LLM(tiny_model_dirs["qwen3"], num_kv_blocks=96, max_model_len=128, block_size=8,
              enable_prefix_caching=False)
    runner = llm.llm_engine.model_runner
    staggered = [SamplingParams(temperature=0, max_tokens=2 + i, ignore_eos=True) for i in range(6)]
    grown = [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)] * 9
    with _captured(runner, _Checked(runner)) as checked:
        got = _tokens(llm, _prompts(6, 21), staggered) + _tokens(llm, _prompts(9, 22), grown)
    assert checked.num_rows == [6, 5, 4, 3, 2, 1, 9, 9]
    assert runner.captured_decode.num_traces == 1 and runner.captured_decode.failed is None
    with _captured(runner, None):
        assert got == _tokens(llm, _prompts(6, 21), staggered) + _tokens(llm, _prompts(9, 22), grown)


@pytest.mark.parametrize("arch", ["gemma3", "mistral", "qwen2_window"])
def test_windowed_models_replay_equal_eager(arch: str, window_dirs: dict[str, str]) -> None:
    """Gemma 3 (its own layers, both RoPE tables, softcapped logits) and sliding windows replay too."""
    llm = LLM(window_dirs[arch], num_kv_blocks=128, max_model_len=256, block_size=4, enable_prefix_caching=False)
    runner = llm.llm_engine.model_runner
    assert isinstance(runner.captured_decode, CapturedDecode)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with _captured(runner, _Checked(runner)) as checked:
        replayed = _tokens(llm, _prompts(3, 9), params)
    assert checked.num_calls == 23
    for graph in runner.captured_decode.graphs.values():
        if arch == "gemma3":  # its embedding scale and GELU stay Python calls between programs
            assert num_programs(graph.runs) > 1 and any(isinstance(r, PythonCall) for r in graph.runs)
        else:  # a window is an argument of the decode node
            assert len(graph.runs) == num_programs(graph.runs) == 1
    # the same engine, its model's modules run eagerly (no prefix caching: the prefills are computed again)
    with _captured(runner, None):
        eager = _tokens(llm, _prompts(3, 9), params)
    assert replayed == eager


@pytest.mark.slow
def test_smollm_sampling_and_forks_replay(smollm_int8: LLM) -> None:
    runner = smollm_int8.llm_engine.model_runner
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    # samples of one prompt fork its blocks (copy-on-write before the step), seeded sampling
    sampled = SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=12, ignore_eos=True)
    with _captured(runner, _Checked(runner, tol=1e-4)) as checked:
        smollm_int8.generate(texts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        assert checked.num_calls == 15
        with_graphs = [c.token_ids for c in smollm_int8.generate(texts[0], sampled, use_tqdm=False)[0].outputs]
        assert checked.num_calls == 26
    with _captured(runner, None):
        without = [c.token_ids for c in smollm_int8.generate(texts[0], sampled, use_tqdm=False)[0].outputs]
    assert with_graphs == without
    assert smollm_int8.llm_engine.block_manager.num_free_blocks == 256


def test_only_decode_steps_of_few_sequences_are_captured(tiny_model_dirs: dict[str, str]) -> None:
    llm = LLM(tiny_model_dirs["llama"], num_kv_blocks=64, max_model_len=128, block_size=8, max_num_seqs=5)
    runner = llm.llm_engine.model_runner
    assert runner.captured_decode.max_rows == min(5, MAX_CAPTURED_ROWS)
    with _captured(runner, _Checked(runner)) as checked:
        params = [SamplingParams(temperature=0, max_tokens=3 + i, ignore_eos=True) for i in range(3)]
        llm.generate(_prompts(3, 3), params, use_tqdm=False)
    # 1 prefill step, then decodes of 3, 3, 2 and 1 sequences, all on one graph of 5 rows
    # and 128 / 8 table columns, traced at the first of them
    assert checked.num_rows == [3, 3, 2, 1]
    assert list(runner.captured_decode.graphs) == [(1, 5)]
    # without native programs every op is a Python call over the step's rows: one graph too
    runner.captured_decode.reset(native_programs=False)
    with _captured(runner, _Checked(runner)) as checked:
        llm.generate(_prompts(3, 3), params, use_tqdm=False)
    assert checked.num_rows == [3, 3, 2, 1]
    assert list(runner.captured_decode.graphs) == [(1, 5)]
    assert num_programs(runner.captured_decode.graphs[(1, 5)].runs) == 0
    assert runner.kv_cache.shape[2] == runner.num_kv_blocks  # no padding block
    assert llm.llm_engine.block_manager.num_free_blocks == runner.num_kv_blocks
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([0, 1]), block_tables=torch.tensor([[0], [0]]), seq_lens_tensor=torch.tensor([2, 2]),
        query_start_loc=[0, 2], seq_lens=[2], num_computed=[0], num_prefills=1, block_size=8,
    )
    assert not runner.captured_decode.accepts(meta, 2)  # a prefill
    assert not runner.captured_decode.accepts(_decode_only_meta(6), 6)  # more rows than max_rows


def _decode_only_meta(num_seqs: int) -> AttentionMetadata:
    """A decode-only step of ``num_seqs`` one-token sequences."""
    return AttentionMetadata(
        slot_mapping=torch.zeros(num_seqs, dtype=torch.int64), block_tables=torch.zeros(num_seqs, 1, dtype=torch.int64),
        seq_lens_tensor=torch.ones(num_seqs, dtype=torch.int64), query_start_loc=list(range(num_seqs + 1)),
        seq_lens=[1] * num_seqs, num_computed=[0] * num_seqs, num_prefills=0, block_size=8,
    )


def test_capture_only_where_steps_are_read_as_tensors(tiny_model_dirs: dict[str, str]) -> None:
    path = tiny_model_dirs["llama"]
    kw = {"num_kv_blocks": 32, "max_model_len": 128, "block_size": 8}
    assert LLM(path, **kw).llm_engine.model_runner.captured_decode is not None
    assert LLM(path, linear_backend="torch", **kw).llm_engine.model_runner.captured_decode is not None
    # SDPA and the reference size their decode reads from Python lengths: never captured
    assert LLM(path, attention_backend="sdpa", **kw).llm_engine.model_runner.captured_decode is None
    assert LLM(path, attention_backend="reference", **kw).llm_engine.model_runner.captured_decode is None
    eager = LLM(path, enforce_eager=True, **kw).llm_engine.model_runner
    assert eager.captured_decode is None
    with pytest.raises(ValueError, match="enforce_eager"):
        LLM(path, enforce_eager="yes", **kw)


def test_a_forward_that_reads_python_values_falls_back_to_eager(
    tiny_model_dirs: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    """A model that reads the step's Python values (which a decode trace does not have) runs eagerly, correctly."""
    llm = LLM(tiny_model_dirs["llama"], num_kv_blocks=64, max_model_len=128, block_size=8)
    runner = llm.llm_engine.model_runner
    forward = runner.model.forward

    def reads_lengths(input_ids, positions, kv_caches, meta):  # noqa: ANN001, ANN202
        # a tensor made from a Python list of the step: a record would freeze it
        offset = torch.tensor(meta.seq_lens, dtype=torch.float32).mean() * 0
        return forward(input_ids, positions, kv_caches, meta) + offset

    runner.model.forward = reads_lengths
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with caplog.at_level("WARNING"):
        got = _tokens(llm, _prompts(2, 4), params)
    assert runner.captured_decode.failed is not None and "cannot be captured" in caplog.text
    assert not runner.captured_decode.graphs
    runner.model.forward = forward
    want = _tokens(LLM(tiny_model_dirs["llama"], num_kv_blocks=64, max_model_len=128, block_size=8,
                       enforce_eager=True), _prompts(2, 4), params)
    assert got == want


def test_replay_under_preemption(tiny_model_dirs: dict[str, str]) -> None:
    """A pool too small for every sequence: preempted ones are recomputed eagerly, decodes replay, and the
    tokens equal an eager run; the pool ends whole."""
    prompts = _prompts(6, 11)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    # one engine run twice, replayed then eager; its prefix cache emptied in between, so the eager run reads
    # no block the replayed one wrote
    llm = LLM(tiny_model_dirs["qwen2"], num_kv_blocks=24, max_model_len=96, block_size=8)
    engine = llm.llm_engine
    runner = engine.model_runner
    results, preemptions = [], [0]
    for eager in (False, True):
        llm.reset_prefix_cache()
        with _captured(runner, None if eager else _Checked(runner)) as checked:
            results.append(_tokens(llm, prompts, params))
        preemptions.append(engine.scheduler.num_preemptions)
        assert preemptions[-1] > preemptions[-2]  # this run was preempted too
        assert engine.block_manager.num_free_blocks == 24
        if checked is not None:
            assert checked.num_calls > 0
    assert results[0] == results[1]
