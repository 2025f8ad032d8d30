"""``pagedllm bench throughput``: offline requests/s and tokens/s."""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import time

from pagedllm.bench.workload import make_workload, throughput_record

# --structured: one JSON schema on every request. The string cannot be closed within the
# workload's outputs (a token is at most ~80 characters), so every request still produces
# exactly its output_len tokens, each sampled under a mask (nearly every token is allowed
# inside a string, so the model's greedy choices stay much the same)
BENCH_SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 100_000}},
    "required": ["text"],
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-len", type=int, default=32, help="shortest prompt and output, tokens")
    p.add_argument("--max-len", type=int, default=256, help="longest prompt and output, tokens")
    p.add_argument("--workload-seed", type=int, default=1234)
    p.add_argument("--json", action="store_true", help="print one JSON line of results per engine")
    p.add_argument(
        "--structured", action="store_true",
        help="put a JSON schema (structured outputs) on every request; the outputs keep their lengths",
    )
    p.add_argument(
        "--compare", action="append", default=[], choices=["transformers", "transformers-padded", "transformers-cb"],
        help="also run a peer on the same workload in this process: transformers' padded generate "
        "(transformers-padded), its continuous batching (transformers-cb), or both (transformers)",
    )
    p.add_argument("--peer-batch-size", type=int, default=16, help="batch size of transformers' padded generate")
    p.add_argument(
        "--peer-model", default=None,
        help="what the transformers peers load: a .gguf or a Hugging Face folder, e.g. the float32 folder that "
        "benchmarks/peers/prepare.py writes (default: --model, the GGUF dequantized in process)",
    )


def run(args: argparse.Namespace, engine_kwargs: dict) -> dict:
    from pagedllm.engine.llm import LLM
    from pagedllm.expert_counts import load_summary
    from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

    if args.structured and args.compare:
        raise ValueError("--structured measures pagedllm alone: the peers take no constraint")
    if args.peer_model is not None and not args.compare:
        raise ValueError("--peer-model is what the --compare peers load; give --compare too")
    if args.peer_model is not None and not os.path.exists(args.peer_model):
        raise ValueError(f"--peer-model {args.peer_model!r} does not exist")
    workload = make_workload(args.num_requests, args.min_len, args.max_len, args.workload_seed)
    llm = LLM(args.model, **engine_kwargs)
    # steady state, as a server runs: the decode step is traced now (a short offline run would not trace it,
    # EngineConfig.capture_min_decode_steps), outside the measurement
    llm.llm_engine.model_runner.warm_up()
    constraint = StructuredOutputsParams(json=BENCH_SCHEMA) if args.structured else None
    # warm-up: first calls pay for allocator and kernel set-up (and the schema's one compile)
    llm.generate([{"prompt_token_ids": workload[0].prompt_token_ids}],
                 SamplingParams(max_tokens=4, structured_outputs=constraint), use_tqdm=False)
    engine = llm.llm_engine
    engine.peak_used_blocks = 0
    expert_load = engine.model_runner.expert_load  # a mixture of experts: its routing, counted from here
    if expert_load is not None:
        expert_load.reset()

    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload]
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True, structured_outputs=constraint)
              for r in workload]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=not args.json)
    elapsed = time.perf_counter() - start

    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    expected_out = sum(r.output_len for r in workload)
    if num_out != expected_out:
        raise RuntimeError(f"generated {num_out} tokens, the workload asks for {expected_out}")
    result = throughput_record(
        "pagedllm", workload, elapsed,
        num_kv_blocks=engine.block_manager.num_blocks,
        peak_kv_blocks_used=engine.peak_used_blocks,
        num_preemptions=engine.scheduler.num_preemptions,
        structured=args.structured,
        machine=f"{platform.machine()} {platform.processor() or ''}".strip(),
    )
    num_prompt = result["prompt_tokens"]
    print(
        f"{result['num_requests']} requests, {num_prompt} prompt + {num_out} output tokens in "
        f"{elapsed:.2f}s: {result['requests_per_s']:.2f} req/s, {result['output_tokens_per_s']:.1f} "
        f"output tok/s, {result['total_tokens_per_s']:.1f} total tok/s; peak KV blocks "
        f"{engine.peak_used_blocks}/{engine.block_manager.num_blocks}"
    )
    if expert_load is not None:
        result["expert_load"] = load_summary(expert_load.counts())
        print(expert_load_line(result["expert_load"]))
    if args.json:
        print(json.dumps(result))
    # the peers get the machine to themselves: our weights and KV cache go first
    del llm, engine, outs
    gc.collect()
    peers = _run_peers(args, workload)
    for peer in peers:
        ratio = result["output_tokens_per_s"] / peer["output_tokens_per_s"]
        peer["pagedllm_speedup"] = round(ratio, 2)
        print(
            f"{peer['engine']}: {peer['output_tokens_per_s']:.1f} output tok/s in {peer['elapsed_s']:.1f}s; "
            f"pagedllm is {ratio:.2f}x"
        )
        if args.json:
            print(json.dumps(peer))
    result["peers"] = peers
    return result


def _run_peers(args: argparse.Namespace, workload: list) -> list[dict]:
    wanted = set()
    for name in args.compare:
        wanted |= {"transformers-padded", "transformers-cb"} if name == "transformers" else {name}
    if not wanted:
        return []
    from pagedllm.bench import transformers_peer
    from pagedllm.loader import resolve_model_path

    path = args.peer_model if args.peer_model is not None else resolve_model_path(args.model)
    model = transformers_peer.load_model(path)
    peers = []
    if "transformers-padded" in wanted:
        peers.append(transformers_peer.run_padded(model, workload, args.peer_batch_size))
    if "transformers-cb" in wanted:
        peers.append(transformers_peer.run_continuous(model, workload))
    for peer in peers:
        peer["model"] = path
    return peers


def expert_load_line(summary: dict[str, float]) -> str:
    """The bench's line on a mixture of experts' routing (``pagedllm.expert_counts.load_summary``)."""
    return (f"expert load over {summary['num_steps']} steps: tokens per expert per step mean {summary['mean']:.2f}, "
            f"max {summary['max']:.2f}, imbalance (max/mean) {summary['imbalance']:.2f}")
