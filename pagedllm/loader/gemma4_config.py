"""Gemma 4's text configuration (transformers' ``Gemma4TextConfig``, model_type ``gemma4_text``), read from config.json.

What Gemma 4 adds to Gemma 3's reading, each as transformers 5 computes it:

- two attention shapes: sliding layers have ``head_dim`` and
  ``num_key_value_heads``, full-attention ("global") layers their own head
  size and kv-head count. transformers 5 saves those as ``per_layer_config``
  (layer index -> ``{"head_dim", "num_key_value_heads"}``); a config
  without it gives them as ``global_head_dim`` (default 512) and
  ``num_global_key_value_heads`` (read only with ``attention_k_eq_v``, as
  ``Gemma4TextConfig.__post_init__`` reads it);
- ``attention_k_eq_v``: global layers have no v projection; their values are
  the k projection's output (before k's norm);
- RoPE per layer type (``rope_parameters`` keyed by "sliding_attention" /
  "full_attention"): sliding layers the default table, global ones
  ``proportional`` with a ``partial_rotary_factor`` (the first part of each
  half of the head rotates, the rest keeps frequency 0);
- ``layer_types`` (default: every sixth layer global) with the last layer
  always global, as transformers forces it;
- the mixture of experts beside the dense MLP (``enable_moe_block``):
  ``num_experts``, ``top_k_experts`` per token, experts of
  ``moe_intermediate_size``; the router always renormalises its top-k;
- scores are not scaled (``scaling = 1.0``: q and k are RMS-normed per
  head instead); logits are capped by ``final_logit_softcapping``.

Refused by name, as not computed here: per-layer embeddings
(``hidden_size_per_layer_input``, Gemma 4 E2B/E4B; transformers' default is
256, so a config.json that leaves it out has them), KV sharing between
layers (``num_kv_shared_layers``), bidirectional attention over all tokens
(``use_bidirectional_attention: "all"``), and a ``per_layer_config`` that
overrides anything but a global layer's head size and kv heads.
A Gemma4ForConditionalGeneration folder (model_type ``gemma4``, the Hub's
releases) is read for its text model: ``text_config`` with the outer
``architectures`` and ``tie_word_embeddings`` (``multimodal_text_dict``);
its vision and audio towers are not loaded (``models/gemma4.py``), so images
and audio are not supported, only text.
"""

from __future__ import annotations

from typing import Any

# Gemma4TextConfig's defaults for the keys this reading needs
GEMMA4_DEFAULTS: dict[str, Any] = {
    "head_dim": 256, "max_position_embeddings": 131072, "tie_word_embeddings": True, "sliding_window": 512,
    "hidden_size_per_layer_input": 256, "rms_norm_eps": 1e-6,
}
_DEFAULT_GLOBAL_HEAD_DIM = 512
_SLIDING_PATTERN = 6  # every sixth layer global, when config.json has no layer_types
_DEFAULT_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}


def multimodal_text_dict(cfg: dict[str, Any]) -> dict[str, Any]:
    """A Gemma4ForConditionalGeneration config.json's text model as a ``gemma4_text`` config.json: its
    ``text_config``, under the outer ``architectures`` and LM-head tie (transformers ties the outer model's head)."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"gemma4: a Gemma4ForConditionalGeneration config.json needs a text_config, got {text!r}")
    tie = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", GEMMA4_DEFAULTS["tie_word_embeddings"]))
    return {**text, "model_type": "gemma4_text", "architectures": cfg.get("architectures") or [],
            "tie_word_embeddings": tie}


def gemma4_text_dict(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json ``cfg`` with Gemma4TextConfig's defaults filled in, its layer types resolved and its experts in
    the keys ``loader/moe_config.py`` reads; ValueError naming a feature this package does not compute."""
    cfg = {**GEMMA4_DEFAULTS, **cfg}
    _refuse_unsupported(cfg)
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + 1) % _SLIDING_PATTERN else "full_attention" for i in range(n)]
    types = list(types)
    if types and types[-1] != "full_attention":
        types[-1] = "full_attention"  # Gemma4TextConfig forces the last layer global
    out = {**cfg, "layer_types": types}
    if cfg.get("enable_moe_block"):
        out.update(num_experts=cfg.get("num_experts"), num_experts_per_tok=cfg.get("top_k_experts"),
                   norm_topk_prob=True)
    else:  # the experts' counts are not read without the block
        out.update(num_experts=None, num_experts_per_tok=None)
    return out


def _refuse_unsupported(cfg: dict[str, Any]) -> None:
    if cfg.get("hidden_size_per_layer_input"):
        raise ValueError(
            f"gemma4: per-layer embeddings (hidden_size_per_layer_input={cfg['hidden_size_per_layer_input']}, "
            "Gemma 4 E2B/E4B) are not supported; set it to 0 only for a checkpoint without them")
    if cfg.get("num_kv_shared_layers"):
        raise ValueError(f"gemma4: KV sharing between layers (num_kv_shared_layers={cfg['num_kv_shared_layers']}) "
                         "is not supported")
    if cfg.get("use_bidirectional_attention") == "all":
        raise ValueError("gemma4 with use_bidirectional_attention='all' is not supported (causal decoding only)")
    if cfg.get("use_bidirectional_attention") not in (None, "vision"):
        raise ValueError(f"gemma4: unknown use_bidirectional_attention {cfg['use_bidirectional_attention']!r}")


def _global_attention_shape(cfg: dict[str, Any]) -> tuple[int, int]:
    """(head size, kv heads) of the full-attention layers; ValueError for overrides of anything else, or
    global layers that differ."""
    types = cfg["layer_types"]
    overrides = cfg.get("per_layer_config")
    if overrides is None:
        head_dim = cfg.get("global_head_dim") or _DEFAULT_GLOBAL_HEAD_DIM
        kv = cfg.get("num_global_key_value_heads") if cfg.get("attention_k_eq_v") else None
        return int(head_dim), int(kv or cfg["num_key_value_heads"])
    if not isinstance(overrides, dict):
        raise ValueError(f"gemma4: per_layer_config must map layer indices to settings, got {overrides!r}")
    shapes = set()
    for key, layer in overrides.items():
        index = int(key)
        if not 0 <= index < len(types) or not isinstance(layer, dict):
            raise ValueError(f"gemma4: per_layer_config entry {key!r} is not a layer's settings")
        unknown = sorted(set(layer) - {"head_dim", "num_key_value_heads"})
        if unknown or types[index] != "full_attention":
            raise ValueError(f"gemma4: per_layer_config sets {sorted(layer)} for layer {index} "
                             f"({types[index]}); only a full-attention layer's head_dim and num_key_value_heads "
                             "are supported")
        shapes.add((layer.get("head_dim", cfg["head_dim"]), layer.get("num_key_value_heads", cfg["num_key_value_heads"])))
    missing = [i for i, t in enumerate(types) if t == "full_attention" and str(i) not in map(str, overrides)]
    if missing:
        shapes.add((cfg["head_dim"], cfg["num_key_value_heads"]))
    if len(shapes) > 1:
        raise ValueError(f"gemma4: full-attention layers of different shapes {sorted(shapes)} are not supported")
    head_dim, kv = shapes.pop() if shapes else (cfg["head_dim"], cfg["num_key_value_heads"])
    return int(head_dim), int(kv)


def _rope(cfg: dict[str, Any], layer_type: str) -> tuple[float, dict[str, Any] | None]:
    params = cfg.get("rope_parameters") or _DEFAULT_ROPE
    if not set(params) <= {"sliding_attention", "full_attention"}:
        raise ValueError(f"gemma4: rope_parameters must be keyed by layer type, got {sorted(params)}")
    table = dict(params.get(layer_type) or _DEFAULT_ROPE[layer_type])
    theta = float(table.pop("rope_theta", _DEFAULT_ROPE[layer_type]["rope_theta"]))
    kind = table.get("rope_type", "default")
    if kind == "default":
        if table.get("partial_rotary_factor") not in (None, 1, 1.0):
            raise ValueError(f"gemma4: partial_rotary_factor under the default RoPE ({layer_type}) is not supported")
        return theta, None
    return theta, table


def gemma4_settings(cfg: dict[str, Any]) -> dict[str, Any]:
    """The ModelArchConfig fields of Gemma 4 (``cfg`` as ``gemma4_text_dict`` returns it)."""
    theta, scaling = _rope(cfg, "full_attention")
    local_theta, local_scaling = _rope(cfg, "sliding_attention")
    global_head_dim, global_kv_heads = _global_attention_shape(cfg)
    k_eq_v = cfg.get("attention_k_eq_v", False)
    if not isinstance(k_eq_v, bool):
        raise ValueError(f"gemma4: attention_k_eq_v must be true or false, got {k_eq_v!r}")
    return dict(
        rope_theta=theta, rope_scaling=scaling, local_rope_theta=local_theta, local_rope_scaling=local_scaling,
        hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh",
        attn_scale=1.0, attn_logit_softcapping=None, final_logit_softcapping=cfg.get("final_logit_softcapping"),
        global_head_dim=global_head_dim, num_global_key_value_heads=global_kv_heads, attention_k_eq_v=k_eq_v,
    )
