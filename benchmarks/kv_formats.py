"""KV cache formats side by side: perplexity, blocks at a fixed budget, decode attention time.

Issue 34's benchmarks of the quantized KV caches, one row per ``kv_cache_dtype``
(default: every value of ``pagedllm.config.KvCacheDtype`` but "auto"), on the
bundled SmolLM2-135M-Instruct GGUF (Q4_1) with the engine's default settings for it
(dtype float32, the GGUF's own quantized weights with ``gguf_activations="int8"``,
cpu_paged attention; each perplexity row prints them).

    PYTHONPATH=. .venv/bin/python benchmarks/kv_formats.py [--formats float16,int8]
        [--sections ppl,budget,decode] [--json]

Sections:

* ``ppl``: perplexity on text nobody here wrote (``/usr/share/common-licenses/GPL-3``
  by default, ``--text``), tokenized with the model's tokenizer and cut into
  ``--windows`` windows of ``--window`` tokens. Each window is one prompt scored with
  ``prompt_logprobs`` through ``LLM.generate`` with ``max_num_batched_tokens``
  ``--chunk`` (256), so every chunk after the first attends to K/V read back from the
  cache. Perplexity = exp(mean NLL over the scored tokens: every token of a window
  but its first, or with ``--score-second-half`` those after its middle, as
  llama-perplexity scores them); the delta is against float16 (issue 34's goals: int8 <= +0.5%,
  int4 <= +3%).
* ``budget``: for each ``--budgets-mib`` (64, 256) as ``kv_cache_memory_bytes``: bytes
  per block, blocks held, tokens held, sequences of 2,048 tokens that fit, and (unless
  ``--no-throughput``) ``pagedllm bench throughput``'s 64-request workload
  (``make_workload(64, 32, 256, 1234)``) on that pool.
* ``decode``: the native ``paged_decode`` op alone, SmolLM2's shapes (9 query heads,
  3 KV heads, head_dim 64, 16-token blocks), ``--batch`` sequences at each of
  ``--contexts`` (1k, 4k, 16k) tokens, blocks shuffled; K/V written through the
  native write (so quantized formats hold what the engine would store). Each call
  reads another layer's cache (enough layers that the set exceeds the last-level
  cache); median of ``--repeats`` calls, and x30 for a whole decode step's attention.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import statistics
import sys
import time
import typing
from collections.abc import Iterator
from types import SimpleNamespace

import torch

from pagedllm.config import KvCacheDtype

DEFAULT_TEXT = "/usr/share/common-licenses/GPL-3"
NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 30, 9, 3, 64, 16


def all_formats() -> list[str]:
    """Every cache format the engine takes, "auto" aside (float32 first as the reference)."""
    return [f for f in typing.get_args(KvCacheDtype) if f != "auto"]


def emit(args: argparse.Namespace, record: dict) -> None:
    """Print one result as a JSON line when ``--json`` asks for it."""
    if args.json:
        print(json.dumps(record), flush=True)


def engine_settings(llm) -> dict:  # noqa: ANN001
    """The settings that decide the numerics of a run (what the engine resolved for the model)."""
    cfg, runner = llm.llm_engine.config, llm.llm_engine.model_runner
    return {
        "dtype": cfg.dtype, "quantization": cfg.quantization, "gguf_activations": cfg.gguf_activations,
        "linear_backend": cfg.linear_backend, "attention_backend": runner.backend.name,
        "block_size": cfg.block_size, "max_num_batched_tokens": cfg.max_num_batched_tokens,
    }


# --- perplexity -------------------------------------------------------------------------------------------


def text_windows(tokenizer, path: str, window: int, num_windows: int) -> list[list[int]]:  # noqa: ANN001
    """The file's tokens cut into at most ``num_windows`` consecutive windows of ``window`` tokens."""
    with open(path, encoding="utf-8") as f:
        ids = tokenizer.encode(f.read(), add_special_tokens=False)
    count = min(num_windows, len(ids) // window)
    if count == 0:
        raise ValueError(f"{path} has {len(ids)} tokens, fewer than one window of {window}")
    return [ids[i * window : (i + 1) * window] for i in range(count)]


def window_nlls(llm, windows: list[list[int]], score_from: int = 1) -> list[float]:  # noqa: ANN001
    """The negative log-likelihood of every window's tokens from position ``score_from`` on, in order."""
    from pagedllm.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=False)
    nlls = []
    for window, out in zip(windows, outs, strict=True):
        scored = out.prompt_logprobs or []
        if len(scored) != len(window) or scored[0] is not None:
            raise RuntimeError(f"expected {len(window)} prompt positions (the first None), got {len(scored)}")
        for token, position in zip(window[score_from:], scored[score_from:], strict=True):
            if position is None or token not in position:
                raise RuntimeError("a prompt position came back without its own token's logprob")
            nlls.append(-position[token].logprob)
    return nlls


def run_perplexity(args: argparse.Namespace, formats: list[str]) -> list[dict]:
    """Perplexity per format over the same windows, chunked prefill reading cached K/V."""
    from pagedllm.engine.llm import LLM

    rows, windows = [], None
    for fmt in formats:
        llm = LLM(args.model, kv_cache_dtype=fmt, max_num_batched_tokens=args.chunk,
                  max_model_len=args.window + 16, num_kv_blocks=args.windows * (args.window // BLOCK_SIZE + 2),
                  enable_prefix_caching=False, seed=0)
        if windows is None:
            windows = text_windows(llm.get_tokenizer(), args.text, args.window, args.windows)
        start = time.perf_counter()
        nlls = window_nlls(llm, windows, args.window // 2 + 1 if args.score_second_half else 1)
        row = {"section": "ppl", "kv_cache_dtype": fmt, "text": args.text, "windows": len(windows),
               "window": args.window, "chunk": args.chunk, "second_half_only": args.score_second_half,
               "scored_tokens": len(nlls),
               "mean_nll": statistics.fmean(nlls), "ppl": math.exp(statistics.fmean(nlls)),
               "elapsed_s": round(time.perf_counter() - start, 1), "settings": engine_settings(llm)}
        rows.append(row)
        del llm
    base = next((r for r in rows if r["kv_cache_dtype"] == "float16"), None)
    for row in rows:
        if row["scored_tokens"] != rows[0]["scored_tokens"]:
            raise RuntimeError("formats scored different numbers of tokens")
        row["delta_vs_float16_pct"] = None if base is None else 100 * (row["ppl"] / base["ppl"] - 1)
        emit(args, row)
    return rows


def print_perplexity(rows: list[dict]) -> None:
    """The perplexity table."""
    if not rows:
        return
    r0 = rows[0]
    print(f"\nperplexity: {r0['text']}, {r0['windows']} windows x {r0['window']} tokens "
          f"({r0['scored_tokens']} scored), chunks of {r0['chunk']}; settings {r0['settings']}")
    print(f"{'kv_cache_dtype':>14} {'mean NLL':>9} {'ppl':>9} {'vs fp16':>8} {'time s':>7}")
    for r in rows:
        delta = "" if r["delta_vs_float16_pct"] is None else f"{r['delta_vs_float16_pct']:+.3f}%"
        print(f"{r['kv_cache_dtype']:>14} {r['mean_nll']:9.5f} {r['ppl']:9.4f} {delta:>8} {r['elapsed_s']:7.1f}")


# --- fixed budget ----------------------------------------------------------------------------------------


def pool_at_budget(args: argparse.Namespace, fmt: str, budget: int) -> dict:
    """Blocks, tokens and 2k-token sequences a ``budget``-byte pool of ``fmt`` holds."""
    from pagedllm.engine.llm import LLM

    llm = LLM(args.model, kv_cache_dtype=fmt, kv_cache_memory_bytes=budget, max_model_len=512)
    engine = llm.llm_engine
    blocks, bs = engine.block_manager.num_blocks, engine.config.block_size
    per_block = engine.model_runner.kv_bytes_per_block
    del llm, engine
    return {"bytes_per_block": per_block, "blocks": blocks, "tokens": blocks * bs,
            "seqs_at_2k": blocks // math.ceil(2048 / bs)}


def budget_throughput(args: argparse.Namespace, fmt: str, budget: int) -> dict:
    """``pagedllm bench throughput``'s 64-request workload on a ``budget``-byte pool of ``fmt``."""
    from pagedllm.bench import throughput

    bench_args = argparse.Namespace(
        model=args.model, num_requests=64, min_len=32, max_len=256, workload_seed=1234, json=True,
        structured=False, compare=[], peer_batch_size=16, peer_model=None,
    )
    with contextlib.redirect_stdout(sys.stderr):  # its own report lines; ours are the table
        res = throughput.run(bench_args, {"kv_cache_dtype": fmt, "kv_cache_memory_bytes": budget,
                                          "max_model_len": 512})
    keys = ("output_tokens_per_s", "total_tokens_per_s", "elapsed_s", "peak_kv_blocks_used", "num_preemptions")
    return {k: res.get(k) for k in keys}


def run_budget(args: argparse.Namespace, formats: list[str]) -> list[dict]:
    """One row per (budget, format)."""
    rows = []
    for mib in args.budgets_mib:
        for fmt in formats:
            row = {"section": "budget", "kv_cache_dtype": fmt, "budget_mib": mib,
                   **pool_at_budget(args, fmt, mib << 20)}
            if not args.no_throughput:
                row.update(budget_throughput(args, fmt, mib << 20))
            rows.append(row)
            emit(args, row)
    return rows


def print_budget(rows: list[dict]) -> None:
    """The fixed-budget table."""
    if not rows:
        return
    print("\nfixed KV budget (kv_cache_memory_bytes); throughput: make_workload(64, 32, 256, 1234), max_model_len 512")
    print(f"{'budget':>7} {'kv_cache_dtype':>14} {'B/block':>8} {'blocks':>7} {'tokens':>8} {'seqs@2k':>8} "
          f"{'out tok/s':>9} {'peak blk':>8} {'preempt':>7}")
    for r in rows:
        tput = f"{r['output_tokens_per_s']:9.1f}" if r.get("output_tokens_per_s") else f"{'-':>9}"
        print(f"{r['budget_mib']:>4}MiB {r['kv_cache_dtype']:>14} {r['bytes_per_block']:8d} {r['blocks']:7d} "
              f"{r['tokens']:8d} {r['seqs_at_2k']:8d} {tput} {r.get('peak_kv_blocks_used', '-')!s:>8} "
              f"{r.get('num_preemptions', '-')!s:>7}")


# --- decode attention ------------------------------------------------------------------------------------


def filled_caches(fmt: str, num_layers: int, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``num_layers`` (K, V) caches of ``fmt`` with every slot written from random float32 K/V by the native write."""
    from pagedllm.kernels import load_kernels
    from pagedllm.runner.kv_cache import allocate_kv_cache
    from pagedllm.runner.model_runner import KV_DTYPES

    ops = load_kernels()
    arch = SimpleNamespace(num_hidden_layers=num_layers, num_key_value_heads=NUM_KV_HEADS, head_dim=HEAD_DIM)
    _, layers = allocate_kv_cache(arch, num_blocks, BLOCK_SIZE, KV_DTYPES[fmt], torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    step = 4096
    for k_cache, v_cache in layers:
        for first in range(0, num_blocks * BLOCK_SIZE, step):
            slots = torch.arange(first, min(first + step, num_blocks * BLOCK_SIZE), dtype=torch.int64)
            k = torch.randn(len(slots), NUM_KV_HEADS, HEAD_DIM, generator=gen)
            v = torch.randn(len(slots), NUM_KV_HEADS, HEAD_DIM, generator=gen)
            ops.write_kv(k, v, k_cache, v_cache, slots)
    return layers


def decode_times(args: argparse.Namespace, fmt: str, context: int) -> dict:
    """Median time of one ``paged_decode`` call: ``--batch`` queries over ``context`` cached tokens each."""
    from pagedllm.kernels import load_kernels

    ops = load_kernels()
    per_seq = math.ceil(context / BLOCK_SIZE)
    num_blocks = per_seq * args.batch
    fp32_layer_bytes = 2 * num_blocks * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 4
    num_layers = max(2, min(NUM_LAYERS, math.ceil(args.working_set_mib * 2**20 / fp32_layer_bytes)))
    layers = filled_caches(fmt, num_layers, num_blocks)
    ids = list(range(num_blocks))
    random.Random(0).shuffle(ids)
    tables = torch.tensor([ids[i * per_seq : (i + 1) * per_seq] for i in range(args.batch)], dtype=torch.int64)
    seq_lens = torch.full((args.batch,), context, dtype=torch.int64)
    q = torch.randn(args.batch, NUM_HEADS, HEAD_DIM)
    out = torch.empty_like(q)
    times = []
    with torch.inference_mode():
        for i in range(args.repeats + num_layers):  # the first pass over the layers is a warm-up
            k_cache, v_cache = layers[i % num_layers]
            start = time.perf_counter()
            ops.paged_decode(q, k_cache, v_cache, tables, seq_lens, HEAD_DIM**-0.5, out, 0)
            if i >= num_layers:
                times.append(time.perf_counter() - start)
    kv_bytes = 2 * args.batch * context * NUM_KV_HEADS * layers[0][0].shape[-1] * layers[0][0].element_size()
    ms = statistics.median(times) * 1e3
    return {"section": "decode", "kv_cache_dtype": fmt, "context": context, "batch": args.batch,
            "layers_cycled": num_layers, "ms_per_layer": ms, "ms_per_step_30_layers": ms * NUM_LAYERS,
            "kv_mib_per_layer": kv_bytes / 2**20, "gb_per_s": kv_bytes / (ms / 1e3) / 1e9}


def run_decode(args: argparse.Namespace, formats: list[str]) -> list[dict]:
    """One row per (context, format)."""
    rows = []
    for context in args.contexts:
        for fmt in formats:
            row = decode_times(args, fmt, context)
            rows.append(row)
            emit(args, row)
    return rows


def print_decode(rows: list[dict]) -> None:
    """The decode attention table."""
    if not rows:
        return
    print(f"\ndecode attention (paged_decode, {rows[0]['batch']} sequences, {NUM_HEADS}/{NUM_KV_HEADS} heads, "
          f"head_dim {HEAD_DIM}, {BLOCK_SIZE}-token blocks shuffled; torch threads {torch.get_num_threads()})")
    print(f"{'context':>7} {'kv_cache_dtype':>14} {'ms/layer':>9} {'ms/step':>8} {'KV MiB/layer':>12} {'GB/s':>6}")
    for r in rows:
        print(f"{r['context']:>7} {r['kv_cache_dtype']:>14} {r['ms_per_layer']:9.3f} "
              f"{r['ms_per_step_30_layers']:8.2f} {r['kv_mib_per_layer']:12.2f} {r['gb_per_s']:6.2f}")


# --- main ------------------------------------------------------------------------------------------------


def csv_list(kind: type) -> typing.Callable[[str], list]:
    """An argparse type: comma-separated values of ``kind``."""
    return lambda s: [kind(x) for x in s.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--formats", type=csv_list(str), default=all_formats(),
                   help=f"comma-separated kv_cache_dtype values (default: {','.join(all_formats())})")
    p.add_argument("--sections", type=csv_list(str), default=["ppl", "budget", "decode"])
    p.add_argument("--model", default=None, help="a .gguf or Hugging Face folder (default: the bundled SmolLM2)")
    p.add_argument("--json", action="store_true", help="also print one JSON line per row")
    p.add_argument("--text", default=DEFAULT_TEXT)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--chunk", type=int, default=256, help="max_num_batched_tokens of the perplexity runs")
    p.add_argument("--score-second-half", action="store_true",
                   help="score only each window's second half, as llama-perplexity does")
    p.add_argument("--budgets-mib", type=csv_list(int), default=[64, 256])
    p.add_argument("--no-throughput", action="store_true", help="budget section: pool sizes only")
    p.add_argument("--contexts", type=csv_list(int), default=[1024, 4096, 16384])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--working-set-mib", type=int, default=512,
                   help="decode: cycle through enough layers that their float32 K/V would take this much")
    args = p.parse_args(argv)
    unknown = sorted(set(args.formats) - set(all_formats())) + sorted(set(args.sections) - {"ppl", "budget", "decode"})
    if unknown:
        p.error(f"unknown format or section: {', '.join(unknown)}")
    return args


def sections(args: argparse.Namespace) -> Iterator[tuple[list[dict], typing.Callable[[list[dict]], None]]]:
    """Each chosen section's rows with its printer, in the order ppl, budget, decode."""
    table = {"ppl": (run_perplexity, print_perplexity), "budget": (run_budget, print_budget),
             "decode": (run_decode, print_decode)}
    for name in ("ppl", "budget", "decode"):
        if name in args.sections:
            run, show = table[name]
            yield run(args, args.formats), show


def main(argv: list[str] | None = None) -> None:
    """Run the chosen sections for the chosen formats and print their tables."""
    args = parse_args(argv)
    for rows, show in sections(args):
        show(rows)
        sys.stdout.flush()


if __name__ == "__main__":
    main()
