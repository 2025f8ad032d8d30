"""A hybrid model's state tensors: per state layer, ``[num_slots, *state_shape]``, allocated once.

A state layer (``ModelArchConfig.layer_types`` "linear_attention", "conv" or
"mamba": docs/hybrid-models.md) declares the per-sequence state it keeps with
``state_shapes()``: a tuple of shapes, one per tensor (a conv state, a
recurrent state...). The runner gives it, in the place an attention layer
gets its ``(K, V)`` views, the tuple of those tensors with a slot dimension
in front::

    layer 0 (conv)       (conv_state [num_slots, width - 1, dim],)
    layer 1 (attention)  (K [num_kv_blocks, block_size, heads, head_dim], V ...)
    layer 2 (linear)     (conv_state [num_slots, ...], recurrent_state [num_slots, heads, dk, dv])

The step's metadata says which slot each sequence reads and writes
(``AttentionMetadata.state_slots``) and whether it starts from zero
(``has_initial_state``). States are float32 whatever the weights: a
recurrence summed over thousands of tokens. On the CPU the tensors live in a
lazily backed mapping as the KV pool does (``runner/kv_cache.py``): only the
slots written are resident, and the block manager hands out the lowest first.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from pagedllm.loader.model_config import ModelArchConfig
from pagedllm.runner.kv_cache import lazy_zeros

logger = logging.getLogger(__name__)

STATE_DTYPE = torch.float32

StateShapes = tuple[tuple[int, ...], ...]


def layer_state_shapes(model: nn.Module, model_config: ModelArchConfig) -> list[StateShapes | None]:
    """Each layer's per-sequence state shapes (``layer.state_shapes()``), None for an attention layer.

    ValueError where a state layer of ``layer_types`` declares none: the model would run it without a state.
    """
    layers = model.model.layers
    out: list[StateShapes | None] = []
    for i, layer in enumerate(layers):
        if model_config.is_attention_layer(i):
            out.append(None)
            continue
        declare = getattr(layer, "state_shapes", None)
        if declare is None:
            raise ValueError(f"layer {i} is a {model_config.layer_types[i]!r} layer but declares no state_shapes()")
        shapes = tuple(tuple(int(n) for n in shape) for shape in declare())
        if not shapes or any(n <= 0 for shape in shapes for n in shape):
            raise ValueError(f"layer {i}: state shapes must be non-empty and positive, got {shapes}")
        out.append(shapes)
    return out


def state_bytes_per_slot(shapes: list[StateShapes | None]) -> int:
    """Bytes one sequence's state takes across every state layer."""
    elem = torch.tensor([], dtype=STATE_DTYPE).element_size()
    return sum(math.prod(shape) * elem for layer in shapes if layer is not None for shape in layer)


def allocate_state_cache(
    shapes: list[StateShapes | None], num_slots: int, device: torch.device
) -> list[tuple[torch.Tensor, ...] | None]:
    """Per layer, its zero-filled state tensors ``[num_slots, *shape]`` (resident only where written, on the
    CPU); None for an attention layer."""
    out: list[tuple[torch.Tensor, ...] | None] = []
    for layer in shapes:
        if layer is None:
            out.append(None)
            continue
        if device.type == "cpu":
            out.append(tuple(lazy_zeros((num_slots, *shape), STATE_DTYPE) for shape in layer))
        else:
            out.append(tuple(torch.zeros((num_slots, *shape), dtype=STATE_DTYPE, device=device) for shape in layer))
    return out


def copy_state_slots(states: list[tuple[torch.Tensor, ...] | None], copies: list[tuple[int, int]]) -> None:
    """Copy every state tensor's slot ``src`` into ``dst``, pair by pair in order (forks)."""
    if not copies:
        return
    for layer in states:
        for t in layer or ():
            for src, dst in copies:
                t[dst].copy_(t[src])


def plan_state_slots(max_num_seqs: int, bytes_per_slot: int, budget: int | None) -> int:
    """How many state slots the pool holds: one per sequence ``max_num_seqs`` may run (forks and beams
    included), fewer where they would take more than half of a known memory ``budget`` (the KV blocks
    need the rest); at least 1. The caller lowers max_num_seqs to it."""
    if bytes_per_slot <= 0:
        return 0
    if budget is None:
        return max_num_seqs
    return max(1, min(max_num_seqs, budget // 2 // bytes_per_slot))
