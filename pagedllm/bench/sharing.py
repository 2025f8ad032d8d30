"""``pagedllm bench sharing``: n samples of long prompts, with and without block sharing.

The same workload runs twice on one engine:

- **sharing**: one request per prompt with ``SamplingParams(n=N)``. The
  prompt is prefilled once; the N samples fork its block table (reference
  counts, no copy) and copy only the block they write into (copy-on-write).
- **no sharing**: N independent requests per prompt, each ``n=1``. Prefix
  caching is off for the whole benchmark (``enable_prefix_caching=False``),
  so nothing is shared in this run: every request prefills and holds its own
  copy of the prompt's blocks.

Prompts are random token ids (no tokenizer involved), sampled at
temperature 1 with a per-request seed, EOS ignored, so every sample produces
exactly ``--output-len`` tokens in both runs. Reported per run: peak KV
blocks in use (``LLMEngine.peak_used_blocks``) and their bytes, prompt
tokens actually computed, output tokens/s, elapsed time; then the ratios.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time

from pagedllm.bench.workload import TOKEN_ID_HIGH, TOKEN_ID_LOW


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=512, help="tokens per prompt")
    p.add_argument("--output-len", type=int, default=32, help="tokens per sample")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--workload-seed", type=int, default=1234, help="seed of the random prompts")
    p.add_argument("--seed", type=int, default=0, help="base sampling seed (request i gets seed + i)")
    p.add_argument("--json", action="store_true", help="end with one JSON line of results")


def make_prompts(num_prompts: int, prompt_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(TOKEN_ID_LOW, TOKEN_ID_HIGH) for _ in range(prompt_len)] for _ in range(num_prompts)]


def _run(llm, prompts: list[list[int]], params: list) -> dict:  # noqa: ANN001
    engine = llm.llm_engine
    bm = engine.block_manager
    engine.peak_used_blocks = 0
    prefilled0 = engine.num_prompt_tokens_computed
    copies0 = bm.num_cow_copies
    preempt0 = engine.scheduler.num_preemptions
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
    if bm.num_free_blocks != bm.num_blocks:
        raise RuntimeError("blocks are still held after the run")
    return {
        "requests": len(prompts),
        "sequences": sum(len(o.outputs) for o in outs),
        "output_tokens": num_out,
        "prompt_tokens_computed": engine.num_prompt_tokens_computed - prefilled0,
        "elapsed_s": round(elapsed, 3),
        "output_tokens_per_s": round(num_out / elapsed, 2),
        "peak_kv_blocks_used": engine.peak_used_blocks,
        "peak_kv_mib": round(engine.peak_used_blocks * engine.model_runner.kv_bytes_per_block / 2**20, 1),
        "cow_copies": bm.num_cow_copies - copies0,
        "preemptions": engine.scheduler.num_preemptions - preempt0,
    }


def run(args: argparse.Namespace, engine_kwargs: dict) -> dict:
    from pagedllm.engine.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    for name in ("num_prompts", "prompt_len", "output_len", "n"):
        if getattr(args, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(args, name)}")
    prompts = make_prompts(args.num_prompts, args.prompt_len, args.workload_seed)
    kwargs = dict(engine_kwargs)
    kwargs["enable_prefix_caching"] = False  # the unshared run must share nothing
    bs = kwargs.get("block_size") or 16
    if kwargs.get("num_kv_blocks") is None and kwargs.get("kv_cache_memory_bytes") is None:
        # room for every sequence of the unshared run at full length: no preemption in either run
        per_seq = -(-(args.prompt_len + args.output_len) // bs)
        kwargs["num_kv_blocks"] = args.num_prompts * args.n * per_seq + 16
    if kwargs.get("max_model_len") is None:
        kwargs["max_model_len"] = args.prompt_len + args.output_len
    llm = LLM(args.model, **kwargs)
    # steady state, as a server runs: the decode step is traced now (a short offline run would not trace it,
    # EngineConfig.capture_min_decode_steps), outside the measurement
    llm.llm_engine.model_runner.warm_up()
    engine = llm.llm_engine
    # warm-up: first calls pay for allocator and kernel set-up
    llm.generate([{"prompt_token_ids": prompts[0][:32]}], SamplingParams(max_tokens=4, n=2), use_tqdm=False)

    common = dict(temperature=1.0, max_tokens=args.output_len, ignore_eos=True)
    shared = _run(llm, prompts, [SamplingParams(n=args.n, seed=args.seed + i, **common) for i in range(len(prompts))])
    unshared_prompts = [p for p in prompts for _ in range(args.n)]
    unshared = _run(
        llm, unshared_prompts, [SamplingParams(n=1, seed=args.seed + i, **common) for i in range(len(unshared_prompts))]
    )
    expected = args.num_prompts * args.n * args.output_len
    for name, r in (("sharing", shared), ("no sharing", unshared)):
        if r["output_tokens"] != expected:
            raise RuntimeError(f"{name}: generated {r['output_tokens']} tokens, expected {expected}")

    result = {
        "engine": "pagedllm",
        "model": engine.config.model,
        "num_prompts": args.num_prompts,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "n": args.n,
        "block_size": engine.config.block_size,
        "num_kv_blocks": engine.block_manager.num_blocks,
        "kv_bytes_per_block": engine.model_runner.kv_bytes_per_block,
        "prefix_caching": False,
        "sharing": shared,
        "no_sharing": unshared,
        "peak_blocks_ratio": round(unshared["peak_kv_blocks_used"] / shared["peak_kv_blocks_used"], 2),
        "throughput_ratio": round(shared["output_tokens_per_s"] / unshared["output_tokens_per_s"], 2),
        "elapsed_ratio": round(unshared["elapsed_s"] / shared["elapsed_s"], 2),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
    }
    print(
        f"{args.num_prompts} prompts x {args.prompt_len} tokens, n={args.n}, {args.output_len} output tokens "
        f"per sample (temperature 1, EOS ignored); block_size {result['block_size']}, "
        f"{result['num_kv_blocks']} KV blocks; prefix caching off"
    )
    labels = (f"sharing (n={args.n} per request)", f"no sharing ({args.n} x n=1)")
    for label, r in zip(labels, (shared, unshared)):
        print(
            f"  {label:28s} peak KV blocks {r['peak_kv_blocks_used']:5d} ({r['peak_kv_mib']} MiB), "
            f"prompt tokens computed {r['prompt_tokens_computed']:6d}, {r['output_tokens']} output tokens in "
            f"{r['elapsed_s']:.2f}s = {r['output_tokens_per_s']:.1f} tok/s, CoW copies {r['cow_copies']}, "
            f"preemptions {r['preemptions']}"
        )
    print(
        f"  sharing holds {result['peak_blocks_ratio']}x fewer blocks at peak and runs "
        f"{result['throughput_ratio']}x the output tokens/s"
    )
    if args.json:
        print(json.dumps(result))
    return result
