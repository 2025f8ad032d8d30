"""Batch invariance (issue 35, docs/batch-invariance.md): a needle request gives the same bits whatever its company.

The needle (a paragraph of the GPL, greedy and seeded, ``logprobs=5``, ``prompt_logprobs=5``) is computed
alone, its whole prompt in one step, in a fresh engine (captured; eager for the weight-only formats); then, with
``batch_invariant=True``, in engines of other chunk sizes (``max_num_batched_tokens`` 16, 64, 2048), captured
and eager: alone, inside batches of random neighbours (compositions drawn by hypothesis), after a prefix-cache
hit and under a pool small enough to preempt it. Each engine kind runs once per kernel path: 16-token chunks
eager (the prompt in chunks, steps mixed with the neighbours' decodes), whole prompts captured (decode steps of
the whole company replayed), 64-token chunks eager under preemption, and, for the weight-only formats, 16-token
chunks captured against an eager reference.
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


def needles_in(llm: LLM, lengths: list[int], positions: tuple[int, int], seed: int) -> dict[bool, tuple]:
    """The fingerprints of the greedy and the seeded needle (keyed by ``seeded``), run in one batch at
    ``positions`` among neighbours of ``lengths``: each needle is the other's company too. Both ask for prompt
    logprobs, so neither takes a prefix hit from the other (every prompt position is computed)."""
    prompts, sps = neighbours(lengths, seed)
    tags: list[bool | None] = [None] * len(prompts)
    for seeded, position in zip((False, True), positions):
        position = min(position, len(prompts))
        prompts.insert(position, NEEDLE)
        sps.insert(position, params(seeded))
        tags.insert(position, seeded)
    outs = llm.generate(prompts, sps, use_tqdm=False)
    return {tag: fingerprint(out) for tag, out in zip(tags, outs) if tag is not None}


@functools.cache
def references(model: str) -> dict[bool, tuple]:
    """The needle alone in a fresh eager engine of a weight-only format, whole prompt in one step (the mode on),
    keyed by ``seeded``: one engine computes them one request at a time, with no prefix caching, so each request
    computes its whole prompt as in an engine of its own."""
    llm = LLM(enforce_eager=True, batch_invariant=True, enable_prefix_caching=False, **COMMON, **ALL_MODELS[model])
    refs = {seeded: fingerprint(llm.generate([NEEDLE], params(seeded), use_tqdm=False)[0]) for seeded in (False, True)}
    assert_idle(llm)
    return refs


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


class WholeEngines:
    """The captured engines of whole prompts (``max_num_batched_tokens=2048``), one per model of ``KV_MODELS``,
    built once per module. Each first computes its model's references: the needle alone, keyed by (seeded,
    prompt logprobs), one request at a time with the prefix cache emptied before each, so each computes its
    whole prompt in one step as in an engine of its own. The engine then serves the needle tests and the
    prefix-hit test, which takes it out at its last use (so the module holds at most three); the references
    stay, for the preemption test. The other engines (eager ones, chunked ones) are held to these references."""

    def __init__(self) -> None:
        self.engines: dict[str, LLM] = {}
        self.refs: dict[str, dict[tuple[bool, bool], tuple]] = {}

    def engine(self, model: str, last_use: bool = False) -> LLM:
        """``make(model, 2048, captured=True)``, its references taken first; checked idle before it is lent."""
        llm = self.engines.pop(model, None) if last_use else self.engines.get(model)
        if llm is None:
            llm = make(model, 2048, captured=True)
            if model not in self.refs:
                self.refs[model] = self._references(llm)
            if not last_use:
                self.engines[model] = llm
        assert_idle(llm)
        return llm

    def reference(self, model: str, seeded: bool, prompt_logprobs: bool = True) -> tuple:
        """The needle's fingerprint alone, its whole prompt computed in one step, in a fresh engine of ``model``."""
        if model not in self.refs:
            self.engine(model, last_use=True)  # built for its references only
        return self.refs[model][seeded, prompt_logprobs]

    @staticmethod
    def _references(llm: LLM) -> dict[tuple[bool, bool], tuple]:
        refs = {}
        for seeded in (False, True):
            for prompt_logprobs in (True, False):  # the prefix-hit test asks for sampled logprobs only
                llm.reset_prefix_cache()
                refs[seeded, prompt_logprobs] = fingerprint(
                    llm.generate([NEEDLE], params(seeded, prompt_logprobs), use_tqdm=False)[0])
        assert_idle(llm)
        return refs


@pytest.fixture(scope="module")
def whole() -> WholeEngines:
    """The module's whole-prompt engines and their references."""
    return WholeEngines()


@pytest.mark.slow
@pytest.mark.parametrize("model", list(MODELS))
# 16-token chunks eager chunk the needle's prompt among the neighbours' steps; whole prompts captured run the
# company's decode steps replayed. 64-token chunks captured showed no more than these two together (most steps
# among neighbours are mixed and run eager); 64-token chunks eager run each model here under preemption below,
# and 16-token chunks captured the weight-only formats.
@pytest.mark.parametrize("chunk, captured", [(16, False), (2048, True)])
def test_the_needle_is_the_same_in_any_company(model: str, chunk: int, captured: bool, whole: WholeEngines) -> None:
    llm = whole.engine(model) if captured else make(model, chunk, captured)
    want = {seeded: whole.reference(model, seeded) for seeded in (False, True)}
    for seeded in (False, True):
        assert fingerprint(llm.generate([NEEDLE], params(seeded), use_tqdm=False)[0]) == want[seeded]

    # the greedy and the seeded needle in one batch of each drawn composition (two compositions, as each needle
    # had on its own): both are checked in every batch
    @settings(max_examples=2, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(lengths=st.lists(st.integers(20, 600), min_size=1, max_size=4),
           positions=st.tuples(st.integers(0, 4), st.integers(0, 5)), seed=st.integers(0, 1000))
    def in_a_batch(lengths: list[int], positions: tuple[int, int], seed: int) -> None:
        assert needles_in(llm, lengths, positions, seed) == want

    in_a_batch()
    assert_idle(llm)


@pytest.mark.slow
@pytest.mark.parametrize("model", list(KV_MODELS))
def test_a_prefix_cache_hit_gives_the_same_bits(model: str, whole: WholeEngines) -> None:
    # prompt logprobs need every prompt position computed, so those requests take no prefix hit: the
    # needle here asks for sampled logprobs only. The rest of the prompt after the hit is computed in one step
    # (it was in an engine of 64-token chunks too), continuing the cached blocks.
    llm = whole.engine(model, last_use=True)
    for seeded in (False, True):
        want = whole.reference(model, seeded, prompt_logprobs=False)
        llm.generate([NEEDLE[:300]], params(seeded, False), use_tqdm=False)  # caches the needle's first blocks
        out = llm.generate([NEEDLE], params(seeded, False), use_tqdm=False)[0]
        assert out.num_cached_tokens > 0
        assert fingerprint(out) == want
    assert_idle(llm)


@pytest.mark.slow
@pytest.mark.parametrize("model", list(KV_MODELS))
def test_a_preempted_needle_gives_the_same_bits(model: str, whole: WholeEngines) -> None:
    # 12 blocks of 16 tokens for the needle (~110 + 8 tokens) and neighbours of ~120 tokens decoding 40 each
    llm = make(model, 64, captured=False, num_kv_blocks=32)
    want = whole.reference(model, True)
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
    blocks interleaved) and on float ones (one row alone dequantized in registers): the needle alone and
    among neighbours, in 16-token chunks with its decode steps captured, bitwise."""
    _check_alone_chunked_and_captured("weight-only " + ", ".join(f"{k}={v}" for k, v in weights.items()))


@pytest.mark.slow
def test_gguf_blocks_on_float_activations_give_the_needle_the_same_bits() -> None:
    """The bundled file's own blocks (Q4_1 + Q8_0) on float activations: a lone decode row dequantizes each
    block in registers in the order a batch's rows sum the dequantized strip, so the needle alone and among
    neighbours, in 16-token chunks with its decode steps captured, gives the same bits."""
    _check_alone_chunked_and_captured("gguf blocks, gguf_activations=float32")


def _check_alone_chunked_and_captured(name: str) -> None:
    """Greedy and seeded: the needle alone and among neighbours, in 16-token chunks with decode steps captured,
    equals the engine's reference for ``name`` bit for bit (one engine serves both). One engine shows what an
    eager 16-token and a captured 64-token engine showed apart: the prompt in chunks, the steps that mix its
    decode rows with the neighbours' chunks run eager, and its decode-only steps, alone and in company, replayed."""
    llm = make(name, 16, captured=True)
    want = references(name)
    for seeded in (False, True):
        assert fingerprint(llm.generate([NEEDLE], params(seeded), use_tqdm=False)[0]) == want[seeded]
    assert needles_in(llm, [300, 40, 500], (1, 3), seed=3) == want  # both needles in one batch
    captured = llm.llm_engine.model_runner.captured_decode  # its decode-only steps did run replayed
    assert captured is not None and captured.failed is None and captured.num_traces >= 1
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
