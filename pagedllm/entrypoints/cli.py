"""``pagedllm generate | chat | serve | env | bench {throughput, latency, sharing, serve, memory}``."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import threading
import time
from typing import TYPE_CHECKING, get_args

from pagedllm.config import KvCacheDtype
from pagedllm.runner.grammar_limits import GrammarLimits
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.entrypoints.openai.http_protocol import HTTPLimits
    from pagedllm.entrypoints.openai.settings import ServerSettings


def _itl_target(text: str) -> float | str | None:
    """``--itl-target-ms``: "auto", "off" or a positive number of milliseconds."""
    if text in ("auto", "off"):
        return None if text == "off" else text
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected auto, off or a positive number of milliseconds, got {text!r}")
    return value


def _engine_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="a .gguf file or a Hugging Face folder (default: bundled SmolLM2)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=128)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument(
        "--itl-target-ms", type=_itl_target, default="auto",
        help="while sequences decode, a step takes only the prompt tokens that fit this latency target by the "
             "measured step costs (a long prompt prefills in shorter steps); auto (default): 4x the decodes' own "
             "step; off: up to --max-num-batched-tokens",
    )
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--kv-allocator", default="paged", choices=["paged", "contiguous"])
    g.add_argument("--contiguous-reserve", default="max_tokens", choices=["max_tokens", "max_model_len"])
    g.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
        help="float32 (default); bfloat16 on the CPU: bf16 weights and matmuls around float32 "
        "activations, a bf16 KV cache (fast with AVX512-BF16)",
    )
    g.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    g.add_argument(
        "--kv-cache-dtype", default="auto", choices=list(get_args(KvCacheDtype)),
        help="what the KV cache stores (auto: --dtype, float16 where GGUF blocks are kept); 2-byte caches halve "
             "the bytes decode attention reads; "
             "the quantized ones (CPU) hold one scale per token and KV head: see docs/configuration.md",
    )
    g.add_argument("--attention-backend", default="auto", choices=["auto", "cpu_paged", "sdpa", "reference"])
    g.add_argument("--num-threads", type=int, default=None)
    g.add_argument(
        "--quantization", default=None, choices=["none", "int8", "int4"],
        help="default: a GGUF file's blocks kept as stored; none: every weight in --dtype; "
             "int8 / int4: weight-only, rounded at load in groups of --quantization-group-size (CPU, float32)",
    )
    g.add_argument(
        "--quantization-group-size", type=int, default=None,
        help="weights per group of int8 / int4, a multiple of 32 (default: 128 for int4, per channel for int8)",
    )
    g.add_argument(
        "--gguf-activations", default="int8", choices=["int8", "float32"],
        help="int8: layers in quantized blocks (GGUF's, --quantization int8/int4) multiply 8-bit activations with "
             "integer dot products (llama.cpp's way, fast); float32: float activations, as transformers computes",
    )
    g.add_argument("--linear-backend", default="auto", choices=["auto", "packed", "onednn", "torch"])
    g.add_argument(
        "--enforce-eager", action="store_true",
        help="run every step through the model's modules (no replay of captured decode steps)",
    )
    g.add_argument(
        "--capture-min-decode-steps", type=int, default=512,
        help="trace the decode step once the requests may still decode this many steps (0: at the first "
             "decode step; the server captures at start); the trace takes seconds and pays after hundreds of steps",
    )
    g.add_argument(
        "--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
        help="a request's tokens and logprobs are bitwise the same whatever else runs with it (its batch, "
             "chunking, prefix-cache hits, preemption; docs/batch-invariance.md); default: on wherever the "
             "kernels allow it (CPU, one or two ranks, float32/bfloat16, the native kernels), off elsewhere; "
             "--no-batch-invariant turns it off",
    )
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="processes the model is split over (Megatron-style; gloo on the CPU)")
    g.add_argument("--distributed-executor-backend", default="auto", choices=["auto", "mp", "torchrun"],
                   help="auto: torchrun inside a torchrun launch, else mp (this process spawns the ranks)")
    g.add_argument("--cpu-bind", default=None, help="cores of each tensor-parallel rank, e.g. '0-3|4-7'")
    g.add_argument("--distributed-timeout-s", type=float, default=120.0,
                   help="longest wait in one collective before the engine stops with an error")
    g.add_argument("--all-reduce-backend", default="auto", choices=["auto", "shm", "gloo"],
                   help="auto: shared memory between ranks of one machine (steps up to 256 tokens), else gloo")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, vLLM\'s keys, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_min": 1, "prompt_lookup_max": 4}\' or \'{"method": "suffix"}\' '
                        '(docs/speculative-decoding.md)')
    _grammar_arguments(p)


def _grammar_arguments(p: argparse.ArgumentParser) -> None:
    """``--grammar-*``: the limits of one structured-output constraint (``GrammarLimits``)."""
    g = p.add_argument_group("structured outputs (limits of one constraint; over one is a 400)")
    d = GrammarLimits()
    g.add_argument("--grammar-max-bytes", type=int, default=d.max_bytes,
                   help="a schema (as JSON), regex, grammar or choice list, in bytes")
    g.add_argument("--grammar-max-num-entries", type=int, default=d.max_num_entries,
                   help="enum values, consts and choices, counted together")
    g.add_argument("--grammar-max-depth", type=int, default=d.max_depth, help="JSON nesting of a schema")
    g.add_argument("--grammar-max-num-properties", type=int, default=d.max_num_properties,
                   help="object properties over a whole schema")
    g.add_argument("--grammar-compile-timeout-s", type=float, default=d.compile_timeout_s,
                   help="a compile is killed past this")
    g.add_argument("--grammar-compile-memory-bytes", type=int, default=d.compile_memory_bytes,
                   help="memory a compile may allocate (its worker process is limited to it)")
    g.add_argument("--grammar-max-num-compiles", type=int, default=d.max_num_compiles,
                   help="compiles at once, each in a worker process; more wait")
    g.add_argument("--grammar-cache-bytes", type=int, default=d.cache_bytes,
                   help="compiled grammars kept for reuse, in bytes")


def _sampling_arguments(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.7)
    g.add_argument("--top-p", type=float, default=0.9)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def _engine_kwargs(args: argparse.Namespace) -> dict:
    kwargs = dict(
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        itl_target_ms=args.itl_target_ms,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=False if args.no_prefix_caching else None,
        kv_allocator=args.kv_allocator,
        contiguous_reserve=args.contiguous_reserve,
        dtype=args.dtype,
        device=args.device,
        kv_cache_dtype=args.kv_cache_dtype,
        attention_backend=args.attention_backend,
        num_threads=args.num_threads,
        quantization=args.quantization,
        quantization_group_size=args.quantization_group_size,
        gguf_activations=args.gguf_activations,
        linear_backend=args.linear_backend,
        enforce_eager=args.enforce_eager,
        batch_invariant=args.batch_invariant,
        capture_min_decode_steps=args.capture_min_decode_steps,
        tensor_parallel_size=args.tensor_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend,
        cpu_bind=args.cpu_bind,
        distributed_timeout_s=args.distributed_timeout_s,
        all_reduce_backend=args.all_reduce_backend,
        # JSON text: EngineConfig parses and validates it (ValueError for a bad method or value)
        speculative_config=args.speculative_config,
        grammar_limits=GrammarLimits(
            max_bytes=args.grammar_max_bytes, max_num_entries=args.grammar_max_num_entries,
            max_depth=args.grammar_max_depth, max_num_properties=args.grammar_max_num_properties,
            compile_timeout_s=args.grammar_compile_timeout_s,
            compile_memory_bytes=args.grammar_compile_memory_bytes,
            max_num_compiles=args.grammar_max_num_compiles, cache_bytes=args.grammar_cache_bytes,
        ),
    )
    return kwargs


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        max_tokens=args.max_tokens, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from pagedllm import LLM

    params = _sampling_params(args)
    llm = LLM(args.model, **_engine_kwargs(args))
    engine = llm.llm_engine
    start = time.perf_counter()
    show_bar = len(args.prompts) > 1
    if args.chat:
        conversations = [[{"role": "user", "content": p}] for p in args.prompts]
        outs = llm.chat(conversations, params, use_tqdm=show_bar)
    else:
        outs = llm.generate(list(args.prompts), params, use_tqdm=show_bar)
    elapsed = time.perf_counter() - start
    llm.shutdown()  # tensor-parallel ranks leave now (under torchrun: on every node)
    num_tokens = 0
    for prompt, out in zip(args.prompts, outs):  # outputs come in prompt order
        print(f"\n=== prompt: {prompt!r}")
        for c in out.outputs:
            num_tokens += len(c.token_ids)
            label = f"[{c.index}] " if len(out.outputs) > 1 else ""
            print(f"{label}{c.text}")
            print(f"    ({len(c.token_ids)} tokens, finish_reason={c.finish_reason})")
    bm = engine.block_manager
    print(
        f"\n{len(outs)} prompts, {num_tokens} output tokens in {elapsed:.2f}s "
        f"({num_tokens / elapsed:.1f} tokens/s); KV blocks: peak {engine.peak_used_blocks} used of "
        f"{bm.num_blocks} (block_size {bm.block_size}), {bm.num_used_blocks} held now"
    )
    spec = engine.speculator
    if spec is not None:
        from pagedllm.engine.request import spec_decode_rates

        rate, length = spec_decode_rates(spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens)
        print(f"speculative decoding: {spec.num_accepted_tokens} of {spec.num_draft_tokens} draft tokens accepted "
              f"({rate or 0.0:.0%}) in {spec.num_drafts} verify steps, mean acceptance length {length or 1.0:.2f}")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from pagedllm import LLM

    if args.n != 1:
        raise ValueError("chat shows one reply per turn; --n must be 1")
    params = _sampling_params(args)
    llm = LLM(args.model, **_engine_kwargs(args))
    engine = llm.llm_engine
    tokenizer = engine.tokenizer
    # a session decodes many replies: the decode step is traced (seconds) while the user types the first
    # message, as a server traces before its first request; joined before the first step
    tracing = threading.Thread(target=engine.model_runner.warm_up, name="decode-trace", daemon=True)
    tracing.start()
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print("pagedllm chat: type a message, /reset to forget, /exit or Ctrl-D to quit.", flush=True)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        line = line.strip()
        if not line:
            continue
        if line == "/exit":
            return 0
        if line == "/reset":
            history = history[:1] if args.system else []
            continue
        history.append({"role": "user", "content": line})
        text = tokenizer.apply_chat_template(history)
        ids = tokenizer.encode(text, add_special_tokens=False)
        rid = engine.new_request_id()
        tracing.join()
        try:
            engine.add_request(rid, {"prompt": text, "prompt_token_ids": ids}, params)
        except ValueError as e:
            # e.g. the conversation outgrew max_model_len: say so, keep the session
            print(f"error: {e}; /reset starts a new conversation", flush=True)
            history.pop()
            continue
        shown = 0
        reply = ""
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    reply = out.outputs[0].text
                    print(reply[shown:], end="", flush=True)
                    shown = len(reply)
        except KeyboardInterrupt:
            engine.abort_request(rid)
        print(flush=True)
        history.append({"role": "assistant", "content": reply})


def cmd_bench(args: argparse.Namespace) -> int:
    from pagedllm.bench import throughput

    if args.bench_command == "throughput":
        throughput.run(args, _engine_kwargs(args))
    return 0


def cmd_bench_latency(args: argparse.Namespace) -> int:
    """``pagedllm bench latency``: time to first token and decode tokens/s at a fixed batch size."""
    from pagedllm.bench import latency

    latency.run(args, _engine_kwargs(args))
    return 0


def cmd_bench_memory(args: argparse.Namespace) -> int:
    """``pagedllm bench memory``: the contiguous baseline against paging, same KV slots."""
    from pagedllm.bench import memory

    memory.run(args)
    return 0


def cmd_bench_sharing(args: argparse.Namespace) -> int:
    """``pagedllm bench sharing``: n samples with copy-on-write sharing vs n independent requests."""
    from pagedllm.bench import sharing

    sharing.run(args, _engine_kwargs(args))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """Start the OpenAI-compatible server (``pagedllm serve [MODEL]``)."""
    import logging

    from pagedllm import LLM
    from pagedllm.entrypoints.openai.api_server import (
        ServerSettings,
        default_model_name,
        run_server,
    )

    if args.model_pos is not None and args.model is not None and args.model_pos != args.model:
        raise ValueError("give the model either as an argument or with --model, not both")
    # the server's own flags are checked before the model loads
    if args.max_waiting is not None and args.max_waiting < 1:
        raise ValueError(f"--max-waiting must be >= 1, got {args.max_waiting}")
    if args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    http_limits = _http_limits(args)
    if args.replica_heartbeat_timeout is not None:
        from pagedllm.clients.data_parallel.replica_client import check_heartbeat_timeout

        if args.data_parallel_size == 1:
            raise ValueError("--replica-heartbeat-timeout needs --data-parallel-size > 1 (one engine has no replicas)")
        check_heartbeat_timeout(args.replica_heartbeat_timeout)
    settings = ServerSettings(
        model_name=args.served_model_name or "",
        api_key=args.api_key or None,
        max_waiting=args.max_waiting,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        max_request_bytes=args.max_request_bytes,
        allowed_hosts=_comma_list(args.allowed_hosts),
        allowed_origins=_comma_list(args.allowed_origins),
        tool_call_parser=args.tool_call_parser,
        kv_page=not args.no_kv_page,
        http_limits=http_limits,
        default_max_tokens=args.default_max_tokens,
        stream_write_timeout_s=_stream_write_timeout(args.stream_write_timeout),
    )
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.data_parallel_size > 1:
        return _serve_data_parallel(args, settings)
    llm = LLM(args.model_pos or args.model, seed=args.seed, **_engine_kwargs(args))
    engine = llm.llm_engine
    settings = dataclasses.replace(
        settings, model_name=settings.model_name or default_model_name(engine.config.model),
        model_path=engine.config.model,
    )
    try:
        run_server(engine, settings)
    finally:
        engine.shutdown()
    return 0


def _serve_data_parallel(args: argparse.Namespace, settings: ServerSettings) -> int:
    """``pagedllm serve --data-parallel-size N`` (N > 1): the replicas load the model, this process does not."""
    from pagedllm.engine.llm import make_engine_config
    from pagedllm.entrypoints.openai.api_server import default_model_name, run_dp_server

    config = make_engine_config(args.model_pos or args.model, seed=args.seed, **_engine_kwargs(args))
    settings = dataclasses.replace(
        settings, model_name=settings.model_name or default_model_name(config.model), model_path=config.model,
    )
    if args.replica_heartbeat_timeout is None:
        run_dp_server(config, settings, args.data_parallel_size)
    else:
        run_dp_server(config, settings, args.data_parallel_size, args.replica_heartbeat_timeout)
    return 0


def _http_limits(args: argparse.Namespace) -> HTTPLimits:
    """``--header-timeout``, ``--max-header-connections``, ``--linger-timeout``, ``--max-linger-bytes``."""
    from pagedllm.entrypoints.openai.http_protocol import HTTPLimits

    finite = float("inf")
    if not 0 < args.header_timeout < finite:
        raise ValueError(f"--header-timeout must be a number of seconds > 0, got {args.header_timeout}")
    if args.max_header_connections < 1:
        raise ValueError(f"--max-header-connections must be >= 1, got {args.max_header_connections}")
    if not 0 <= args.linger_timeout < finite:
        raise ValueError(f"--linger-timeout must be a number of seconds >= 0, got {args.linger_timeout}")
    if args.max_linger_bytes < 0:
        raise ValueError(f"--max-linger-bytes must be >= 0, got {args.max_linger_bytes}")
    return HTTPLimits(args.header_timeout, args.max_header_connections, args.linger_timeout, args.max_linger_bytes)


def _stream_write_timeout(seconds: float) -> float | None:
    """``--stream-write-timeout``: seconds, or None for 0 (no bound)."""
    if not 0 <= seconds < float("inf"):
        raise ValueError(f"--stream-write-timeout must be a number of seconds >= 0, got {seconds}")
    return seconds or None


def _comma_list(value: str | None) -> list[str] | None:
    """``"a,b"`` -> ``["a", "b"]``; None stays None."""
    if value is None:
        return None
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items:
        raise ValueError(f"expected a comma-separated list, got {value!r}")
    return items


def _serve_arguments(p: argparse.ArgumentParser) -> None:
    from pagedllm.entrypoints.openai import http_protocol as hp
    from pagedllm.entrypoints.openai.guards import DEFAULT_MAX_REQUEST_BYTES
    from pagedllm.entrypoints.openai.sse import DEFAULT_STREAM_WRITE_TIMEOUT_S

    p.add_argument("model_pos", nargs="?", default=None, metavar="MODEL",
                   help="a .gguf file or a Hugging Face folder (default: bundled SmolLM2)")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", default=None,
                   help="the name clients pass as 'model' (default: the model's file or folder name)")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health, /metrics, "
                        "/openapi.json, /docs and the /kv page's")
    g.add_argument("--max-waiting", type=int, default=1024,
                   help="most requests waiting for their first token; past it new requests get 429")
    g.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help=f"largest request body; larger ones get 413 unread (default {DEFAULT_MAX_REQUEST_BYTES})")
    g.add_argument("--header-timeout", type=float, default=hp.DEFAULT_HEADER_TIMEOUT_S, metavar="SECONDS",
                   help="seconds a connection gets to send its request line and headers, from when it opens (or "
                        "its next request's first byte); then it is closed, with a 408 if it sent any "
                        f"(default {hp.DEFAULT_HEADER_TIMEOUT_S:g})")
    g.add_argument("--max-header-connections", type=int, default=hp.DEFAULT_MAX_HEADER_CONNECTIONS, metavar="N",
                   help="most connections sending their headers at once; past it a new one closes the one waiting "
                        f"longest (if it waited {hp.MIN_EVICTABLE_S:g} s) (default {hp.DEFAULT_MAX_HEADER_CONNECTIONS})")
    g.add_argument("--linger-timeout", type=float, default=hp.DEFAULT_LINGER_TIMEOUT_S, metavar="SECONDS",
                   help="after an answer sent before the body was read (413), the most seconds the rest of the "
                        "body is read and discarded before the connection closes, so the client can read the "
                        f"answer; 0: close at once (default {hp.DEFAULT_LINGER_TIMEOUT_S:g})")
    g.add_argument("--max-linger-bytes", type=int, default=hp.DEFAULT_MAX_LINGER_BYTES, metavar="N",
                   help="the most bytes discarded so; 0: close at once "
                        f"(default {hp.DEFAULT_MAX_LINGER_BYTES})")
    g.add_argument("--stream-write-timeout", type=float, default=DEFAULT_STREAM_WRITE_TIMEOUT_S, metavar="SECONDS",
                   help="the most seconds one write of a streamed answer may wait for a client that reads nothing; "
                        "then the stream ends, its request is aborted and its KV blocks freed (counted in "
                        f"pagedllm:stream_write_timeouts_total); 0: no bound (default {DEFAULT_STREAM_WRITE_TIMEOUT_S:g})")
    g.add_argument("--allowed-hosts", default=None, metavar="NAMES",
                   help="comma-separated Host names accepted besides loopback ones ('*': any); "
                        "bound to loopback, other names are refused (DNS rebinding)")
    g.add_argument("--allowed-origins", default=None, metavar="ORIGINS",
                   help="comma-separated origins browsers may call from (CORS); default: none")
    g.add_argument("--tool-call-parser", default="auto", choices=["auto", "hermes", "llama3_json"],
                   help="the model's tool-call format for tool_choice 'auto' (default: read from the chat template)")
    g.add_argument("--default-max-tokens", type=int, default=None, metavar="N",
                   help="most tokens a reply gets when the request sets no max_tokens / max_completion_tokens "
                        "(chat; completions' max_tokens: null); a request's own value is never changed "
                        "(default: no cap, replies may run to the end of the context, as in OpenAI and vLLM)")
    g.add_argument("--no-kv-page", action="store_true",
                   help="do not serve the live KV-cache page (/kv, /kv/state, /kv/events)")
    g.add_argument("--seed", type=int, default=0, help="engine seed for requests that bring none")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="N",
                   help="N engine processes (replicas) behind this server; a request goes to the replica with "
                        "the longest cached prefix of its prompt, else the least loaded (default 1: one engine "
                        "in this process). Without --num-threads each gets cores // N threads, pinned")
    g.add_argument("--replica-heartbeat-timeout", type=float, default=None, metavar="SECONDS",
                   help="with --data-parallel-size: a replica that sends nothing, heartbeats included, for this "
                        "long is marked down, killed and started again (default 10; at least 1). Heartbeats come "
                        "from a thread of their own, so a long engine step does not delay them")
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def cmd_env(args: argparse.Namespace) -> int:
    """``pagedllm env``: CPU features, torch, the kernels and the backends, for bug reports."""
    from pagedllm.entrypoints import env_report

    report = env_report.collect()
    if args.load:
        from pagedllm import LLM

        llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization,
                  quantization_group_size=args.quantization_group_size, num_kv_blocks=64, max_model_len=512)
        report["loaded"] = env_report.loaded_model_report(llm)
    print(env_report.to_json(report) if args.json else env_report.format_report(report))
    return 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    """``pagedllm bench serve``: streaming clients against a running server."""
    from pagedllm.bench import serve as bench_serve

    bench_serve.run(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description="PagedAttention LLM inference")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate continuations of prompts")
    gen.add_argument("prompts", nargs="+", help="one or more prompts")
    gen.add_argument("--chat", action="store_true", help="send each prompt as a user message (chat template)")
    _engine_arguments(gen)
    _sampling_arguments(gen, max_tokens=64)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat, tokens streamed as they come")
    chat.add_argument("--system", default=None, help="system prompt")
    _engine_arguments(chat)
    _sampling_arguments(chat, max_tokens=256)
    chat.set_defaults(func=cmd_chat)

    env = sub.add_parser("env", help="CPU features, torch, native kernels and layer backends (for bug reports)")
    env.add_argument("--json", action="store_true")
    env.add_argument("--load", action="store_true", help="also load a model and list the layers it runs")
    env.add_argument("--model", default=None, help="the model --load loads (default: bundled SmolLM2)")
    env.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    env.add_argument("--quantization", default=None, choices=["none", "int8", "int4"])
    env.add_argument("--quantization-group-size", type=int, default=None)
    env.set_defaults(func=cmd_env)
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (loopback by default)")
    _serve_arguments(serve)
    _engine_arguments(serve)
    serve.set_defaults(func=cmd_serve)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from pagedllm.bench import throughput

    tp = bench_sub.add_parser("throughput", help="offline throughput on random-token prompts")
    throughput.add_arguments(tp)
    _engine_arguments(tp)
    tp.set_defaults(func=cmd_bench)

    from pagedllm.bench import latency as bench_latency

    lat = bench_sub.add_parser("latency", help="time to first token and decode tokens/s (single sequence or a batch)")
    bench_latency.add_arguments(lat)
    _engine_arguments(lat)
    lat.set_defaults(func=cmd_bench_latency)

    from pagedllm.bench import sharing as bench_sharing

    sh = bench_sub.add_parser(
        "sharing", help="n=8 samples of long prompts: copy-on-write block sharing vs independent requests"
    )
    bench_sharing.add_arguments(sh)
    _engine_arguments(sh)
    sh.set_defaults(func=cmd_bench_sharing)

    from pagedllm.bench import serve as bench_serve

    bs = bench_sub.add_parser(
        "serve", help="concurrent streaming clients against a running server: TTFT, TPOT, ITL, latency"
    )
    bench_serve.add_arguments(bs)
    bs.set_defaults(func=cmd_bench_serve)

    from pagedllm.bench import collectives as bench_collectives

    coll = bench_sub.add_parser("collectives", help="tensor-parallel all-reduce cost (gloo) at a model's hidden size")
    bench_collectives.add_arguments(coll)
    coll.set_defaults(func=lambda args: bench_collectives.run(args) and 0)

    from pagedllm.bench import memory as bench_memory

    mem = bench_sub.add_parser(
        "memory", help="paged vs contiguous KV allocation on one workload: waste, concurrency, throughput"
    )
    bench_memory.add_arguments(mem)
    mem.set_defaults(func=cmd_bench_memory)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
