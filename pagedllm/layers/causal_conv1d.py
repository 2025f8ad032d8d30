"""The causal depthwise conv1d of a hybrid model's state layers, over a step's new tokens.

LFM2's short conv, the conv before Qwen3.5's / Qwen3-Next's gated delta rule
and Mamba-2's conv all run it: each channel ``c`` of each new token ``t``::

    out[t, c] = act(bias[c] + sum_k weight[c, k] * in(t - (width - 1) + k))

where ``in(p)`` before the sequence's first new token is read from its conv
state slot ``[width - 1, dim]`` (row ``j``: the input ``width - 1 - j``
tokens back), or is zero when the sequence computes from position 0
(``has_initial_state`` False). The slot then holds the last ``width - 1``
inputs, so the next chunk or decode continues it: a prompt in chunks gives
the whole prompt's result.

``torch.ops.pagedllm.causal_conv1d`` (``kernels/conv/causal_conv1d.cpp``) is
the native kernel; ``causal_conv1d_torch`` the same in torch ops, for a
machine without the kernels (and other dtypes or devices).

``causal_conv1d_decode`` is the form a captured decode step runs
(``DecodeMetadata``: one token per sequence, each continuing its slot): it
reads the step through tensors only, so a trace replays it for any number of
sequences, and its native op (``causal_conv1d_decode``) is a step program
node computing the same bits as ``causal_conv1d`` on a decode row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = ("none", "silu")


def causal_conv1d_torch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
    query_start_loc: list[int], state_slots: torch.Tensor, has_initial_state: torch.Tensor, activation: str,
) -> torch.Tensor:
    """The conv in torch ops, sequence by sequence; updates ``conv_state`` in place. ``x`` ``[num_tokens, dim]``,
    ``weight`` ``[dim, width]``, ``conv_state`` ``[num_slots, width - 1, dim]``; returns ``[num_tokens, dim]``."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    width = weight.shape[1]
    out = torch.empty_like(x)
    slots = state_slots.tolist()
    initial = has_initial_state.tolist()
    for i, slot in enumerate(slots):
        start, stop = query_start_loc[i], query_start_loc[i + 1]
        past = conv_state[slot].to(x.dtype) if initial[i] else x.new_zeros(width - 1, x.shape[1])
        window = torch.cat([past, x[start:stop]])  # [width - 1 + n, dim]
        n = stop - start
        acc = torch.zeros(n, x.shape[1], dtype=x.dtype, device=x.device) if bias is None else bias.expand(n, -1).clone()
        for k in range(width):
            acc += window[k : k + n] * weight[:, k]
        out[start:stop] = F.silu(acc) if activation == "silu" else acc
        if width > 1:
            conv_state[slot] = window[window.shape[0] - (width - 1) :].to(conv_state.dtype)
    return out


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
    query_start_loc: list[int], state_slots: torch.Tensor, has_initial_state: torch.Tensor, activation: str = "none",
    native: bool = True,
) -> torch.Tensor:
    """The conv through the native kernel where it runs it (float32 CPU tensors, ``native``), else in torch ops.

    Arguments as ``causal_conv1d_torch``'s; ``query_start_loc`` the step metadata's list.
    """
    if native and x.device.type == "cpu" and x.dtype == torch.float32 and _native_loaded():
        loc = torch.tensor(query_start_loc, dtype=torch.int64)
        return torch.ops.pagedllm.causal_conv1d(x.contiguous(), weight, bias, conv_state, loc, state_slots,
                                                has_initial_state, activation)
    return causal_conv1d_torch(x, weight, bias, conv_state, query_start_loc, state_slots, has_initial_state,
                               activation)


def causal_conv1d_decode(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
    state_slots: torch.Tensor, activation: str = "none", native: bool = True,
) -> torch.Tensor:
    """One token per sequence (row ``i``: the sequence of slot ``state_slots[i]``), each continuing its slot's
    state: ``causal_conv1d`` of a decode step, with nothing of the step read into Python.

    ``x`` ``[num_seqs, dim]`` (rows may be strided), ``weight`` ``[dim, width]`` (width >= 2), ``conv_state``
    ``[num_slots, width - 1, dim]``; returns ``[num_seqs, dim]``, contiguous.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if native and x.device.type == "cpu" and x.dtype == torch.float32 and _native_loaded():
        return torch.ops.pagedllm.causal_conv1d_decode(x, weight, bias, conv_state, state_slots, activation == "silu")
    past = conv_state.index_select(0, state_slots).to(x.dtype)  # [num_seqs, width - 1, dim]
    window = torch.cat([past, x.unsqueeze(1)], dim=1)  # [num_seqs, width, dim]
    acc = (window * weight.t().to(x.dtype)).sum(1)
    if bias is not None:
        acc = acc + bias
    conv_state.index_copy_(0, state_slots, window[:, 1:].to(conv_state.dtype))
    return F.silu(acc) if activation == "silu" else acc


def _native_loaded() -> bool:
    from pagedllm.kernels import load_kernels

    return load_kernels() is not None
