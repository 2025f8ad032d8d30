"""The fused decode step (int8 rows, float32 panels, bf16 panels) computes what the layer-by-layer path computes."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from decode_checks import CheckedDecode

from pagedllm import LLM, SamplingParams
from pagedllm.layers.attention import AttentionMetadata
from pagedllm.layers.int8_linear import SMALL_BATCH_ROWS
from pagedllm.runner.fused_decode import FusedDecode


def _Checked(runner, tol: float = 1e-4, kv_tol: float | None = None) -> CheckedDecode:  # noqa: ANN001, N802
    """The runner's fused step, checked against the eager model at every step (K/V to ``tol / 10``)."""
    return CheckedDecode(runner, runner.fused_decode, tol, tol / 10 if kv_tol is None else kv_tol)


@contextmanager
def _fused_step(runner, replacement):  # noqa: ANN001, ANN202
    """Swap the runner's fused step (``_Checked``, None to turn it off) for the block, then restore it."""
    kept = runner.fused_decode
    runner.fused_decode = replacement
    try:
        yield replacement
    finally:
        runner.fused_decode = kept


def _prompts(num: int, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    # lengths cross block boundaries of the 8-token blocks used below
    return [
        {"prompt_token_ids": torch.randint(100, 40000, (int(n),), generator=gen).tolist()}
        for n in torch.randint(3, 40, (num,), generator=gen)
    ]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "llama3"])
def test_fused_step_equals_layer_by_layer_tiny(arch: str, tiny_model_dirs: dict[str, str]) -> None:
    # llama/qwen2: head_dim 16, GQA 4 on 2; qwen2: q/k/v biases; qwen3: per-head q/k norms,
    # head_dim 32; llama3: scaled RoPE
    llm = LLM(tiny_model_dirs[arch], num_kv_blocks=96, max_model_len=256, block_size=8, quantization="int8")
    runner = llm.llm_engine.model_runner
    assert isinstance(runner.fused_decode, FusedDecode)
    checked = runner.fused_decode = _Checked(runner)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    fused = [o.outputs[0].token_ids for o in llm.generate(_prompts(SMALL_BATCH_ROWS, 1), params, use_tqdm=False)]
    assert checked.num_calls == 23  # every decode step of the batch
    runner.fused_decode = None
    eager = [o.outputs[0].token_ids for o in llm.generate(_prompts(SMALL_BATCH_ROWS, 1), params, use_tqdm=False)]
    assert fused == eager
    assert llm.llm_engine.block_manager.num_free_blocks == 96


def test_fused_step_equals_layer_by_layer_smollm(smollm_int8: LLM) -> None:
    runner = smollm_int8.llm_engine.model_runner
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    # samples of one prompt fork its blocks (copy-on-write before the step), seeded sampling
    sampled = SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=12, ignore_eos=True)
    with _fused_step(runner, _Checked(runner)) as checked:
        smollm_int8.generate(texts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        assert checked.num_calls == 15
        with_fused = [c.token_ids for c in smollm_int8.generate(texts[0], sampled, use_tqdm=False)[0].outputs]
        assert checked.num_calls == 26
    with _fused_step(runner, None):
        without = [c.token_ids for c in smollm_int8.generate(texts[0], sampled, use_tqdm=False)[0].outputs]
    assert with_fused == without
    assert smollm_int8.llm_engine.block_manager.num_free_blocks == 256


def test_fused_step_only_for_small_decode_steps(smollm_int8: LLM) -> None:
    runner = smollm_int8.llm_engine.model_runner
    with _fused_step(runner, _Checked(runner)) as checked:
        # one sequence more than the fused step takes: the layer-by-layer path
        # until the short one finishes, then the fused one
        num_seqs = SMALL_BATCH_ROWS + 1
        prompts = _prompts(num_seqs, 3)
        params = [SamplingParams(temperature=0, max_tokens=4 if i == 0 else 6, ignore_eos=True) for i in range(num_seqs)]
        smollm_int8.generate(prompts, params, use_tqdm=False)
        # steps: 1 prefill, 3 decodes of all sequences, then 2 without the first (fused)
        assert checked.num_calls == 2


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize(
    ("dtype", "kv_cache_dtype"),
    [
        ("float32", "auto"), ("float32", "bfloat16"), ("float32", "float16"),
        ("bfloat16", "auto"), ("bfloat16", "float16"), ("bfloat16", "float32"),
    ],
)
def test_fused_panel_step_equals_layer_by_layer(arch: str, dtype: str, kv_cache_dtype: str, tiny_model_dirs) -> None:  # noqa: ANN001
    """Float32 and bf16 panels: any number of decode rows runs fused, with the layer path's arithmetic
    (the same tiles, K/V rounding and attention), for each cache dtype."""
    # no prefix caching: the second run of the same prompts must compute its prefills alike
    llm = LLM(tiny_model_dirs[arch], num_kv_blocks=160, max_model_len=256, block_size=8, dtype=dtype,
              kv_cache_dtype=kv_cache_dtype, linear_backend="packed", enable_prefix_caching=False)
    runner = llm.llm_engine.model_runner
    assert isinstance(runner.fused_decode, FusedDecode) and runner.fused_decode.max_rows is None
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    # both paths run the same tile, rounding, attention and elementwise row functions
    tol = kv_tol = 1e-5
    # 12 sequences: more than the int8 limit, and enough to split attention by sequence;
    # 2 sequences: attention split by (sequence, kv head)
    for num_seqs in (12, 2):
        with _fused_step(runner, _Checked(runner, tol=tol, kv_tol=kv_tol)) as checked:
            fused = [o.outputs[0].token_ids for o in llm.generate(_prompts(num_seqs, 5), params, use_tqdm=False)]
        assert checked.num_calls == 11 and checked.num_rows[0] == num_seqs
        with _fused_step(runner, None):
            eager = [o.outputs[0].token_ids for o in llm.generate(_prompts(num_seqs, 5), params, use_tqdm=False)]
        assert fused == eager
    assert llm.llm_engine.block_manager.num_free_blocks == 160


def test_fused_decode_only_with_int8_or_packed_and_cpu_paged(tiny_model_dirs: dict[str, str]) -> None:
    path = tiny_model_dirs["llama"]
    kw = {"num_kv_blocks": 32, "max_model_len": 128, "block_size": 8}
    assert LLM(path, **kw).llm_engine.model_runner.fused_decode is not None  # packed float32: the default
    assert LLM(path, linear_backend="torch", **kw).llm_engine.model_runner.fused_decode is None
    assert LLM(path, linear_backend="onednn", **kw).llm_engine.model_runner.fused_decode is None
    for quantization in (None, "int8"):
        llm = LLM(path, quantization=quantization, attention_backend="sdpa", **kw)
        assert llm.llm_engine.model_runner.fused_decode is None


def test_fused_decode_refuses_mixed_linear_kinds(tiny_model_dirs: dict[str, str]) -> None:
    llm = LLM(tiny_model_dirs["llama"], num_kv_blocks=32, max_model_len=128, block_size=8)
    runner = llm.llm_engine.model_runner
    layer = runner.model.model.layers[1]
    kept = layer.mlp.down_proj
    layer.mlp.down_proj = torch.nn.Linear(kept.in_features, kept.out_features, bias=False)
    try:
        with pytest.raises(ValueError, match="one kind"):
            FusedDecode(runner.model, runner.kv_caches, runner.block_size)
    finally:
        layer.mlp.down_proj = kept


def test_fused_decode_refuses_mismatched_inputs_and_weights(tiny_model_dirs: dict[str, str]) -> None:
    """The kernel trusts its pointers: inputs of the wrong length and weights of another shape are refused."""
    llm = LLM(tiny_model_dirs["llama"], num_kv_blocks=32, max_model_len=128, block_size=8)
    runner = llm.llm_engine.model_runner
    fused = runner.fused_decode
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([0, 9]), block_tables=torch.tensor([[0], [1]]), seq_lens_tensor=torch.tensor([1, 2]),
        query_start_loc=[0, 1, 2], seq_lens=[1, 2], num_computed=[0, 1], num_prefills=0, block_size=8,
    )
    with pytest.raises(ValueError, match="as many positions"):
        fused(torch.tensor([5, 6]), torch.tensor([0]), meta)  # one position for two tokens
    layer = runner.model.model.layers[0].mlp.down_proj
    kept = layer.packed_weight
    layer.packed_weight = kept[:, :-1].contiguous()  # one input feature short
    try:
        with pytest.raises(ValueError, match="does not fit"):
            FusedDecode(runner.model, runner.kv_caches, runner.block_size)
    finally:
        layer.packed_weight = kept


def test_fused_decode_refuses_bad_steps(smollm_int8: LLM) -> None:
    runner = smollm_int8.llm_engine.model_runner
    fused: FusedDecode = runner.fused_decode
    bs = runner.block_size
    num_blocks = runner.kv_cache.shape[2]  # the pool and the padding block of captured steps
    num_slots = num_blocks * bs

    def meta(slot: int, block: int = 0, seq_len: int = 1, num_seqs: int = 1) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=torch.tensor([slot] * num_seqs),
            block_tables=torch.tensor([[block]] * num_seqs, dtype=torch.int64),
            seq_lens_tensor=torch.full((num_seqs,), seq_len, dtype=torch.int64),
            query_start_loc=list(range(num_seqs + 1)), seq_lens=[seq_len] * num_seqs,
            num_computed=[seq_len - 1] * num_seqs, num_prefills=0, block_size=bs,
        )

    ids, pos = torch.tensor([5]), torch.tensor([0])
    before = runner.kv_cache.clone()
    for bad in (
        meta(num_slots),  # slot outside the cache
        meta(3),  # not position 0's place in block 0
        meta(num_slots, block=num_blocks),  # block outside the cache
        meta(1, seq_len=2),  # decoding position 0 of a 2-token sequence
    ):
        with pytest.raises(ValueError, match="inconsistent addressing"):
            fused(ids, pos, bad)
    with pytest.raises(ValueError, match="inconsistent addressing"):
        fused(ids, torch.tensor([10**6]), meta(0))
    assert torch.equal(before, runner.kv_cache)  # nothing written
    many = SMALL_BATCH_ROWS + 1
    assert not fused.accepts(meta(0, num_seqs=many), many)
    with pytest.raises(ValueError, match="decode-only"):
        fused(torch.tensor([5] * many), torch.tensor([0] * many), meta(0, num_seqs=many))
    with pytest.raises(ValueError, match="int64"):
        fused(ids, pos.int(), meta(0))
    # a valid one-token step writes its slot and returns one normed hidden row
    block = runner.num_kv_blocks - 1
    out = fused(ids, pos, meta(block * bs, block=block))
    assert out.shape == (1, runner.model_config.hidden_size) and torch.isfinite(out).all()
    assert runner.kv_cache[:, :, block, 0].abs().sum() > 0
    runner.kv_cache.copy_(before)


def test_fused_step_under_preemption(tiny_model_dirs: dict[str, str]) -> None:
    """A pool too small for every sequence: preempted ones are recomputed layer by layer, the
    decodes run fused, and the tokens equal a run without the fused step; the pool ends whole."""
    prompts = _prompts(6, 11)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    results = []
    for fused_on in (True, False):
        llm = LLM(tiny_model_dirs["qwen2"], num_kv_blocks=24, max_model_len=96, block_size=8, quantization="int8")
        engine = llm.llm_engine
        runner = engine.model_runner
        with _fused_step(runner, _Checked(runner) if fused_on else None) as checked:
            results.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        assert engine.scheduler.num_preemptions > 0
        assert engine.block_manager.num_free_blocks == 24
        if checked is not None:
            assert checked.num_calls > 0
    assert results[0] == results[1]
