"""Sliding-window decode attention: the cpu_paged kernel against the SDPA path windowed layers took before.

One decode token per sequence over a paged cache (SmolLM2's heads: 9 query
and 3 KV heads of 64, blocks of 16), a window of 512 keys. Prints ms per
call for the native kernel with the window, the SDPA path with the window
(gather + masked SDPA, what ``cpu_paged`` handed windowed layers to before
its kernel took windows) and the native kernel over the whole context, and
the ratios.

    python benchmarks/window_decode.py [--window 512] [--repeats 20]
"""

from __future__ import annotations

import argparse
import time

import torch

from pagedllm.layers.attention import AttentionMetadata, CpuPagedAttention, SdpaAttention

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def _step(num_seqs: int, context_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    blocks_per_seq = (context_len + BLOCK_SIZE - 1) // BLOCK_SIZE
    num_blocks = num_seqs * blocks_per_seq
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)  # [blocks, block_size, kv_heads, head_dim]
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_blocks).view(num_seqs, blocks_per_seq)  # scattered blocks
    lens = [context_len] * num_seqs
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(num_seqs, dtype=torch.int64), block_tables=tables,
        seq_lens_tensor=torch.tensor(lens), query_start_loc=list(range(num_seqs + 1)), seq_lens=lens,
        num_computed=[n - 1 for n in lens], num_prefills=0, block_size=BLOCK_SIZE,
    )
    q = torch.randn(num_seqs, NUM_HEADS, HEAD_DIM)  # [num_seqs, heads, head_dim]
    return q, k_cache, v_cache, meta


def _ms(fn, repeats: int) -> float:  # noqa: ANN001
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def _row(num_seqs: int, context_len: int, window: int, repeats: int) -> str:
    """One line of the table: the three timings and their ratios."""
    native, sdpa = CpuPagedAttention(), SdpaAttention()
    q, k_cache, v_cache, meta = _step(num_seqs, context_len)
    scale = HEAD_DIM**-0.5
    a = _ms(lambda: native.attend(q, None, None, k_cache, v_cache, meta, scale, sliding_window=window), repeats)
    b = _ms(lambda: sdpa.attend(q, None, None, k_cache, v_cache, meta, scale, sliding_window=window), repeats)
    c = _ms(lambda: native.attend(q, None, None, k_cache, v_cache, meta, scale), repeats)
    return f"{num_seqs:4d}  {context_len:7d}  {a:16.3f}  {b:14.3f}  {c:14.3f}  {b / a:10.2f}x  {c / a:10.2f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    print(f"window {args.window}, threads {torch.get_num_threads()}")
    print("seqs  context  native+window ms  sdpa+window ms  native full ms  sdpa/native  full/window")
    with torch.inference_mode():
        for num_seqs, context_len in [(1, 1024), (1, 4096), (8, 1024), (8, 4096), (32, 2048)]:
            print(_row(num_seqs, context_len, args.window, args.repeats))


if __name__ == "__main__":
    main()
