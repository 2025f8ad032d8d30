"""Fit every layer's ``KvTransform`` (``layers/kv_transform.py``) from one calibration prompt.

An int4 KV cache stores each layer's K and V through a fixed change of
variables (the keys' mean taken out, channels rebalanced against the
queries). The runner fits it once, when the cache is made and before any
request: one prefill of ``kv_calibration.txt`` (prose, dialogue, a list,
Python, SQL: text written for this, none of it a benchmark's) through the
model, its K/V written into the pool's first blocks, whose pages are then
given back. The prompt's statistics are the same on every run and every
tensor-parallel rank (each fits its own heads; the ranks run the prefill's
collectives together, as they run a step), so the stored bits of a token
never depend on anything but its own K/V.

A hybrid model (state layers beside attention, docs/hybrid-models.md) runs
the same prefill through its whole forward: its state layers compute from a
zero state in a scratch slot (the first running slot: no sequence holds one
yet, and a sequence that starts from position 0 ignores what the slot held),
so each attention layer's statistics are those of the activations it sees
when it serves a request.

Cost: one prefill of ~600 tokens at start-up (SmolLM2-135M: well under a
second on two cores); caches of other dtypes skip it.
"""

from __future__ import annotations

from importlib import resources

import numpy as np
import torch
from torch import nn

from pagedllm.layers.attention import AttentionMetadata
from pagedllm.layers.kv_transform import KvTransform
from pagedllm.layers.rotary import longrope_rows
from pagedllm.runner.kv_cache import release_kv_blocks

CALIBRATION_TEXT = "kv_calibration.txt"


def calibration_text() -> str:
    """The calibration prompt's text, shipped with the package."""
    return resources.files("pagedllm.runner").joinpath(CALIBRATION_TEXT).read_text(encoding="utf-8")


def calibrate_kv_transforms(
    model: nn.Module,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    kv_cache: torch.Tensor,
    token_ids: list[int],
    block_size: int,
    max_tokens: int,
    state_slot: int | None = None,
) -> int:
    """Run ``token_ids`` (cut to ``max_tokens``: the pool and the model's length bound it) as one prefill
    with every ``KvTransform`` of ``model`` recording, fit them, and give back the blocks written.
    ``state_slot``: a hybrid model's scratch state slot, which its state layers start from zero in (None
    for a model without state layers). Returns the number of tokens the fit saw."""
    transforms = [m for m in model.modules() if isinstance(m, KvTransform)]
    if not transforms:
        return 0
    ids = token_ids[:max_tokens]
    if len(ids) < 2:
        raise ValueError(f"an int4 KV cache needs room for a calibration prompt; {max_tokens} tokens fit")
    device = kv_cache.device
    num_tokens = len(ids)
    num_blocks = -(-num_tokens // block_size)
    states: dict[str, torch.Tensor] = {}
    if state_slot is not None:  # the prompt computes from position 0: its state starts at zero
        states = {"state_slots": torch.tensor([state_slot], dtype=torch.int64, device=device),
                  "has_initial_state": torch.tensor([False], device=device)}
    meta = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens, dtype=torch.int64, device=device),  # blocks 0, 1, ... in order
        block_tables=torch.arange(num_blocks, dtype=torch.int64, device=device).unsqueeze(0),  # [1, num_blocks]
        seq_lens_tensor=torch.tensor([num_tokens], dtype=torch.int64, device=device),
        query_start_loc=[0, num_tokens],
        seq_lens=[num_tokens],
        num_computed=[0],
        num_prefills=1,
        block_size=block_size,
        **states,
    )
    input_ids = torch.tensor(ids, dtype=torch.int64, device=device)
    rows = np.arange(num_tokens, dtype=np.int64)  # the RoPE rows the model looks up: the positions, but
    switch_len = model.model.rotary.switch_len
    if switch_len is not None:  # a longrope model's rows for a prompt of this length (layers/rotary.py)
        rows = longrope_rows(rows, np.full(num_tokens, num_tokens), switch_len)
    rope_rows = torch.from_numpy(rows).to(device)
    for t in transforms:
        t.record()
    try:
        with torch.inference_mode():
            model(input_ids, rope_rows, kv_caches, meta)
    finally:
        release_kv_blocks(kv_cache, [(0, num_blocks)])
    for t in transforms:
        t.fit()
    return num_tokens
