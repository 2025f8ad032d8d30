"""``paged_prefill``: prompt tokens read from the paged cache give the decode kernel's bits.

Each prompt token at position ``p`` must equal, bitwise, what ``paged_decode`` gives the same query
alone with ``p + 1`` keys: that is what makes a token's attention independent of how its prompt was
scheduled (docs/batch-invariance.md). Checked for every cache type, head sizes on and off the tiled
path (multiples of 64 and not), scattered block tables, several prompts with cached context in one
call, block boundaries inside the tiles, strided query rows, and misuse refused with ValueError.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import load_kernels
from pagedllm.layers.kv_quant import quantize_heads

pytestmark = pytest.mark.skipif(load_kernels() is None, reason="the kernels need the native build")

CACHE_TYPES = {
    "float32": None, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8,
    "int4": torch.uint8, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
}
HEADS, KV_HEADS, SCALE = 9, 3, 0.125


def make_cache(kind: str, num_blocks: int, block_size: int, head_dim: int, gen: torch.Generator):  # noqa: ANN201
    """A K and a V cache of ``kind`` filled with random heads (quantized as the write would store them)."""
    k, v = (torch.randn(num_blocks * block_size, KV_HEADS, head_dim, generator=gen) for _ in range(2))
    dtype = CACHE_TYPES[kind]
    if dtype in (None, torch.float16, torch.bfloat16):
        k, v = (x if dtype is None else x.to(dtype) for x in (k, v))
    else:
        k, v = quantize_heads(k, dtype, keys=True), quantize_heads(v, dtype)
    return (x.reshape(num_blocks, block_size, KV_HEADS, -1) for x in (k, v))


def decode_one_by_one(q, k_cache, v_cache, tables, bounds, seq_lens) -> torch.Tensor:  # noqa: ANN001
    """Every prompt token through paged_decode alone, with its own key count."""
    out = torch.full_like(q, float("nan"))
    for s in range(len(seq_lens)):
        start, end = int(bounds[2 * s]), int(bounds[2 * s + 1])
        first_pos = int(seq_lens[s]) - (end - start)
        for i, r in enumerate(range(start, end)):
            one = torch.empty(1, *q.shape[1:])
            torch.ops.pagedllm.paged_decode(q[r : r + 1].contiguous(), k_cache, v_cache, tables[s : s + 1],
                                            torch.tensor([first_pos + i + 1]), SCALE, one, 0)
            out[r] = one[0]
    return out


def scattered_tables(seq_lens: list[int], block_size: int, num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    """[num_seqs, width] tables over distinct blocks in a random order."""
    width = max(-(-n // block_size) for n in seq_lens)
    perm = torch.randperm(num_blocks, generator=gen)
    tables, used = torch.zeros(len(seq_lens), width, dtype=torch.int64), 0
    for s, n in enumerate(seq_lens):
        nb = -(-n // block_size)
        tables[s, :nb] = perm[used : used + nb]
        used += nb
    return tables


@pytest.mark.parametrize("kind", sorted(CACHE_TYPES))
@pytest.mark.parametrize("head_dim", [64, 128, 40])
def test_prompt_tokens_get_the_decode_kernels_bits(kind: str, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(head_dim)
    block_size, num_blocks = 16, 24
    seq_lens, q_lens = [37, 100, 5, 70], [37, 20, 5, 1]  # fresh, a later chunk, short, one token
    k_cache, v_cache = make_cache(kind, num_blocks, block_size, head_dim, gen)
    tables = scattered_tables(seq_lens, block_size, num_blocks, gen)
    bounds = torch.tensor([b for s in range(4) for b in (sum(q_lens[:s]), sum(q_lens[: s + 1]))])
    q = torch.randn(sum(q_lens), HEADS, head_dim, generator=gen)
    out = torch.empty_like(q)
    torch.ops.pagedllm.paged_prefill(q, k_cache, v_cache, tables, bounds, torch.tensor(seq_lens), SCALE, out)
    assert torch.equal(out, decode_one_by_one(q, k_cache, v_cache, tables, bounds, torch.tensor(seq_lens)))


@pytest.mark.parametrize("block_size", [1, 4, 5])
def test_small_blocks_and_a_long_prompt_with_strided_rows(block_size: int) -> None:
    """Tiles that span many blocks (and block sizes that cut the four-key groups), q and out slices of wider
    rows as the model's fused qkv gives them, prompts out of row order."""
    gen = torch.Generator().manual_seed(block_size)
    head_dim, seq_lens = 64, [300, 45]
    num_blocks = sum(-(-n // block_size) for n in seq_lens)
    k_cache, v_cache = make_cache("float32", num_blocks, block_size, head_dim, gen)
    tables = scattered_tables(seq_lens, block_size, num_blocks, gen)
    rows = 300 + 40
    wide = torch.randn(rows, (HEADS + 2) * head_dim, generator=gen)
    q = wide[:, : HEADS * head_dim].view(rows, HEADS, head_dim)  # row stride (HEADS + 2) * head_dim
    out_wide = torch.zeros(rows, (HEADS + 1) * head_dim)
    out = out_wide[:, head_dim:].view(rows, HEADS, head_dim)
    bounds = torch.tensor([40, 340, 0, 40])  # the second prompt's 40 new rows come first
    torch.ops.pagedllm.paged_prefill(q, k_cache, v_cache, tables, bounds, torch.tensor(seq_lens), SCALE, out)
    assert torch.equal(out, decode_one_by_one(q, k_cache, v_cache, tables, bounds, torch.tensor(seq_lens)))
    assert torch.equal(out_wide[:, :head_dim], torch.zeros(rows, head_dim))  # nothing written outside out


def test_misuse_is_refused() -> None:
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = make_cache("float32", 4, 4, 64, gen)
    q, out = torch.randn(6, HEADS, 64), torch.empty(6, HEADS, 64)
    tables, lens, bounds = torch.tensor([[0, 1]]), torch.tensor([6]), torch.tensor([0, 6])
    op = torch.ops.pagedllm.paged_prefill
    with pytest.raises(ValueError, match="outside the cache"):
        op(q, k_cache, v_cache, torch.tensor([[0, 9]]), bounds, lens, SCALE, out)
    with pytest.raises(ValueError, match="does not fit its block table"):
        op(q, k_cache, v_cache, tables, bounds, torch.tensor([9]), SCALE, out)
    with pytest.raises(ValueError, match="does not fit its block table"):  # more new tokens than the length
        op(q, k_cache, v_cache, tables, bounds, torch.tensor([5]), SCALE, out)
    with pytest.raises(ValueError, match="outside the 6 rows"):
        op(q, k_cache, v_cache, tables, torch.tensor([2, 8]), lens, SCALE, out)
    with pytest.raises(ValueError, match="do not fit a cache"):
        op(torch.randn(6, HEADS, 32), k_cache, v_cache, tables, bounds, lens, SCALE, torch.empty(6, HEADS, 32))
    with pytest.raises(ValueError, match="bounds"):
        op(q, k_cache, v_cache, tables, torch.tensor([0, 6, 0]), lens, SCALE, out)
