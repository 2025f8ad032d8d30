"""Decode attention over scattered blocks: the cpu_paged kernel vs the SDPA gather.

One decode step of a SmolLM2-shaped model (30 layers, 9 query / 3 KV heads,
head_dim 64, 16-token blocks by default) over a 2 GiB float32 cache, each
sequence's blocks shuffled across the first 9600 tokens' worth of blocks of
every layer, as the engine's cache looks mid-run. Each layer reads its own
part of the cache, so K/V come from memory, not from the last-level cache.
The rate printed is the context's K/V bytes over the time.

    .venv/bin/python benchmarks/micro_attention.py [--batch 24] [--context 250] [--block-size 16]
        [--kv-cache-dtype float32|float16|bfloat16|int8|int4]

With a 2-byte cache the cache is half the bytes (same tokens, same layout);
int8 / int4 caches (layers/kv_quant.py) hold random values with a fixed
scale per head row (their layout, not real K/V: the time does not depend on
the values).
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from pagedllm.layers.attention import AttentionMetadata, CpuPagedAttention, SdpaAttention
from pagedllm.runner.kv_cache import cache_head_width

# each --kv-cache-dtype's cache tensor dtype (int4: nibbles in uint8)
CACHE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "int8": torch.int8, "int4": torch.uint8}


def random_cache(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A cache of ``shape`` (its last dimension a head row's width) filled as the kernels read it: normal
    floats, or random quantized values with a 0.01 scale in each head row's last 4 bytes."""
    if dtype.is_floating_point:
        return torch.empty(shape, dtype=dtype).normal_()
    kv = torch.randint(-128 if dtype == torch.int8 else 0, 128 if dtype == torch.int8 else 256, shape, dtype=dtype)
    kv[..., -4:] = torch.tensor([0.01], dtype=torch.float32).view(dtype)
    return kv


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=24)
    p.add_argument("--context", type=int, default=250)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-dtype", default="float32", choices=list(CACHE_DTYPES))
    args = p.parse_args()
    kv_dtype = CACHE_DTYPES[args.kv_cache_dtype]
    block_size = args.block_size
    # the same 2 GiB and the same 9600-token region whatever the block size
    num_layers, num_blocks, num_heads, num_kv_heads, head_dim = 30, 2912 * 16 // block_size, 9, 3, 64
    kv = random_cache((2, num_layers, num_blocks, block_size, num_kv_heads, cache_head_width(head_dim, kv_dtype)),
                      kv_dtype)
    rng = random.Random(0)
    ids = list(range(9600 // block_size))
    rng.shuffle(ids)
    per_seq = (args.context + block_size - 1) // block_size
    if per_seq * args.batch > len(ids):
        raise ValueError("batch x context needs more than 9600 tokens of blocks")
    tables = [[ids.pop() for _ in range(per_seq)] for _ in range(args.batch)]
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64),
        block_tables=torch.tensor(tables),
        seq_lens_tensor=torch.full((args.batch,), args.context),
        query_start_loc=list(range(args.batch + 1)),
        seq_lens=[args.context] * args.batch,
        num_computed=[args.context - 1] * args.batch,
        num_prefills=0,
        block_size=block_size,
    )
    q = torch.randn(args.batch, num_heads, head_dim)
    with torch.inference_mode():
        for backend in (CpuPagedAttention(), SdpaAttention()):
            def step(backend=backend) -> None:  # noqa: ANN001
                for i in range(num_layers):
                    backend.attend(q, None, None, kv[0, i], kv[1, i], meta, head_dim**-0.5)

            step()
            start = time.perf_counter()
            for _ in range(10):
                step()
            ms = (time.perf_counter() - start) / 10 * 1e3
            kv_bytes = 2 * num_layers * args.batch * args.context * num_kv_heads * kv.shape[-1] * kv.element_size()
            print(f"{backend.name:>10}: {ms:6.1f} ms per decode step ({args.batch} sequences x {args.context} tokens, "
                  f"{num_layers} layers, {block_size}-token blocks, {args.kv_cache_dtype}): {kv_bytes / ms / 1e6:.1f} GB/s of K/V")


if __name__ == "__main__":
    main()
