"""Time to first token of an agent-shaped prompt: cold, with the RAM prefix cache, and after a restart from disk.

The request: a long shared prefix (``--prefix-len`` tokens, standing for
tool schemas and repository context) and a new turn (``--turn-len`` tokens)
that differs each time. Three figures, one engine after another on the
bundled model (or ``--model``), in this process:

  cold      a fresh engine on an empty ``--kv-cache-dir``: the whole prompt is computed
            (and its full blocks are written to disk by the background writer)
  ram hit   the same engine, a new turn: the prefix comes from RAM
  restart   the engine shut down (its writer finishes), a new engine on the same folder,
            a new turn: the prefix is read back from disk

TTFT here is the wall time of a ``generate`` with ``max_tokens=1`` (no
server, no network): the prefill and its one sampled token. The restart's
engine start (weights, KV pool) is printed apart. Prints one line per case
and, with ``--json``, one JSON object.

    PYTHONPATH=. python benchmarks/disk_prefix_cache.py                     # 7,900 + 200 tokens
    PYTHONPATH=. python benchmarks/disk_prefix_cache.py --prefix-len 2000   # a quick run
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time

from pagedllm import LLM, SamplingParams


def _ttft(llm: LLM, ids: list[int]) -> tuple[float, int]:
    """Seconds to the first token of ``ids``, and the prompt tokens the engine computed for it."""
    engine = llm.llm_engine
    before = engine.num_prompt_tokens_computed
    started = time.perf_counter()
    llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    return time.perf_counter() - started, engine.num_prompt_tokens_computed - before


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model (default: the bundled SmolLM2-135M Q4_1 GGUF)")
    p.add_argument("--prefix-len", type=int, default=7900)
    p.add_argument("--turn-len", type=int, default=200)
    p.add_argument("--kv-cache-dir", default=None, help="folder to use (default: a fresh temporary one, removed)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    rng = random.Random(0)
    prefix = [rng.randrange(100, 49000) for _ in range(args.prefix_len)]
    turns = [[rng.randrange(100, 49000) for _ in range(args.turn_len)] for _ in range(3)]
    cache_dir = args.kv_cache_dir or tempfile.mkdtemp(prefix="pagedllm-kv-")
    settings = dict(kv_cache_dir=cache_dir, max_model_len=args.prefix_len + args.turn_len + 8)
    if args.model:
        settings["model"] = args.model
    try:
        llm = LLM(**settings)
        cold, cold_computed = _ttft(llm, prefix + turns[0])
        ram, ram_computed = _ttft(llm, prefix + turns[1])
        written_at = time.perf_counter()
        llm.llm_engine.shutdown()  # the writer finishes what is queued
        flush_s = time.perf_counter() - written_at
        disk = llm.llm_engine.kv_disk
        bytes_written = disk.bytes_written
        del llm
        started = time.perf_counter()
        llm = LLM(**settings)
        start_s = time.perf_counter() - started
        restart, restart_computed = _ttft(llm, prefix + turns[2])
        bytes_read = llm.llm_engine.kv_disk.bytes_read
        llm.llm_engine.shutdown()
    finally:
        if args.kv_cache_dir is None:
            shutil.rmtree(cache_dir, ignore_errors=True)
    figures = {
        "prompt_tokens": args.prefix_len + args.turn_len,
        "cold_s": cold, "cold_computed": cold_computed,
        "ram_hit_s": ram, "ram_hit_computed": ram_computed,
        "restart_disk_s": restart, "restart_computed": restart_computed,
        "restart_engine_start_s": start_s, "writer_drain_at_shutdown_s": flush_s,
        "bytes_written": bytes_written, "bytes_read": bytes_read,
    }
    print(f"prompt: {args.prefix_len} shared + {args.turn_len} new tokens")
    print(f"cold            TTFT {cold:8.3f} s   computed {cold_computed} tokens")
    print(f"RAM prefix hit  TTFT {ram:8.3f} s   computed {ram_computed} tokens")
    print(f"restart (disk)  TTFT {restart:8.3f} s   computed {restart_computed} tokens "
          f"({bytes_read / 2**20:.1f} MiB read; engine start {start_s:.1f} s apart)")
    print(f"restart / RAM hit {restart / ram:.2f}x, cold / restart {cold / restart:.1f}x; "
          f"{bytes_written / 2**20:.1f} MiB written, writer drained {flush_s:.2f} s after the last request")
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
