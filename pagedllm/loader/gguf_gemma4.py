"""Gemma 4 (text) from GGUF files written by llama.cpp's ``convert_hf_to_gguf.py`` (architecture ``gemma4``).

What its ``Gemma4Model`` writes, read back into the ``ModelArchConfig``
fields the folder reading sets (``loader/gemma4_config.py``):

- **Two attention shapes.** ``attention.key_length`` is the full-attention
  ("global") layers' head size, ``attention.key_length_swa`` the sliding
  layers' (``head_dim``). ``attention.head_count_kv`` is one number when
  both kinds have the same kv heads, else one entry per layer.
- **Layer kinds.** ``attention.sliding_window_pattern``: one bool per layer
  (true = sliding); ``attention.sliding_window``: their window.
- **RoPE.** ``rope.freq_base`` for global layers, ``rope.freq_base_swa``
  for sliding ones. The global layers' ``proportional`` RoPE is written as
  a ``rope_freqs`` tensor of ``global_head_dim / 2`` frequency divisors:
  1 for the rotated pairs, 1e30 (frequency 0) for the rest, so the rotated
  share of the head is ``partial_rotary_factor``; it applies to the global
  layers only (never as a Llama-3-style divisor of every table).
  ``rope.dimension_count_swa`` short of the sliding head is refused (the
  sliding table rotates whole heads).
- **Values shared with keys** (``attention_k_eq_v``, 26B-A4B): a global
  layer without an ``attn_v`` tensor.
- **Experts** (``expert_count``, ``expert_used_count``,
  ``expert_feed_forward_length``): every layer's experts beside its dense
  MLP, the router's top-k always renormalised. Tensor names are mapped by
  ``GEMMA4_LAYER_NAMES``; the experts' gate and up are stacked in one 3-D
  tensor (``ffn_gate_up_exps``, gate rows first), split per expert by the
  loader.
- Norm weights as stored (Gemma 4 multiplies by ``w``, and the converter
  adds nothing); scores unscaled (``attn_scale`` 1: q and k are normed);
  ``final_logit_softcapping`` where written; GELU (tanh), Gemma 4's only
  activation, which the converter does not write.

Refused by name: per-layer embeddings (``embedding_length_per_layer_input``,
E2B/E4B), KV sharing (``attention.shared_kv_layers``), per-layer MLP widths,
global layers of different kv-head counts, and a ``rope_freqs`` tensor that
is not ones followed by 1e30s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from pagedllm.loader.gguf_gemma import GEMMA_LAYER_NAMES

# llama.cpp tensor names (after ``blk.N.``) -> Gemma4ForCausalLM's (after ``model.layers.N.``)
GEMMA4_LAYER_NAMES = {
    **GEMMA_LAYER_NAMES,
    "layer_output_scale.weight": "layer_scalar",
    "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
    "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
    "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
    "ffn_gate_inp.weight": "router.proj.weight",
    "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale",
    # stacked [experts, rows, cols]; gate_up holds each expert's gate rows, then its up rows
    "ffn_gate_up_exps.weight": "experts.gate_up_proj.weight",
    "ffn_down_exps.weight": "experts.down_proj.weight",
}
_LOCAL_THETA = 10_000.0
_UNROTATED = 1e30  # the converter's divisor for a pair that does not rotate (frequency 0)


def gemma4_base_shape(key: Callable[[str], Any]) -> tuple[int, int]:
    """(kv heads, head size) of the sliding layers: the model's ``num_key_value_heads`` and ``head_dim``; read
    first, so a file of a Gemma 4 variant not computed here is refused by name before anything else is read."""
    _refuse_unsupported(key)
    head_dim = key("attention.key_length_swa")
    if head_dim is None:
        raise ValueError("GGUF gemma4 file lacks gemma4.attention.key_length_swa (the sliding layers' head size)")
    kv = key("attention.head_count_kv")
    types = _layer_types(key)
    if isinstance(kv, list):
        sliding = {int(n) for n, t in zip(kv, types) if t == "sliding_attention"}
        if len(kv) != len(types) or len(sliding) > 1:
            raise ValueError(f"GGUF gemma4.attention.head_count_kv {kv} is not one count per layer, the same for "
                             "every sliding layer")
        kv = sliding.pop() if sliding else kv[0]
    if kv is None:
        raise ValueError("GGUF gemma4 file lacks gemma4.attention.head_count_kv")
    return int(kv), int(head_dim)


def _layer_types(key: Callable[[str], Any]) -> tuple[str, ...]:
    pattern, num_layers = key("attention.sliding_window_pattern"), int(key("block_count"))
    if not isinstance(pattern, list) or len(pattern) != num_layers:
        raise ValueError(f"GGUF gemma4.attention.sliding_window_pattern must be one bool per layer "
                         f"({num_layers}), got {pattern!r}")
    return tuple("sliding_attention" if bool(p) else "full_attention" for p in pattern)


def _refuse_unsupported(key: Callable[[str], Any]) -> None:
    if key("embedding_length_per_layer_input"):
        raise ValueError(f"GGUF gemma4 with per-layer embeddings (embedding_length_per_layer_input="
                         f"{key('embedding_length_per_layer_input')}, Gemma 4 E2B/E4B) is not supported")
    if key("attention.shared_kv_layers"):
        raise ValueError(f"GGUF gemma4 with KV sharing between layers (attention.shared_kv_layers="
                         f"{key('attention.shared_kv_layers')}) is not supported")
    if isinstance(key("feed_forward_length"), list):
        raise ValueError("GGUF gemma4 with per-layer MLP widths (feed_forward_length per layer) is not supported")


def _global_kv_heads(key: Callable[[str], Any], types: tuple[str, ...], base_kv: int) -> int:
    kv = key("attention.head_count_kv")
    if not isinstance(kv, list):
        return base_kv
    counts = {int(n) for n, t in zip(kv, types) if t == "full_attention"}
    if len(counts) > 1:
        raise ValueError(f"GGUF gemma4: full-attention layers of different kv-head counts {sorted(counts)} are not "
                         "supported")
    return counts.pop() if counts else base_kv


def _proportional_rope(rope_freqs: tuple[float, ...], global_head_dim: int) -> dict[str, Any]:
    """The global layers' ``rope_scaling`` from the ``rope_freqs`` tensor (see the module docstring)."""
    if len(rope_freqs) != global_head_dim // 2:
        raise ValueError(f"GGUF gemma4: rope_freqs has {len(rope_freqs)} values, the global head of "
                         f"{global_head_dim} has {global_head_dim // 2} pairs")
    rotated = sum(1 for f in rope_freqs if f == 1.0)
    if any(f != 1.0 for f in rope_freqs[:rotated]) or any(f < _UNROTATED for f in rope_freqs[rotated:]):
        raise ValueError("GGUF gemma4: rope_freqs must be ones (rotated pairs) then 1e30s (unrotated), as "
                         f"llama.cpp's converter writes proportional RoPE; got {list(rope_freqs)[:8]}...")
    return {"rope_type": "proportional", "partial_rotary_factor": 2 * rotated / global_head_dim}


def gemma4_gguf_settings(
    key: Callable[[str], Any], tensor_names: Iterable[str], rope_freqs: tuple[float, ...], max_position: int,
) -> dict[str, Any]:
    """The ``ModelArchConfig`` fields of a gemma4 GGUF file beyond the common ones (which hold the sliding
    layers' shape, ``gemma4_base_shape``). ``key(name)`` reads ``gemma4.{name}``; ``tensor_names``: the
    file's tensors; ``rope_freqs``: the ``rope_freqs`` tensor's values."""
    types = _layer_types(key)
    base_kv, head_dim = gemma4_base_shape(key)
    global_head_dim = int(key("attention.key_length") or head_dim)
    rotated_swa = key("rope.dimension_count_swa")
    if rotated_swa is not None and int(rotated_swa) != head_dim:
        raise ValueError(f"GGUF gemma4.rope.dimension_count_swa={rotated_swa} rotates part of the sliding head of "
                         f"{head_dim}: not supported")
    window = key("attention.sliding_window")
    if window is not None and int(window) >= max_position:
        window = None  # never masks anything, as the folder reading has it
    names = set(tensor_names)
    k_eq_v = any(t == "full_attention" and f"blk.{i}.attn_v.weight" not in names for i, t in enumerate(types))
    local = key("rope.freq_base_swa")
    final_cap = key("final_logit_softcapping")
    settings: dict[str, Any] = dict(
        layer_types=types,
        sliding_windows=tuple(None if t == "full_attention" or window is None else int(window) for t in types),
        rope_scaling=_proportional_rope(rope_freqs, global_head_dim) if rope_freqs else None,
        rope_freq_factors=(),  # the global layers' proportional table above, not a divisor of every table
        local_rope_theta=_LOCAL_THETA if local is None else float(local), local_rope_scaling=None,
        hidden_act="gelu_pytorch_tanh", attn_scale=1.0, attn_logit_softcapping=None,
        final_logit_softcapping=None if final_cap is None else float(final_cap),
        global_head_dim=global_head_dim, num_global_key_value_heads=_global_kv_heads(key, types, base_kv),
        attention_k_eq_v=k_eq_v,
    )
    if key("expert_count"):
        settings["norm_topk_prob"] = True  # Gemma 4's router always renormalises its top-k
    return settings
