"""Batch invariance (issue 35, docs/batch-invariance.md): a needle request gives the same bits whatever its company.

The needle (a paragraph of the GPL, greedy and seeded, ``logprobs=5``, ``prompt_logprobs=5``) is computed
alone in a fresh eager engine; then, with ``batch_invariant=True``, in engines of every chunk size
(``max_num_batched_tokens`` 16, 64, 2048), captured and eager: alone, inside batches of random neighbours
(compositions drawn by hypothesis), after a prefix-cache hit and under a pool small enough to preempt it.
Every token id and every float (sampled and top-k logprobs, prompt logprobs) is compared with ``==``.

The inverse (``test_the_default_engine_is_not_invariant``) shows the harness can fail: without the mode a
prompt chunked into 16-token steps runs its attention through the decode kernel, a whole prompt through the
prefill kernel, which sums in another order.
"""

from __future__ import annotations

import functools
import random

import pytest
from conftest import CapturingLLM
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm import LLM, SamplingParams

GPL = open("/usr/share/common-licenses/GPL-3").read()
NEEDLE = GPL[1200:1700]  # ~110 tokens of real text
MAX_TOKENS = 8
# the models: the bundled GGUF on 8-bit activations (the default), its float32 weights, bf16
MODELS = {
    "gguf-int8": {},
    "float32": {"quantization": "none"},
    "bfloat16": {"quantization": "none", "dtype": "bfloat16"},
}
COMMON = {"max_model_len": 512, "num_threads": 1, "num_kv_blocks": 128}
# and quantized KV caches (issue 34): a token's stored bits depend on its own K/V only (per-token scales; int4's
# transform is fitted once per engine), so a prefix hit or a recompute reads or writes the same bits
KV_MODELS = {**MODELS, "gguf-int8, int8 KV": {"kv_cache_dtype": "int8"}, "gguf-int8, int4 KV": {"kv_cache_dtype": "int4"}}
# weight-only int8/int4 (the bundled file's weights rounded again at load) on either activations, and the file's
# own blocks on float activations
WEIGHTS = [{"quantization": "int8"}, {"quantization": "int4"},
           {"quantization": "int8", "gguf_activations": "float32"},
           {"quantization": "int4", "gguf_activations": "float32"}]
WEIGHT_MODELS = {**{"weight-only " + ", ".join(f"{k}={v}" for k, v in w.items()): w for w in WEIGHTS},
                 "gguf blocks, gguf_activations=float32": {"gguf_activations": "float32"}}
ALL_MODELS = {**KV_MODELS, **WEIGHT_MODELS}


def params(seeded: bool, prompt_logprobs: bool = True) -> SamplingParams:
    """The needle's sampling: greedy, or seeded at temperature 0.8; always top-5 logprobs."""
    return SamplingParams(
        temperature=0.8 if seeded else 0.0, seed=7 if seeded else None, max_tokens=MAX_TOKENS, ignore_eos=True,
        logprobs=5, prompt_logprobs=5 if prompt_logprobs else None,
    )


def fingerprint(out) -> tuple:  # noqa: ANN001
    """Every token id and float of a request's output, in a form ``==`` compares exactly."""
    c = out.outputs[0]
    logprobs = [sorted((t, p.logprob, p.rank) for t, p in d.items()) for d in c.logprobs or []]
    prompt = [None if d is None else sorted((t, p.logprob, p.rank) for t, p in d.items())
              for d in out.prompt_logprobs or []]
    return c.token_ids, c.cumulative_logprob, logprobs, prompt


def neighbours(lengths: list[int], seed: int) -> tuple[list[str], list[SamplingParams]]:
    """Prompts of about ``lengths`` characters cut from elsewhere in the GPL, each with its own sampling."""
    rng = random.Random(seed)
    prompts = [GPL[(start := rng.randrange(3000, 30000)) : start + n] for n in lengths]
    sps = [SamplingParams(temperature=rng.choice([0.0, 1.0]), seed=rng.randrange(100), ignore_eos=True,
                          max_tokens=rng.randrange(1, 12)) for _ in lengths]
    return prompts, sps


def needle_in(llm: LLM, sp: SamplingParams, lengths: list[int], position: int, seed: int) -> tuple:
    """The needle's fingerprint when run at ``position`` among neighbours of ``lengths``."""
    prompts, sps = neighbours(lengths, seed)
    position = min(position, len(prompts))
    prompts.insert(position, NEEDLE)
    sps.insert(position, sp)
    return fingerprint(llm.generate(prompts, sps, use_tqdm=False)[position])


@functools.cache
def references(model: str) -> dict[tuple[bool, bool], tuple]:
    """The needle alone in a fresh eager engine, whole prompt in one step (the mode on), keyed by (seeded,
    prompt logprobs): one engine computes them one request at a time, with no prefix caching, so each request
    computes its whole prompt as in an engine of its own."""
    llm = LLM(enforce_eager=True, batch_invariant=True, enable_prefix_caching=False, **COMMON, **ALL_MODELS[model])
    with_prompt_logprobs = (True, False) if model in KV_MODELS else (True,)  # the prefix-hit test asks for False
    refs = {(seeded, prompt_logprobs): fingerprint(
        llm.generate([NEEDLE], params(seeded, prompt_logprobs), use_tqdm=False)[0])
        for seeded in (False, True) for prompt_logprobs in with_prompt_logprobs}
    assert_idle(llm)
    return refs


def reference(model: str, seeded: bool, prompt_logprobs: bool = True) -> tuple:
    """The needle's fingerprint alone in a fresh eager engine of ``model``."""
    return references(model)[seeded, prompt_logprobs]


def assert_idle(llm: LLM) -> None:
    """No request left and every KV block back in the pool (cached prefixes count as free): an engine shared
    between tests starts each one clean."""
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def make(model: str, chunk: int, captured: bool, **kwargs: object) -> LLM:
    """An engine of ``model`` with ``max_num_batched_tokens=chunk``, its decode steps captured or eager."""
    options = {**COMMON, **ALL_MODELS[model], "max_num_batched_tokens": chunk, **kwargs}
    options.setdefault("batch_invariant", True)
    return CapturingLLM(**options) if captured else LLM(enforce_eager=True, **options)


@pytest.fixture(scope="module")
def captured_64() -> dict[str, LLM]:
    """The captured engines of 64-token chunks, one per model, shared by the needle tests and the prefix-hit
    test (which takes each out at its last use, so the module holds at most three)."""
    return {}


def captured_64_engine(engines: dict[str, LLM], model: str, last_use: bool = False) -> LLM:
    """``make(model, 64, captured=True)``, built once for the module; checked idle before it is lent."""
    llm = engines.pop(model, None) if last_use else engines.get(model)
    if llm is None:
        llm = make(model, 64, captured=True)
        if not last_use:
            engines[model] = llm
    assert_idle(llm)
    return llm


@pytest.mark.slow
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("chunk, captured", [(16, False), (64, True), (2048, True)])
def test_the_needle_is_the_same_in_any_company(
    model: str, chunk: int, captured: bool, captured_64: dict[str, LLM]
) -> None:
    llm = captured_64_engine(captured_64, model) if (chunk, captured) == (64, True) else make(model, chunk, captured)
    for seeded in (False, True):
        want = reference(model, seeded)
        assert fingerprint(llm.generate([NEEDLE], params(seeded), use_tqdm=False)[0]) == want

        @settings(max_examples=2, deadline=None, derandomize=True,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
        @given(lengths=st.lists(st.integers(20, 600), min_size=1, max_size=4), position=st.integers(0, 4),
               seed=st.integers(0, 1000))
        def in_a_batch(lengths: list[int], position: int, seed: int) -> None:
            assert needle_in(llm, params(seeded), lengths, position, seed) == want  # noqa: B023

        in_a_batch()
    assert_idle(llm)


@pytest.mark.slow
@pytest.mark.parametrize("model", list(KV_MODELS))
def test_a_prefix_cache_hit_gives_the_same_bits(model: str, captured_64: dict[str, LLM]) -> None:
    # prompt logprobs need every prompt position computed, so those requests take no prefix hit: the
    # needle here asks for sampled logprobs only
    llm = captured_64_engine(captured_64, model, last_use=True)
    for seeded in (False, True):
        want = reference(model, seeded, prompt_logprobs=False)
        llm.generate([NEEDLE[:300]], params(seeded, False), use_tqdm=False)  # caches the needle's first blocks
        out = llm.generate([NEEDLE], params(seeded, False), use_tqdm=False)[0]
        assert out.num_cached_tokens > 0
        assert fingerprint(out) == want
    assert_idle(llm)


@pytest.mark.slow
@pytest.mark.parametrize("model", list(KV_MODELS))
def test_a_preempted_needle_gives_the_same_bits(model: str) -> None:
    # 12 blocks of 16 tokens for the needle (~110 + 8 tokens) and neighbours of ~120 tokens decoding 40 each
    llm = make(model, 64, captured=False, num_kv_blocks=32)
    want = reference(model, True)
    prompts, sps = neighbours([500] * 5, seed=5)
    sps = [SamplingParams(temperature=1.0, seed=i, max_tokens=40, ignore_eos=True) for i in range(len(sps))]
    outs = llm.generate([NEEDLE, *prompts], [params(True), *sps], use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert fingerprint(outs[0]) == want
    assert_idle(llm)


@pytest.mark.slow
@pytest.mark.parametrize("weights", WEIGHTS, ids=["int8", "int4", "int8-float-activations", "int4-float-activations"])
def test_weight_only_int8_and_int4_give_the_needle_the_same_bits(weights: dict) -> None:
    """Weight-only int8/int4 (the bundled file's weights rounded again at load), on 8-bit activations (the
    blocks interleaved) and on float ones (one row alone dequantized in registers): the needle alone, in
    16-token chunks among neighbours, and captured in 64-token chunks, bitwise."""
    _check_alone_chunked_and_captured("weight-only " + ", ".join(f"{k}={v}" for k, v in weights.items()))


@pytest.mark.slow
def test_gguf_blocks_on_float_activations_give_the_needle_the_same_bits() -> None:
    """The bundled file's own blocks (Q4_1 + Q8_0) on float activations: a lone decode row dequantizes each
    block in registers in the order a batch's rows sum the dequantized strip, so the needle alone, in
    16-token chunks among neighbours, and captured in 64-token chunks gives the same bits."""
    _check_alone_chunked_and_captured("gguf blocks, gguf_activations=float32")


def _check_alone_chunked_and_captured(name: str) -> None:
    """Greedy and seeded: the needle alone and among neighbours, in 16-token chunks eager and in 64-token chunks
    captured, equals the engine's reference for ``name`` bit for bit (one engine of each kind serves both)."""
    for chunk, captured in ((16, False), (64, True)):
        llm = make(name, chunk, captured)
        for seeded in (False, True):
            want = reference(name, seeded)
            assert fingerprint(llm.generate([NEEDLE], params(seeded), use_tqdm=False)[0]) == want
            assert needle_in(llm, params(seeded), [300, 40, 500], 1, seed=3) == want
        assert_idle(llm)


@pytest.mark.slow  # ~6 s: `make test`
def test_the_default_engine_is_not_invariant() -> None:
    """The inverse: without the mode the harness finds a difference (a chunked prompt's attention runs the
    decode kernel, a whole prompt the prefill kernel), so the tests above can fail."""
    whole = make("float32", 2048, captured=False, batch_invariant=False)
    chunked = make("float32", 16, captured=False, batch_invariant=False)
    assert fingerprint(whole.generate([NEEDLE], params(False), use_tqdm=False)[0]) != fingerprint(
        chunked.generate([NEEDLE], params(False), use_tqdm=False)[0]
    )


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"tensor_parallel_size": 3}, "tensor_parallel_size"),
        ({"attention_backend": "sdpa"}, "attention_backend"),
        ({"linear_backend": "onednn"}, "linear_backend"),
        ({"device": "cuda"}, "device"),
    ],
)
def test_what_the_mode_cannot_cover_is_refused(kwargs: dict, field: str) -> None:
    from pagedllm.config import EngineConfig
    from pagedllm.loader import bundled_model_path
    from pagedllm.resolved_config import resolve_config

    config = EngineConfig(model=bundled_model_path(), batch_invariant=True, **kwargs)
    with pytest.raises(ValueError, match=f"batch_invariant=True does not cover {field}"):
        resolve_config(config)  # when the engine starts, before the weights load


@pytest.mark.parametrize("command", [["generate", "x"], ["serve"], ["bench", "throughput"], ["bench", "latency"]])
def test_the_cli_flag_reaches_the_engine_config(command: list[str]) -> None:
    from pagedllm.entrypoints.cli import _engine_kwargs, build_parser

    parser = build_parser()
    assert _engine_kwargs(parser.parse_args([*command, "--batch-invariant"]))["batch_invariant"] is True
    assert _engine_kwargs(parser.parse_args([*command, "--no-batch-invariant"]))["batch_invariant"] is False
    # left out: not passed, EngineConfig's None ("auto"), which resolve_config resolves
    assert "batch_invariant" not in _engine_kwargs(parser.parse_args(command))


def test_auto_turns_the_mode_on_where_it_can_and_off_where_it_cannot() -> None:
    """The default (None) resolves once, in resolve_config: on for the bundled model on the CPU (this build's
    kernels loaded), off, with no error, for each configuration that True refuses."""
    from pagedllm.config import EngineConfig as Config
    from pagedllm.loader import bundled_model_path
    from pagedllm.resolved_config import resolve_config

    def EngineConfig(**kwargs: object) -> object:  # noqa: N802 (reads as the config it resolves)
        return resolve_config(Config(**kwargs))

    assert EngineConfig(model=bundled_model_path()).batch_invariant is True
    assert EngineConfig(model=bundled_model_path(), dtype="bfloat16").batch_invariant is True
    assert EngineConfig(model=bundled_model_path(), batch_invariant=False).batch_invariant is False
    # two ranks sum each element once (either order, the same bits); three only through shared memory
    assert EngineConfig(model=bundled_model_path(), tensor_parallel_size=2).batch_invariant is True
    assert EngineConfig(model=bundled_model_path(), tensor_parallel_size=3, all_reduce_backend="shm",
                        max_num_batched_tokens=256).batch_invariant is True
    # the file's blocks and weight-only int8/int4, on either activations, sum a row alike alone or in a batch
    for kwargs in ({"gguf_activations": "float32"}, {"quantization": "int8"},
                   {"quantization": "int4", "gguf_activations": "float32"}):
        assert EngineConfig(model=bundled_model_path(), **kwargs).batch_invariant is True, kwargs
    for kwargs in ({"attention_backend": "sdpa"}, {"linear_backend": "onednn"},
                   {"dtype": "float16"}, {"tensor_parallel_size": 3}):
        assert EngineConfig(model=bundled_model_path(), **kwargs).batch_invariant is False, kwargs


def test_metrics_and_env_report_the_mode() -> None:
    from prometheus_client import generate_latest

    from pagedllm.clients.metrics import ServerMetrics
    from pagedllm.entrypoints.env_report import collect

    metrics = ServerMetrics("m")
    metrics.batch_invariant.set(1)  # as update_from_engine sets it from engine.config.batch_invariant
    assert 'pagedllm:batch_invariant{model_name="m"} 1.0' in generate_latest(metrics.registry).decode()
    assert collect()["batch_invariant"]["default"] == "auto"
