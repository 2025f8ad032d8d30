"""``pagedllm generate | chat | serve | env | bench {throughput, latency, sharing, serve, memory}``."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING

from pagedllm.c_heap import share_one_arena
from pagedllm.config import EngineConfig
from pagedllm.entrypoints.arg_fields import add_record_arguments, record_kwargs
from pagedllm.sampling_params import SamplingParams, with_defaults

if TYPE_CHECKING:
    from pagedllm.entrypoints.openai.settings import ServerSettings
    from pagedllm.loader.generation_defaults import GenerationDefaults


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


# what the help says where ``LLM`` applies another default than ``EngineConfig``'s
_LLM_DEFAULTS = {
    "model": "the bundled SmolLM2-135M-Instruct",
    "max_model_len": "the model's context length, lowered to what the KV cache holds",
    "fit_max_model_len": "on where --max-model-len is not given",
    "max_num_batched_tokens": "2048 on the CPU, 8192 on a GPU",
}


def _engine_arguments(p: argparse.ArgumentParser) -> None:
    """A flag for every ``EngineConfig`` field, generated from the field (``arg_fields.py``)."""
    g = p.add_argument_group("engine (EngineConfig's fields; docs/configuration.md)")
    flags = add_record_arguments(
        g, EngineConfig,
        # "off" is None on the command line; speculative_config is JSON text, which EngineConfig parses
        parsers={"itl_target_ms": _itl_target, "speculative_config": str},
        defaults=_LLM_DEFAULTS,
        aliases={"tensor_parallel_size": ("-tp",), "enable_prefix_caching": ("--prefix-caching",)},
        taken=lambda flag: flag in p._option_string_actions,
    )
    p.set_defaults(engine_flags=flags, model=None)
    _vllm_engine_arguments(p, g)


def _vllm_engine_arguments(p: argparse.ArgumentParser, g: argparse._ArgumentGroup) -> None:
    """vLLM's routine engine flags that are not ``EngineConfig`` fields: ``--dtype auto``,
    ``--trust-remote-code``, ``--gpu-memory-utilization`` (their meaning: ``engine/vllm_args.py``)."""
    dtype = p._option_string_actions["--dtype"]
    dtype.choices = [*dtype.choices, "auto"]
    g.add_argument("--trust-remote-code", action="store_true", default=argparse.SUPPRESS,
                   help="accepted for vLLM's command lines; pagedllm never runs code from a model repository")
    g.add_argument("--gpu-memory-utilization", type=float, default=argparse.SUPPRESS, metavar="FRACTION",
                   help="share of the free memory the engine may take (weights and KV pool), as vLLM's; sets "
                        "the KV pool's size (default: unset, the default pool)")


# the sampling of generate / chat where neither the command line nor the model (generation_config.json) sets it
_CLI_SAMPLING = {"temperature": 0.7, "top_p": 0.9}
_FROM_MODEL = "the model's generation_config.json, else"


def _sampling_arguments(p: argparse.ArgumentParser, max_tokens: int) -> None:
    """``SamplingParams`` of every prompt (vLLM's names and meanings).

    A flag left out is None: the model's default applies (``--generation-config``), then this command's.
    """
    g = p.add_argument_group("sampling (SamplingParams; a flag left out takes the model's generation_config.json)")
    g.add_argument("--temperature", type=float, default=None,
                   help="randomness of sampling: 0 is greedy, higher flattens the distribution "
                        f"(default: {_FROM_MODEL} {_CLI_SAMPLING['temperature']})")
    g.add_argument("--top-p", type=float, default=None,
                   help="sample from the smallest set of tokens whose probability sums to this "
                        f"(default: {_FROM_MODEL} {_CLI_SAMPLING['top_p']})")
    g.add_argument("--top-k", type=int, default=None,
                   help=f"sample from the k most likely tokens; 0 or -1: all (default: {_FROM_MODEL} 0)")
    g.add_argument("--min-p", type=float, default=None,
                   help=f"drop tokens less likely than this fraction of the most likely one (default: {_FROM_MODEL} 0)")
    g.add_argument("--repetition-penalty", type=float, default=None,
                   help="divide positive logits of tokens already in the prompt or output by this, multiply "
                        f"negative ones (> 1 discourages repeats; default: {_FROM_MODEL} 1)")
    g.add_argument("--max-tokens", type=int, default=None,
                   help=f"most tokens generated per output (default: the model's max_new_tokens, else {max_tokens})")
    p.set_defaults(cli_max_tokens=max_tokens)
    g.add_argument("--seed", type=int, default=None,
                   help="seed of each request's sampling, for reproducible samples (default: unset, the engine's "
                        "stream)")
    g.add_argument("--n", type=int, default=1, help="outputs per prompt (default: %(default)s)")
    g.add_argument("--stop", action="append", default=None,
                   help="stop string, not included in the output (repeatable; default: none)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past the end-of-sequence token, up to --max-tokens (default: off)")


def _engine_kwargs(args: argparse.Namespace) -> dict:
    """The ``EngineConfig`` fields the command line set (the model aside: it is passed on its own); the rest
    keep ``LLM``'s defaults."""
    kwargs = record_kwargs(args, EngineConfig, args.engine_flags)
    kwargs.pop("model", None)
    for name in ("trust_remote_code", "gpu_memory_utilization"):  # vLLM's (_vllm_engine_arguments)
        if hasattr(args, name):
            kwargs[name] = getattr(args, name)
    return kwargs


def _given_sampling(args: argparse.Namespace) -> SamplingParams:
    """The sampling flags given, validated: called before the model loads, so a bad value costs no load."""
    given = {name: getattr(args, name) for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                                                    "max_tokens", "seed", "stop")
             if getattr(args, name) is not None}
    return SamplingParams(n=args.n, ignore_eos=args.ignore_eos, **given)


def _sampling_params(given: SamplingParams, args: argparse.Namespace,
                     model_defaults: GenerationDefaults) -> SamplingParams:
    """The flags given, then the model's defaults for what they leave out, then the command's own."""
    params = model_defaults.apply(given)
    return with_defaults(params, {**_CLI_SAMPLING, "max_tokens": args.cli_max_tokens})


def cmd_generate(args: argparse.Namespace) -> int:
    from pagedllm import LLM

    given = _given_sampling(args)
    llm = LLM(args.model, **_engine_kwargs(args))
    engine = llm.llm_engine
    params = _sampling_params(given, args, engine.generation_defaults)
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
    given = _given_sampling(args)
    llm = LLM(args.model, **_engine_kwargs(args))
    engine = llm.llm_engine
    params = _sampling_params(given, args, engine.generation_defaults)
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
    from pagedllm import LLM
    from pagedllm.entrypoints.openai.api_server import run_server

    if args.model_pos is not None and args.model is not None and args.model_pos != args.model:
        raise ValueError("give the model either as an argument or with --model, not both")
    # the server's own flags, and the port, are checked before the model loads
    settings = _server_settings(args)
    if args.replica_heartbeat_timeout is not None:
        from pagedllm.clients.data_parallel.replica_client import check_heartbeat_timeout

        if args.data_parallel_size == 1:
            raise ValueError("--replica-heartbeat-timeout needs --data-parallel-size > 1 (one engine has no replicas)")
        check_heartbeat_timeout(args.replica_heartbeat_timeout)
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    check_port_free(settings.host, settings.port)
    # uvicorn's "trace" is below logging's levels: debug is the most this process's loggers say
    logging.getLogger().setLevel("DEBUG" if settings.log_level == "trace" else settings.log_level.upper())
    if args.data_parallel_size > 1:
        return _serve_data_parallel(args, settings)
    llm = LLM(args.model_pos or args.model, **_engine_kwargs(args))
    engine = llm.llm_engine
    settings = dataclasses.replace(
        settings, model_name=settings.model_name or _served_name(args.model_pos or args.model, engine.config.model),
        model_path=engine.config.model,
    )
    try:
        run_server(engine, settings)
    finally:
        engine.shutdown()
    return 0


def _served_name(given: str | None, path: str) -> str:
    """The name a model is served under: the repo id it was named by (as vLLM serves it), else its file or
    folder name."""
    from pagedllm.entrypoints.openai.api_server import default_model_name

    if given is not None and not os.path.exists(os.path.expanduser(given)):
        return given
    return default_model_name(path)


def _serve_data_parallel(args: argparse.Namespace, settings: ServerSettings) -> int:
    """``pagedllm serve --data-parallel-size N`` (N > 1): the replicas load the model, this process does not."""
    from pagedllm.engine.llm import make_engine_config
    from pagedllm.entrypoints.openai.api_server import run_dp_server

    if hasattr(args, "gpu_memory_utilization"):
        # it sizes one engine's pool from the free memory; N replicas would each take that share
        raise ValueError("--gpu-memory-utilization sizes one engine; with --data-parallel-size > 1 give each "
                         "replica its pool with --kv-cache-memory-bytes (or leave both out: the default is split)")
    config = make_engine_config(args.model_pos or args.model, **_engine_kwargs(args))
    settings = dataclasses.replace(
        settings, model_name=settings.model_name or _served_name(args.model_pos or args.model, config.model),
        model_path=config.model,
    )
    if args.replica_heartbeat_timeout is None:
        run_dp_server(config, settings, args.data_parallel_size)
    else:
        run_dp_server(config, settings, args.data_parallel_size, args.replica_heartbeat_timeout)
    return 0


def _server_settings(args: argparse.Namespace) -> ServerSettings:
    """The server's settings from its flags (``_serve_arguments``); a refused value is a ValueError naming the
    flag."""
    from pagedllm.entrypoints.openai.settings import ServerSettings

    try:
        # the model's name is read from the model when --served-model-name is not given
        kwargs = record_kwargs(args, ServerSettings, args.server_flags)
        names = kwargs.pop("model_name", [""])  # --served-model-name A B: A answers, B is an alias
        return ServerSettings(model_name=names[0], model_aliases=names[1:], **kwargs)
    except ValueError as e:
        # the records name their fields; the person typed flags
        flags = {flag.key: flag.flag for flag in args.server_flags if not flag.nested}
        names = "|".join(sorted(flags, key=len, reverse=True))
        raise ValueError(re.sub(rf"\b(?:{names})\b", lambda match: flags[match.group(0)], str(e))) from None


def check_port_free(host: str, port: int) -> None:
    """ValueError when ``host:port`` cannot be bound (another server holds it), before a model loads for it."""
    if port == 0:
        return  # the OS picks a free one
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port} ({e.strerror or e}); is another server running there? "
                         "pick another --port") from None


def _serve_arguments(p: argparse.ArgumentParser) -> None:
    """A flag for every ``ServerSettings`` / ``HTTPLimits`` field, generated from the field (``arg_fields.py``;
    a field's ``Flag`` names those spelled otherwise), and the data-parallel flags."""
    from pagedllm.entrypoints.openai.settings import ServerSettings

    p.add_argument("model_pos", nargs="?", default=None, metavar="MODEL",
                   help="a .gguf file, a Hugging Face folder or repo id (org/repo, org/repo:Q4_K_M) "
                        "(default: bundled SmolLM2)")
    g = p.add_argument_group("server (ServerSettings' and HTTPLimits' fields; docs/serving.md)")
    p.set_defaults(server_flags=add_record_arguments(g, ServerSettings))
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="N",
                   help="N engine processes (replicas) behind this server; a request goes to the replica with "
                        "the longest cached prefix of its prompt, else the least loaded (default 1: one engine "
                        "in this process). Without --num-threads each gets cores // N threads, pinned")
    g.add_argument("--replica-heartbeat-timeout", type=float, default=None, metavar="SECONDS",
                   help="with --data-parallel-size: a replica that sends nothing, heartbeats included, for this "
                        "long is marked down, killed and started again (default 10; at least 1). Heartbeats come "
                        "from a thread of their own, so a long engine step does not delay them")


def cmd_env(args: argparse.Namespace) -> int:
    """``pagedllm env``: CPU features, torch, the kernels and the backends, for bug reports."""
    from pagedllm.entrypoints import env_report

    report = env_report.collect()
    if args.model is not None or args.load:
        report["model_defaults"] = env_report.model_defaults_report(args.model, args.generation_config)
    if args.load:
        from pagedllm import LLM

        # the engine's own defaults: the report shows the KV pool and max_model_len they resolve to here
        llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization,
                  quantization_group_size=args.quantization_group_size, generation_config=args.generation_config)
        report["loaded"] = env_report.loaded_model_report(llm)
    print(env_report.to_json(report) if args.json else env_report.format_report(report))
    return 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    """``pagedllm bench serve``: streaming clients against a running server."""
    from pagedllm.bench import serve as bench_serve

    bench_serve.run(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from pagedllm import __version__

    parser = argparse.ArgumentParser(prog="pagedllm", description="PagedAttention LLM inference")
    parser.add_argument("--version", action="version", version=f"pagedllm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate continuations of prompts")
    gen.add_argument("prompts", nargs="+", help="one or more prompts")
    gen.add_argument("--chat", action="store_true", help="send each prompt as a user message (chat template)")
    _sampling_arguments(gen, max_tokens=64)  # first: its per-request --seed makes the engine's --engine-seed
    _engine_arguments(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat, tokens streamed as they come")
    chat.add_argument("--system", default=None, help="system prompt")
    _sampling_arguments(chat, max_tokens=256)
    _engine_arguments(chat)
    chat.set_defaults(func=cmd_chat)

    env = sub.add_parser("env", help="CPU features, torch, native kernels and layer backends (for bug reports)")
    env.add_argument("--json", action="store_true")
    env.add_argument("--load", action="store_true", help="also load a model and list the layers it runs")
    env.add_argument("--model", default=None, help="the model whose defaults (sampling, end tokens) are shown and "
                                                   "--load loads (default: bundled SmolLM2)")
    env.add_argument("--generation-config", default="auto",
                     help="where the sampling defaults come from: auto (the model's), vllm (none) or a folder "
                          "(default: %(default)s)")
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
    """Run one ``pagedllm`` command; its exit status (2: a refused value, 130: interrupted)."""
    share_one_arena()  # before any thread allocates: the engine thread's steps reuse the heap (pagedllm/c_heap.py)
    parser = build_parser()
    args = parser.parse_args(argv)
    # warnings, and the one line before and after a first-run kernel build (pagedllm/kernels/__init__.py)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("pagedllm.kernels").setLevel(logging.INFO)
    # which sampling defaults came from the model (one line; none when it sets none)
    logging.getLogger("pagedllm.loader.generation_defaults").setLevel(logging.INFO)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # Ctrl-C while a model loads or the kernels build: stop quietly, with the shell's status for SIGINT
        print("interrupted", file=sys.stderr)
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
