"""``pagedllm bench memory --window-blocks``: the KV blocks a Gemma 3 sequence needs, before and after window groups.

No weights: the block manager (``engine/block_manager.py``) runs one sequence
of the real configs' shape through its steps, as the scheduler would (a
prompt in chunks of ``max_num_batched_tokens``, then decodes), once with one
group of every layer (the window only a mask: every block kept) and once with
the KV cache groups of ``kv_groups.py`` (out-of-window blocks given
back). Blocks of the two differ in size (a block holds a group's rows, not
every layer's), so the table also gives bytes: ``blocks x rows x`` one row's K
and V at bfloat16.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.engine.block_manager import BlockManager
from pagedllm.engine.sequence import Sequence
from pagedllm.kv_groups import KVCacheLayout, kv_cache_layout

NUM_DECODE_TOKENS = 256  # the context ends with this many decodes after the prompt


@dataclass(frozen=True)
class WindowModel:
    """The KV shape of a sliding-window model: layers, the window, the pattern (every ``full_every``-th layer
    is full attention) and one layer's K/V row size."""

    name: str
    num_layers: int
    window: int
    full_every: int
    num_kv_heads: int
    head_dim: int

    def layer_windows(self) -> list[int | None]:
        return [None if (i + 1) % self.full_every == 0 else self.window for i in range(self.num_layers)]


# google/gemma-3-1b-it and gemma-3-4b-it's text configs: sliding_window, num_hidden_layers, 5 local : 1 global
GEMMA3_MODELS = (
    WindowModel("gemma-3-1b", 26, 512, 6, 1, 256),
    WindowModel("gemma-3-4b", 34, 1024, 6, 4, 256),
)


def peak_blocks(layout: KVCacheLayout, context_len: int, block_size: int, chunk_len: int) -> tuple[int, int]:
    """(most blocks held at once, blocks held at the last step) by one sequence of ``context_len`` tokens."""
    prompt_len = context_len - NUM_DECODE_TOKENS
    num_needed = layout.num_groups * -(-context_len // block_size)
    bm = BlockManager(num_needed, block_size, enable_prefix_caching=False, group_windows=layout.windows)
    seq = Sequence([0] * prompt_len, block_size)
    if not bm.allocate(seq, chunk_len):
        raise ValueError("the pool holds every block the sequence could need: allocate cannot fail")
    peak = bm.num_used_blocks
    seq.num_computed_tokens = min(chunk_len, prompt_len)
    while len(seq) < context_len:
        if seq.num_computed_tokens == len(seq):
            seq.append_token(0)  # the step that computed the last token sampled this one
        num_new = min(chunk_len, len(seq) - seq.num_computed_tokens)
        if not bm.append_slot(seq, num_new):
            raise ValueError("the pool holds every block the sequence could need: append_slot cannot fail")
        peak = max(peak, bm.num_used_blocks)
        seq.num_computed_tokens += num_new
    return peak, bm.num_used_blocks


def window_block_rows(context_lens: tuple[int, ...] = (8192, 32768), block_size: int = 16,
                      chunk_len: int = 2048) -> list[dict]:
    """One row per model and context: blocks and bytes with one group and with window groups."""
    rows = []
    for model in GEMMA3_MODELS:
        row_bytes = 2 * block_size * model.num_kv_heads * model.head_dim * 2  # K and V, bfloat16
        before = kv_cache_layout([None] * model.num_layers)
        after = kv_cache_layout(model.layer_windows())
        for context_len in context_lens:
            peak_b, last_b = peak_blocks(before, context_len, block_size, chunk_len)
            peak_a, last_a = peak_blocks(after, context_len, block_size, chunk_len)
            rows.append({
                "model": model.name, "context_len": context_len, "groups": after.num_groups,
                "rows": after.num_rows, "padding": round(after.padding_fraction, 4),
                "blocks_before": peak_b, "blocks_after_peak": peak_a, "blocks_after_last": last_a,
                "mib_before": round(peak_b * before.num_rows * row_bytes / 2**20, 1),
                "mib_after_peak": round(peak_a * after.num_rows * row_bytes / 2**20, 1),
                "mib_after_last": round(last_a * after.num_rows * row_bytes / 2**20, 1),
            })
            if last_b != peak_b:
                raise ValueError("one group of every layer never gives a block back")
    return rows


def print_window_blocks(rows: list[dict], block_size: int = 16, chunk_len: int = 2048) -> None:
    """The table ``window_block_rows`` returns, for a terminal."""
    print(f"KV blocks of one Gemma 3 sequence (blocks of {block_size} tokens, prompt chunks of {chunk_len}, "
          f"the last {NUM_DECODE_TOKENS} tokens decoded; MiB at bfloat16)")
    print(f"{'model':<11} {'context':>7} {'groups':>6} {'rows':>4} {'pad':>5}  {'before':>7} {'MiB':>7}"
          f"  {'after: peak':>11} {'MiB':>7}  {'last step':>9} {'MiB':>7}")
    for r in rows:
        print(f"{r['model']:<11} {r['context_len']:>7} {r['groups']:>6} {r['rows']:>4} {r['padding']:>5.1%}  "
              f"{r['blocks_before']:>7} {r['mib_before']:>7.1f}  {r['blocks_after_peak']:>11} "
              f"{r['mib_after_peak']:>7.1f}  {r['blocks_after_last']:>9} {r['mib_after_last']:>7.1f}")


if __name__ == "__main__":
    print_window_blocks(window_block_rows())
