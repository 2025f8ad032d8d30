"""``pagedllm bench latency``: time to first token and decode tokens/s.

``--batch-size 1`` (the default) is single-sequence latency, the figure
llama.cpp's ``llama-bench`` reports as prefill / decode tokens/s. With a larger
batch, all sequences are prefilled together and then decode in lock step, so
the decode rate is the engine's batched decode throughput; it is also
expressed as GFLOP/s, counting 2 x parameters FLOPs per token (the matmul
work; attention is left out, as in the usual rule of thumb), which can be set
against the machine's matmul rate (an untied embedding table is not counted:
it is looked up, not multiplied).

Each step is timed from the engine's side (``LLMEngine.step``), so the
figures include scheduling, metadata building, the model, sampling and
output processing: everything a user waits for, except tokenization.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from pagedllm.bench.workload import TOKEN_ID_HIGH, TOKEN_ID_LOW
from pagedllm.engine.request import spec_decode_rates


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-size", type=int, default=1, help="sequences decoding together")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per sequence")
    p.add_argument("--output-len", type=int, default=128, help="generated tokens per sequence")
    p.add_argument("--num-iters", type=int, default=3, help="timed repetitions (median reported)")
    p.add_argument("--workload-seed", type=int, default=1234)
    p.add_argument("--json", action="store_true", help="end with one JSON line of results")


def _check(args: argparse.Namespace) -> None:
    for name in ("batch_size", "input_len", "output_len", "num_iters"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.output_len < 2:
        raise ValueError("--output-len must be >= 2 (one prefill token and at least one decode step)")


def spec_counts(spec) -> tuple[int, int, int]:  # noqa: ANN001
    """The speculator's running totals: verify steps, draft tokens, accepted tokens ((0, 0, 0): none)."""
    return (0, 0, 0) if spec is None else (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens)


def spec_summary(before: tuple[int, int, int], after: tuple[int, int, int]) -> dict:
    """vLLM's speculative figures over the timed runs: acceptance rate (accepted / drafted tokens) and mean
    acceptance length (tokens a verify step emits: 1 + its accepted drafts, on average)."""
    num_drafts, num_draft_tokens, num_accepted = (a - b for a, b in zip(after, before))
    rate, length = spec_decode_rates(num_drafts, num_draft_tokens, num_accepted)  # a request's metrics' figures
    return {
        "num_drafts": num_drafts,
        "num_draft_tokens": num_draft_tokens,
        "num_accepted_tokens": num_accepted,
        "acceptance_rate": None if rate is None else round(rate, 3),
        "mean_acceptance_length": None if length is None else round(length, 3),
    }


def _one_run(engine, prompts: list[list[int]], params) -> tuple[float, list[float]]:  # noqa: ANN001
    """Queue the prompts, step to the end; (first-step seconds, later step seconds)."""
    for ids in prompts:
        engine.add_request(engine.new_request_id(), {"prompt_token_ids": ids}, params)
    step_times: list[float] = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - start)
    return step_times[0], step_times[1:]


def run(args: argparse.Namespace, engine_kwargs: dict) -> dict:
    from pagedllm.engine.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    _check(args)
    rng = random.Random(args.workload_seed)
    prompts = [
        [rng.randrange(TOKEN_ID_LOW, TOKEN_ID_HIGH) for _ in range(args.input_len)] for _ in range(args.batch_size)
    ]
    engine_kwargs = dict(engine_kwargs)
    if engine_kwargs.get("max_model_len") is None:
        from pagedllm.loader import load_model_config, resolve_model_path

        model_max = load_model_config(resolve_model_path(args.model)).max_position_embeddings
        engine_kwargs["max_model_len"] = min(model_max, max(2048, args.input_len + args.output_len))
    # every prompt must prefill in the first step for TTFT to mean one thing
    engine_kwargs["max_num_batched_tokens"] = max(
        engine_kwargs.get("max_num_batched_tokens") or 0, args.batch_size * args.input_len, engine_kwargs["max_model_len"]
    )
    engine_kwargs["max_num_seqs"] = max(engine_kwargs.get("max_num_seqs") or 0, args.batch_size)
    # the same prompts run several times: cache hits would fake the prefill time
    engine_kwargs["enable_prefix_caching"] = False
    llm = LLM(args.model, **engine_kwargs)
    # steady state, as a server runs: the decode step is traced now (a short offline run would not trace it,
    # EngineConfig.capture_min_decode_steps), outside the measurement
    llm.llm_engine.model_runner.warm_up()
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)

    _one_run(engine, prompts, params)  # warm-up
    spec = engine.speculator
    spec_before = spec_counts(spec)
    ttfts, decode_rates, step_ms = [], [], []
    for _ in range(args.num_iters):
        first, rest = _one_run(engine, prompts, params)
        # a verify step (speculative decoding) emits one token or more per sequence: fewer steps, not more
        if len(rest) != args.output_len - 1 if spec is None else not 0 < len(rest) <= args.output_len - 1:
            raise RuntimeError(f"expected {args.output_len - 1} decode steps, ran {len(rest)} (preempted?)")
        ttfts.append(first)
        decode_rates.append(args.batch_size * (args.output_len - 1) / sum(rest))
        step_ms.append(1000 * statistics.median(rest))

    # matmul weights: an untied embedding table is only looked up, not multiplied
    mc = engine.model_config
    num_params = engine.model_runner.num_params
    if not mc.tie_word_embeddings:
        num_params -= mc.vocab_size * mc.hidden_size
    ttft, rate = statistics.median(ttfts), statistics.median(decode_rates)
    result = {
        "bench": "latency",
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "ttft_ms": round(1000 * ttft, 2),
        "prefill_tokens_per_s": round(args.batch_size * args.input_len / ttft, 1),
        "decode_tokens_per_s": round(rate, 2),
        "decode_step_ms": round(statistics.median(step_ms), 3),
        "decode_gflops": round(rate * 2 * num_params / 1e9, 2),
        "num_params": num_params,
        "num_iters": args.num_iters,
        "dtype": engine.config.dtype,
        "weight_dtype": engine.model_runner.weight_format,
        "weight_bytes": llm.weight_bytes,
    }
    if spec is not None:
        result["spec_decode"] = spec_summary(spec_before, spec_counts(spec))
        print(f"speculative decoding: {result['spec_decode']}")
    print(
        f"batch {args.batch_size}, {args.input_len} in / {args.output_len} out: TTFT {result['ttft_ms']:.1f} ms "
        f"({result['prefill_tokens_per_s']:.0f} prefill tok/s), decode {rate:.1f} tok/s "
        f"({result['decode_step_ms']:.1f} ms/step, {result['decode_gflops']:.1f} GFLOP/s at 2 x "
        f"{num_params / 1e6:.0f}M params per token)"
    )
    if args.json:
        print(json.dumps(result))
    return result
