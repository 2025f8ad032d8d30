"""Prefill attention of fresh prompts: the cpu_paged kernel vs SDPA, one prefill step's worth.

The prompts of one prefill step of the throughput workload (lengths uniform
in [32, 256], 2048 tokens), SmolLM2's heads (9 query / 3 KV, head_dim 64),
q/k/v as views into one fused qkv tensor as the model hands them over.
Prints the time per layer and GFLOP/s counting the causal products only
(4 x head_dim FLOPs per query-key pair and head: scores and weighted sum).

    .venv/bin/python benchmarks/micro_prefill_attention.py [--tokens 2048] [--head-dim 64] [--one-prompt]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from pagedllm.layers.attention import AttentionMetadata, CpuPagedAttention, SdpaAttention


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--one-prompt", action="store_true", help="one prompt of --tokens tokens instead")
    args = p.parse_args()
    num_heads, num_kv_heads, head_dim = 9, 3, args.head_dim
    rng = random.Random(1234)
    lens: list[int] = [args.tokens] if args.one_prompt else []
    while sum(lens) < args.tokens:
        lens.append(min(rng.randint(32, 256), args.tokens - sum(lens)))
    num_tokens = sum(lens)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim)  # [num_tokens, qkv_size]
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    block_size = 16
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    tables, next_block = [], 0
    for n in lens:
        per_seq = (n + block_size - 1) // block_size
        tables.append(list(range(next_block, next_block + per_seq)))
        next_block += per_seq
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens, dtype=torch.int64),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        seq_lens_tensor=torch.tensor(lens),
        query_start_loc=starts,
        seq_lens=lens,
        num_computed=[0] * len(lens),
        num_prefills=len(lens),
        block_size=block_size,
    )
    # the prompts' K/V in the cache too, for SDPA, which reads them there
    k_cache = torch.zeros(next_block, block_size, num_kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    k_cache.view(-1, num_kv_heads, head_dim)[:num_tokens] = k
    v_cache.view(-1, num_kv_heads, head_dim)[:num_tokens] = v
    flops = sum(n * (n + 1) // 2 for n in lens) * num_heads * head_dim * 4
    with torch.inference_mode():
        for backend in (CpuPagedAttention(), SdpaAttention()):
            backend.attend(q, k, v, k_cache, v_cache, meta, head_dim**-0.5)
            start = time.perf_counter()
            for _ in range(args.repeats):
                backend.attend(q, k, v, k_cache, v_cache, meta, head_dim**-0.5)
            ms = (time.perf_counter() - start) / args.repeats * 1e3
            print(f"{backend.name:>10}: {ms:6.2f} ms per layer ({len(lens)} prompts, {num_tokens} tokens, "
                  f"head_dim {head_dim}): {flops / ms / 1e6:.1f} GFLOP/s")


if __name__ == "__main__":
    main()
