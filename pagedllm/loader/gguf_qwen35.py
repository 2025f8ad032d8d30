"""Qwen3-Next (``qwen3next``) and Qwen3.5 / Qwen3.6 (``qwen35``, ``qwen35moe``) from llama.cpp-converted GGUFs.

What ``convert_hf_to_gguf.py`` writes for these hybrids, read back into
Hugging Face terms (``models/qwen3_next.py`` then loads them like a folder):

- **Shape.** ``ssm.group_count`` (key heads), ``ssm.time_step_rank`` (value
  heads), ``ssm.state_size`` (key head size), ``ssm.inner_size`` (all value
  heads' width), ``ssm.conv_kernel``; a layer is Gated DeltaNet where the file
  holds its ``ssm_a`` (else every ``full_attention_interval``-th layer is
  full attention); ``rope.dimension_count`` the part of each attention head
  rotated. The MoE's top-k is always renormalised (llama.cpp's graph).
- **Names** (``QWEN35_LAYER_NAMES``): ``attn_qkv`` / ``attn_gate`` are the
  Gated DeltaNet's ``in_proj_qkv`` / ``in_proj_z`` (Qwen3-Next's
  ``in_proj_qkvz`` is written de-interleaved that way), ``ssm_beta`` /
  ``ssm_alpha`` its ``in_proj_b`` / ``in_proj_a`` (Qwen3-Next: ``ssm_ba``, still
  interleaved per key head), ``ssm_conv1d``, ``ssm_a``, ``ssm_dt`` (the
  ``dt_bias``), ``ssm_norm``, ``ssm_out``; ``attn_q`` holds the attention's
  query and gate rows interleaved per head, as the checkpoint does.
- **Values** (``gguf_hf_values``): ``ssm_a`` holds ``-exp(A_log)``; the
  conv weight is squeezed to ``[channels, kernel]``; every ``(1 + w)`` norm
  holds ``1 + w`` (the families run a file's norms as plain ``w * x``; the
  gated ``ssm_norm`` is plain in both).
- **Value-head order.** For ``qwen35`` / ``qwen35moe`` with fewer key than
  value heads the converter reorders the value heads from grouped by key
  head (value head ``h`` reads key head ``h / group``) to tiled (key head
  ``h % num_k_heads``) in every tensor with a value-head axis; this is
  undone here, rows or columns moved in whole heads (as stored bytes too).
- **Gated queries.** ``attn_q`` (the model's ``q_proj`` rows, per head query
  then gate) is split into ``q_proj`` and ``attn_gate`` by whole rows, so as
  stored bytes too: ``gated_query_types`` gives ``attn_gate`` the file's type
  of ``q_proj``, and the fused ``qkv_proj`` keeps the file's blocks (before
  it, the full-attention layers' q, k and v were dequantized to float32).
- **Columns left tiled.** ``out_proj``'s value heads are its input columns:
  they stay in the file's tiled order (``linear_out_proj_tiled``) and the
  layer hands them its output in that order, so a Q4_K ``ssm_out`` (heads of
  128 columns, half a block) keeps its blocks rather than being widened to
  float32 to move them. Under tensor parallelism a rank's heads must be one
  run of columns, so there they are moved back to grouped order
  (``untile_out_proj``): as stored bytes where a head is whole blocks of its
  type, else dequantized first (``columns_moved_in_values``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

QWEN35_ARCHITECTURES = ("qwen3next", "qwen35", "qwen35moe")
_TILED_ARCHITECTURES = ("qwen35", "qwen35moe")
QWEN35_LAYER_NAMES = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_ba.weight": "linear_attn.in_proj_ba.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_a": "linear_attn.A_log",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
}
_FULL_ATTENTION_INTERVAL = 4


def gated_query_types(quantized: dict[str, int]) -> dict[str, int]:
    """The ggml types of the ``self_attn.attn_gate`` rows the model splits from each quantized
    ``self_attn.q_proj`` (``layers/gated_attention.py``): whole rows, so the stored blocks of the same type."""
    suffix = ".self_attn.q_proj.weight"
    return {name.removesuffix(suffix) + ".self_attn.attn_gate.weight": kind
            for name, kind in quantized.items() if name.endswith(suffix)}


def columns_moved_in_values(
    quantized: dict[str, int], arch: str, num_k_heads: int, num_v_heads: int, head_v_dim: int
) -> set[str]:
    """The quantized ``linear_attn.out_proj`` tensors of a tiled file whose value heads (columns, moved back to
    grouped order under tensor parallelism) are not whole blocks of their type (Q4_K's 256 columns over heads of
    128): these must be dequantized before their columns move, never taken as stored."""
    if arch not in _TILED_ARCHITECTURES or num_v_heads <= num_k_heads:
        return set()
    return {name for name, kind in quantized.items() if name.endswith(".linear_attn.out_proj.weight")
            and head_v_dim % GGML_QUANT_SIZES[GGMLQuantizationType(kind)][0]}


def _int_key(key: Callable[[str], object], arch: str, name: str) -> int:
    value = key(name)
    if value is None:
        raise ValueError(f"GGUF {arch} file lacks {arch}.{name}")
    return int(value)


def qwen35_gguf_settings(
    key: Callable[[str], object], arch: str, num_layers: int, head_dim: int, tensor_names: Iterable[str]
) -> dict[str, Any]:
    """The ``ModelArchConfig`` fields of a ``qwen3next`` / ``qwen35`` / ``qwen35moe`` file's metadata."""
    num_k_heads = _int_key(key, arch, "ssm.group_count")
    num_v_heads = _int_key(key, arch, "ssm.time_step_rank")
    inner = _int_key(key, arch, "ssm.inner_size")
    if num_v_heads <= 0 or inner % num_v_heads:
        raise ValueError(f"GGUF {arch}: ssm.inner_size {inner} is not {num_v_heads} value heads")
    linear = {int(name.split(".")[1]) for name in tensor_names if name.startswith("blk.") and name.endswith(".ssm_a")}
    if linear:
        types = tuple("linear_attention" if i in linear else "full_attention" for i in range(num_layers))
    else:
        interval = int(key("full_attention_interval") or _FULL_ATTENTION_INTERVAL)
        types = tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers))
    rotated = key("rope.dimension_count")
    fields: dict[str, Any] = dict(
        linear_num_key_heads=num_k_heads, linear_num_value_heads=num_v_heads,
        linear_key_head_dim=_int_key(key, arch, "ssm.state_size"), linear_value_head_dim=inner // num_v_heads,
        linear_conv_kernel_dim=_int_key(key, arch, "ssm.conv_kernel"), layer_types=types, qk_norm=True,
        partial_rotary_factor=(int(rotated) / head_dim) if rotated is not None else 0.25,
        linear_out_proj_tiled=arch in _TILED_ARCHITECTURES and num_v_heads > num_k_heads,
    )
    if arch != "qwen35":
        fields["norm_topk_prob"] = True
    return fields


def _tiled_to_grouped(t: torch.Tensor, dim: int, num_k_heads: int, group: int) -> torch.Tensor:
    """Value heads along ``dim`` (whole heads: the axis is ``num_v_heads`` equal runs) from tiled order back to
    grouped by key head: the converter's reordering undone."""
    shape = list(t.shape)
    head = shape[dim] // (num_k_heads * group)
    split = t.reshape(*shape[:dim], group, num_k_heads, head, *shape[dim + 1:])
    return split.transpose(dim, dim + 1).reshape(shape).contiguous()


def gguf_hf_values(
    weights: Iterable[tuple[str, torch.Tensor]], arch: str, num_k_heads: int, num_v_heads: int, key_dim: int,
    untile_out_proj: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """A converted file's tensors (Hugging Face names) with the checkpoint's values: ``A_log`` from ``-exp(A_log)``,
    the conv weight ``[channels, 1, kernel]``, value heads grouped by key head again (``qwen35`` / ``qwen35moe``;
    out_proj's columns excepted, ``linear_out_proj_tiled``, unless ``untile_out_proj``).

    ``key_dim``: the width of q (and of k) in ``in_proj_qkv`` and the conv's channels.
    """
    group = num_v_heads // num_k_heads
    tiled = arch in _TILED_ARCHITECTURES and group > 1
    for name, t in weights:
        if name.endswith("linear_attn.A_log"):
            t = torch.log(-t.float())
        elif name.endswith("linear_attn.conv1d.weight"):
            t = t.reshape(t.shape[0], 1, -1)
        if tiled and ".linear_attn." in name:
            t = _grouped(name, t, num_k_heads, group, key_dim, untile_out_proj)
        yield name, t


def _grouped(name: str, t: torch.Tensor, num_k_heads: int, group: int, key_dim: int,
             untile_out_proj: bool) -> torch.Tensor:
    """One Gated DeltaNet tensor of a tiled file with its value heads grouped by key head again."""
    if name.endswith((".in_proj_qkv.weight", ".conv1d.weight")):
        # q and k rows (or channels) first, then the value heads'
        return torch.cat([t[: 2 * key_dim], _tiled_to_grouped(t[2 * key_dim:], 0, num_k_heads, group)])
    if name.endswith((".in_proj_z.weight", ".in_proj_b.weight", ".in_proj_a.weight", ".A_log", ".dt_bias")):
        return _tiled_to_grouped(t, 0, num_k_heads, group)
    if untile_out_proj and name.endswith(".out_proj.weight"):  # columns; stored bytes too (each head's whole bytes)
        return _tiled_to_grouped(t, 1, num_k_heads, group)
    return t  # out_proj's columns stay tiled (linear_out_proj_tiled)
