"""The architecture facts a model needs, read from config.json or GGUF metadata."""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pagedllm.loader.config_fields import check_unread_fields, num_experts
from pagedllm.loader.gated_delta_config import (
    GATED_DELTA_MODEL_TYPES,
    gated_delta_dict,
    hf_gated_delta_fields,
)
from pagedllm.loader.gemma4_config import gemma4_settings, gemma4_text_dict, multimodal_text_dict
from pagedllm.loader.gpt_oss_config import hf_gpt_oss_fields
from pagedllm.loader.granite_hybrid_config import Mamba2Config, hf_granite_hybrid_fields
from pagedllm.loader.lfm2_config import lfm2_fields, lfm2_hf_dict
from pagedllm.loader.moe_config import hf_moe_fields
from pagedllm.loader.moe_families_config import MOE_FAMILY_DEFAULTS, hf_moe_family_fields
from pagedllm.loader.smollm3_granite_config import hf_family_fields

logger = logging.getLogger(__name__)

# how a checkpoint was written: a Hugging Face folder (config.json) or a GGUF file
CHECKPOINT_FORMATS = ("hf", "gguf")
# the rope_types transformers' ROPE_INIT_FUNCTIONS computes (plus "default") that this table design was
# checked against; a type a later transformers adds is refused until it is (it may depend on the sequence,
# as dynamic and longrope do)
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional")


def rope_type_of(scaling: Mapping[str, Any] | None) -> str:
    """The ``rope_type`` a RoPE scaling dict names (``type`` in older configs); "default" for None."""
    if not scaling:
        return "default"
    return scaling.get("rope_type", scaling.get("type")) or "default"


def check_rope_type(scaling: Mapping[str, Any] | None) -> str:
    """The scaling's ``rope_type``; ValueError naming it and the supported ones when it is unknown."""
    kind = rope_type_of(scaling)
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported RoPE scaling rope_type {kind!r}; supported: {SUPPORTED_ROPE_TYPES}")
    return kind


def longrope_switch_len(scaling: Mapping[str, Any] | None, max_position: int) -> int | None:
    """The sequence length past which a ``longrope`` scaling's long factors apply; None where only one set does.

    transformers takes ``short_factor`` for a forward whose longest position
    + 1 is at most ``original_max_position_embeddings`` (its default:
    ``max_position``) and ``long_factor`` beyond. None for another rope type,
    or where the model's positions (``max_position``) never pass the original
    length. A token's choice is ``layers/rotary.py``'s ``longrope_rows``.
    """
    if rope_type_of(scaling) != "longrope":
        return None
    original = int(scaling.get("original_max_position_embeddings") or max_position)
    return original if original < max_position else None


SUPPORTED_ROPE_SCALING = SUPPORTED_ROPE_TYPES  # computed by transformers' ROPE_INIT_FUNCTIONS (layers/rotary.py)
# attention layers keep K/V in the paged pool; the state layers (docs/hybrid-models.md) keep a fixed-size state
# per sequence instead: "linear_attention" (Gated DeltaNet: Qwen3-Next, Qwen3.5), "conv" (LFM2's short conv),
# "mamba" (Mamba-2)
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
STATE_LAYER_TYPES = ("linear_attention", "conv", "mamba")
LAYER_TYPES = ATTENTION_LAYER_TYPES + STATE_LAYER_TYPES


@dataclass(frozen=True)
class ModelArchConfig:
    """Shape and numerics of a decoder, as read from its checkpoint.

    ``architecture`` says how the configuration was read: config.json's
    model_type family ("llama", "mistral", "qwen2", "qwen3", "gemma3", or the
    model_type itself where no reading of its own applies) or a GGUF file's
    ``general.architecture``. ``architectures`` is config.json's list of
    class names (``LlamaForCausalLM``); ``checkpoint_format`` "hf" or
    "gguf". Which model class runs it is ``models/registry.py``'s choice,
    from those names: an architecture no family implements is refused there.

    ``attention_bias`` adds biases to q/k/v (Qwen2); ``qk_norm`` applies an
    RMSNorm to q and k before RoPE (Qwen3, Gemma 3 per head; OLMo 2 over the
    whole projection, the family's choice). ``mlp_bias``: biases on the
    MLP's gate, up and down projections (Llama's ``mlp_bias``).
    ``num_experts``: experts a mixture-of-experts MLP routes between (0: a
    dense MLP; the registry refuses it for a family with no experts). Then
    ``num_experts_per_tok`` experts of ``moe_intermediate_size`` each per
    token, their weights renormalised with ``norm_topk_prob``; the layers of
    ``dense_layers`` keep a dense MLP of ``intermediate_size``; a shared
    expert of ``shared_expert_intermediate_size`` (0: none). Read by
    ``loader/moe_config.py``, then what Mixtral, Qwen2-MoE, OLMoE and
    GraniteMoE read their own way by ``loader/moe_families_config.py``.

    ``rope_freq_factors``: a GGUF file's ``rope_freqs`` tensor, one divisor
    per rotated pair of the RoPE frequencies (llama.cpp's converter writes
    Llama 3.1+'s ``llama3`` scaling this way, with no ``rope_scaling``);
    empty where the checkpoint has none (``layers/rotary.py`` applies them).

    ``sliding_windows`` holds one entry per layer: None for full attention,
    ``w`` for a layer whose query at position ``i`` sees keys at ``i - w < j
    <= i`` (as transformers' masking); empty means every layer is full. The
    KV cache still keeps every block of such a layer: the window is a mask.

    The rest is Gemma's: ``layer_types`` ("sliding_attention" /
    "full_attention" per layer) chooses the RoPE of each Gemma 3 layer, sliding
    layers taking ``local_rope_theta`` / ``local_rope_scaling``;
    ``attn_scale`` replaces ``head_dim**-0.5``; the softcaps bound attention
    scores and final logits by ``cap * tanh(x / cap)`` (Gemma 2 caps both;
    transformers' Gemma 3 caps logits only, so its configs' score cap is read as None). ``hidden_act`` is the
    MLP's gate activation as transformers names it (config.json's
    ``hidden_act`` / ``hidden_activation``); the MLP layer refuses a name it
    does not compute (``layers/activation.py``).

    ``partial_rotary_factor``: the part of each head RoPE rotates (Phi-4-mini:
    0.75); read for Phi-3 only (config.json or GGUF ``rope.dimension_count``).
    Other families keep 1.0, as their transformers models rotate the whole
    head; a partial factor inside their RoPE scaling is refused by the table.

    ``nope_layers``: the layers that do not rotate q and k (SmolLM3's every
    fourth). Granite's multipliers: ``embedding_multiplier`` scales the
    embeddings, ``residual_multiplier`` each branch before its residual
    add, ``logits_scaling`` divides the logits (its ``attention_multiplier``
    is ``attn_scale``); 1.0 where a family has none. Both are read by
    ``loader/smollm3_granite_config.py``.

    Gemma 4's global layers (``layer_types`` "full_attention") have their own
    head size ``global_head_dim`` and ``num_global_key_value_heads`` (0: the
    model's layers all have ``head_dim`` / ``num_key_value_heads``), and with
    ``attention_k_eq_v`` no v projection, the values being the keys'
    projection (``loader/gemma4_config.py``; ``attention_shape`` per layer).

    gpt-oss's (``loader/gpt_oss_config.py``): ``attention_sinks``, a learned
    logit per query head in every layer's softmax denominator; the experts'
    clamped SwiGLU constants ``swiglu_alpha`` and ``swiglu_limit`` (read with
    ``hidden_act`` "swiglu_oai").
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False
    rope_scaling: dict[str, Any] | None = None
    rope_freq_factors: tuple[float, ...] = ()
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    sliding_windows: tuple[int | None, ...] = ()
    layer_types: tuple[str, ...] = ()
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = None
    hidden_act: str = "silu"
    attn_scale: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    architectures: tuple[str, ...] = ()
    checkpoint_format: str = "hf"
    nope_layers: tuple[int, ...] = ()
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    mlp_bias: bool = False
    num_experts: int = 0
    partial_rotary_factor: float = 1.0
    attention_sinks: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    dense_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0
    global_head_dim: int = 0
    num_global_key_value_heads: int = 0
    attention_k_eq_v: bool = False
    # a short conv's taps and whether it (and its projections) add biases: LFM2's "conv" layers
    # (loader/lfm2_config.py); 0: no conv layers
    conv_kernel_size: int = 0
    conv_bias: bool = False
    # Gated DeltaNet layers (Qwen3-Next, Qwen3.5: loader/gated_delta_config.py); 0: none
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    # out_proj's value heads in the converter's tiled order (qwen35 / qwen35moe GGUFs with more value than key
    # heads: layers/gated_deltanet.py's GatedDeltaNetSpec.out_proj_tiled); False: grouped, as checkpoints hold them
    linear_out_proj_tiled: bool = False
    # Granite 4.0-H's Mamba-2 layers (loader/granite_hybrid_config.py); None: the model has none
    mamba: Mamba2Config | None = None

    def __post_init__(self) -> None:
        if self.checkpoint_format not in CHECKPOINT_FORMATS:
            raise ValueError(f"checkpoint_format must be one of {CHECKPOINT_FORMATS}, got {self.checkpoint_format!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        for scaling in (self.rope_scaling, self.local_rope_scaling):
            check_rope_type(scaling)  # its parameters are checked when the model's RoPE tables are built
        self._check_layers()
        self._check_global_attention()
        check_multipliers(self)
        self._check_experts()
        for name in ("attn_scale", "attn_logit_softcapping", "final_logit_softcapping"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive or null, got {value!r}")

    def _check_layers(self) -> None:
        for name in ("sliding_windows", "layer_types"):
            entries = getattr(self, name)
            if entries and len(entries) != self.num_hidden_layers:
                raise ValueError(f"{name} has {len(entries)} entries for {self.num_hidden_layers} layers")
        for w in self.sliding_windows:
            if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w <= 0):
                raise ValueError(f"a sliding window must be a positive number of tokens or null, got {w!r}")
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ValueError(f"unsupported layer types {bad}; supported: {LAYER_TYPES}")

    def _check_global_attention(self) -> None:
        if not self.global_head_dim and not self.num_global_key_value_heads:
            return
        if self.global_head_dim <= 0 or self.num_global_key_value_heads <= 0:
            raise ValueError("global_head_dim and num_global_key_value_heads must both be positive (or both 0)")
        if self.num_attention_heads % self.num_global_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_global_key_value_heads")

    def attention_shape(self, layer: int) -> tuple[int, int]:
        """(kv heads, head size) of ``layer``: a full-attention layer's own where the model gives global layers
        another shape (Gemma 4), else ``num_key_value_heads`` and ``head_dim``."""
        if self.global_head_dim and self.layer_types and self.layer_types[layer] == "full_attention":
            return self.num_global_key_value_heads, self.global_head_dim
        return self.num_key_value_heads, self.head_dim

    @property
    def cache_kv_heads(self) -> int:
        """kv heads one layer's slice of the KV cache holds per token: the most any layer has (a layer with
        fewer repeats its heads into them, ``layers/gemma4_attention.py``)."""
        return max((self.attention_shape(i)[0] for i in self.attention_layers), default=self.num_key_value_heads)

    @property
    def cache_head_dim(self) -> int:
        """Head size of the KV cache: the largest any layer has (a smaller head is padded with zeros)."""
        return max((self.attention_shape(i)[1] for i in self.attention_layers), default=self.head_dim)

    def _check_experts(self) -> None:
        if not self.num_experts:
            return
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be between 1 and num_experts={self.num_experts}, "
                             f"got {self.num_experts_per_tok!r}")
        if self.moe_intermediate_size <= 0:
            raise ValueError(f"moe_intermediate_size must be positive, got {self.moe_intermediate_size!r}")
        bad = [i for i in self.dense_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(f"dense_layers {bad} are not layers of a {self.num_hidden_layers}-layer model")

    def is_sparse(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is a mixture of experts."""
        return bool(self.num_experts) and layer not in self.dense_layers

    def sliding_window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` in tokens; None: full attention."""
        return self.sliding_windows[layer] if self.sliding_windows else None

    @property
    def longrope_switch_len(self) -> int | None:
        """Where longrope switches to its long factors (``longrope_switch_len``); None: one set of factors."""
        return longrope_switch_len(self.rope_scaling, self.max_position_embeddings)

    def is_attention_layer(self, layer: int) -> bool:
        """Whether ``layer`` keeps K/V in the paged pool (every layer of a model without ``layer_types``)."""
        return not self.layer_types or self.layer_types[layer] in ATTENTION_LAYER_TYPES

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers with K/V in the pool, in order: layer ``attention_layers[r]`` owns the pool's row ``r``
        (``runner/kv_cache.py``'s ``kv_cache_rows``); the others are state layers."""
        return tuple(i for i in range(self.num_hidden_layers) if self.is_attention_layer(i))

    @property
    def has_state_layers(self) -> bool:
        """Whether any layer keeps a per-sequence state (a hybrid model: docs/hybrid-models.md)."""
        return any(t in STATE_LAYER_TYPES for t in self.layer_types)

    @property
    def has_sliding_window(self) -> bool:
        """Whether any layer attends through a sliding window."""
        return any(w is not None for w in self.sliding_windows)


def check_multipliers(cfg: ModelArchConfig) -> None:
    """ValueError for a layer index of ``nope_layers`` out of range or a multiplier not finite and positive."""
    bad = [i for i in cfg.nope_layers if isinstance(i, bool) or not isinstance(i, int)
           or not 0 <= i < cfg.num_hidden_layers]
    if bad:
        raise ValueError(f"nope_layers {bad} are not layers of a {cfg.num_hidden_layers}-layer model")
    for name in ("embedding_multiplier", "residual_multiplier", "logits_scaling"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a finite positive number, got {value!r}")


# config.json's model_type -> the reading of its keys (any other model_type is read as Llama's keys)
_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral", "gemma3_text": "gemma3",
                "phi3": "phi3", "gemma2": "gemma2", "gemma4_text": "gemma4"}
# what transformers' config classes assume when config.json leaves a key out
_REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_DEFAULT_WINDOW = 4096  # MistralConfig, Qwen2Config, Qwen3Config, Gemma3TextConfig
_QWEN_MAX_WINDOW_LAYERS = 28
_RMS_NORM_EPS_DEFAULTS = {"olmo2": 1e-5, "olmoe": 1e-5, "mixtral": 1e-5}  # Olmo2Config's; every other family's is 1e-6
_GEMMA3_DEFAULTS = {"head_dim": 256, "max_position_embeddings": 131072, "tie_word_embeddings": True,
                    "query_pre_attn_scalar": 256, "sliding_window_pattern": 6}
# Gemma2Config's defaults for the keys this reading needs (its softcaps are applied, unlike Gemma 3's)
_GEMMA2_DEFAULTS = {"head_dim": 256, "max_position_embeddings": 8192, "tie_word_embeddings": True,
                    "query_pre_attn_scalar": 256, "sliding_window": 4096, "attn_logit_softcapping": 50.0,
                    "final_logit_softcapping": 30.0}


def _scaling_or_none(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    if rope_type_of(scaling) == "default":
        return None
    return scaling


def _rope_settings(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    # transformers 5 folds rope_theta and rope_scaling into rope_parameters
    params = cfg.get("rope_parameters") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = _scaling_or_none(cfg.get("rope_scaling") or params)
    if scaling is not None and cfg.get("partial_rotary_factor") is not None:
        # transformers moves a top-level partial_rotary_factor into the RoPE parameters, where the scaled
        # initialisers read it (the default one ignores it); the RoPE layer refuses a partial rotation
        scaling = {"partial_rotary_factor": cfg["partial_rotary_factor"], **scaling}
    return float(theta), scaling


def _gemma3_rope_settings(cfg: dict[str, Any]) -> tuple[float, dict | None, float, dict | None]:
    """(theta, scaling) of full-attention layers, then of sliding ones, as Gemma3TextConfig reads them.

    transformers 5 writes ``rope_parameters`` keyed by layer type; older
    configs have ``rope_theta`` / ``rope_scaling`` (full layers) and
    ``rope_local_base_freq`` (sliding layers).
    """
    params = cfg.get("rope_parameters") or {}
    if params and not set(params) & set(LAYER_TYPES):
        raise ValueError(f"gemma3: rope_parameters must be keyed by layer type {LAYER_TYPES}, got {sorted(params)}")
    full = dict(params.get("full_attention") or {})
    if not params and cfg.get("rope_scaling"):
        full.update(cfg["rope_scaling"])
    local = dict(params.get("sliding_attention") or {})
    theta = float(full.get("rope_theta", cfg.get("rope_theta", 1_000_000.0)))
    local_theta = float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10_000.0)))
    return theta, _scaling_or_none(full), local_theta, _scaling_or_none(local)


def _layer_types(cfg: dict[str, Any], arch: str, window: int | None) -> tuple[str, ...]:
    """Per-layer attention kind: config.json's ``layer_types``, else derived as transformers' config does."""
    n = cfg["num_hidden_layers"]
    if cfg.get("layer_types") is not None:
        return tuple(cfg["layer_types"])
    if arch == "gemma3":
        # every pattern-th layer is global (Gemma3TextConfig.__post_init__)
        pattern = cfg.get("sliding_window_pattern", _GEMMA3_DEFAULTS["sliding_window_pattern"])
        if not isinstance(pattern, int) or pattern <= 0:
            raise ValueError(f"gemma3: sliding_window_pattern must be a positive integer, got {pattern!r}")
        return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n))
    if arch == "gemma2":
        # even layers slide, odd ones are global (Gemma2Config.__post_init__)
        return tuple("sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n))
    # Qwen2/Qwen3: layers from max_window_layers on slide, when the window is on
    first = cfg.get("max_window_layers", _QWEN_MAX_WINDOW_LAYERS)
    return tuple("sliding_attention" if window is not None and i >= first else "full_attention" for i in range(n))


def _sliding_windows(cfg: dict[str, Any], arch: str) -> tuple[tuple[int | None, ...], tuple[str, ...]]:
    """(window per layer, layer types) as transformers' models apply them; () where the family has none."""
    if arch not in ("mistral", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3", "gemma4"):
        return (), ()
    window = cfg.get("sliding_window", _DEFAULT_WINDOW)
    if arch in ("qwen2", "qwen3", "qwen3_moe") and not cfg.get("use_sliding_window", False):
        window = None  # Qwen configs carry a window but switch it off with use_sliding_window
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        raise ValueError(f"sliding_window must be a positive number of tokens or null, got {window!r}")
    types = _layer_types(cfg, arch, window)
    if arch in ("mistral", "qwen3_moe"):
        # MistralAttention and Qwen3MoeAttention apply config.sliding_window to every layer (no layer_types)
        types = ("sliding_attention" if window is not None else "full_attention",) * cfg["num_hidden_layers"]
    if arch in ("gemma2", "gemma3", "gemma4") and window is None and "sliding_attention" in types:
        raise ValueError(f"{arch}: sliding_attention layers need a sliding_window")
    # a window as long as the positions RoPE covers never masks anything: full attention
    max_pos = cfg.get("max_position_embeddings", 2048)
    if window is not None and window >= max_pos:
        window = None
    return tuple(window if t == "sliding_attention" else None for t in types), types


def _gemma3_settings(cfg: dict[str, Any]) -> dict[str, Any]:
    """The ModelArchConfig fields only Gemma 3 sets."""
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("gemma3 with use_bidirectional_attention is not supported (causal decoding only)")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    theta, scaling, local_theta, local_scaling = _gemma3_rope_settings(cfg)
    scalar = cfg.get("query_pre_attn_scalar", _GEMMA3_DEFAULTS["query_pre_attn_scalar"])
    if not isinstance(scalar, (int, float)) or scalar <= 0:
        raise ValueError(f"gemma3: query_pre_attn_scalar must be positive, got {scalar!r}")
    if cfg.get("attn_logit_softcapping") is not None:
        # Gemma3Attention keeps the value but never hands it to the attention
        # function (Gemma 2 does): Gemma 3's scores are not capped, so neither are ours
        logger.warning(
            "gemma3: attn_logit_softcapping=%s is ignored, as transformers' Gemma 3 ignores it",
            cfg["attn_logit_softcapping"],
        )
    return dict(
        rope_theta=theta, rope_scaling=scaling, local_rope_theta=local_theta, local_rope_scaling=local_scaling,
        hidden_act=act, attn_scale=float(scalar) ** -0.5, attn_logit_softcapping=None,
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
    )


_PHI3_ORIGINAL_MAX_POSITION = 4096  # Phi3Config's original_max_position_embeddings default


def _phi3_settings(cfg: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's RoPE as ``Phi3Config`` reads it: theta, longrope scaling, the part of each head rotated.

    ``rope_type`` "su" and "yarn" (older Phi-3 configs) are Phi-3's names
    for longrope; the top-level ``original_max_position_embeddings`` (4096
    when absent) wins over the scaling's own, as transformers'
    ``standardize_rope_params`` gives it priority; ``partial_rotary_factor``
    is the RoPE parameters' (else the top-level one, else 1.0).
    """
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor") or 1.0))
    kind = params.get("rope_type", params.get("type"))
    scaling = None
    if kind in ("su", "yarn", "longrope"):
        original = cfg.get("original_max_position_embeddings", _PHI3_ORIGINAL_MAX_POSITION)
        scaling = {k: v for k, v in params.items() if k not in ("type", "rope_theta", "partial_rotary_factor")}
        scaling.update(rope_type="longrope", original_max_position_embeddings=int(original))
    elif kind not in (None, "default"):
        # Phi3Config.validate_rope accepts these two only
        raise ValueError(f"phi3: unsupported rope_type {kind!r}; Phi-3 takes 'default' or 'longrope' ('su', 'yarn')")
    return dict(rope_theta=theta, rope_scaling=scaling, partial_rotary_factor=partial,
                hidden_act=cfg.get("hidden_act") or "silu")


def _phi3_windows(cfg: dict[str, Any]) -> tuple[tuple[int | None, ...], tuple[str, ...]]:
    """Phi-3's window: transformers' Phi3Attention applies ``sliding_window`` (None by default) to every layer."""
    window = cfg.get("sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        raise ValueError(f"sliding_window must be a positive number of tokens or null, got {window!r}")
    if window is None or window >= cfg.get("max_position_embeddings", 4096):
        return (), ()  # never masks a position the RoPE table covers: full attention
    n = cfg["num_hidden_layers"]
    return (window,) * n, ("sliding_attention",) * n


def _gemma2_settings(cfg: dict[str, Any]) -> dict[str, Any]:
    """The ModelArchConfig fields Gemma 2 sets: one RoPE table, both softcaps applied (Gemma2Attention hands
    ``attn_logit_softcapping`` to the attention, unlike Gemma 3), ``query_pre_attn_scalar ** -0.5``."""
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("gemma2 with use_bidirectional_attention is not supported (causal decoding only)")
    theta, scaling = _rope_settings(cfg)
    scalar = cfg["query_pre_attn_scalar"]
    if isinstance(scalar, bool) or not isinstance(scalar, (int, float)) or scalar <= 0:
        raise ValueError(f"gemma2: query_pre_attn_scalar must be positive, got {scalar!r}")
    return dict(
        rope_theta=theta, rope_scaling=scaling, attn_scale=float(scalar) ** -0.5,
        hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh",
        attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
    )


# the readings of their own (RoPE tables, activation, score scale, softcaps) of Gemma's model types
_GEMMA_SETTINGS = {"gemma2": _gemma2_settings, "gemma3": _gemma3_settings, "gemma4": gemma4_settings}


def _eos_ids(cfg: dict[str, Any], generation_config: dict[str, Any] | None) -> tuple[int, ...]:
    for source in (generation_config or {}, cfg):
        value = source.get("eos_token_id")
        if value is not None:
            return tuple(value if isinstance(value, list) else [value])
    return ()


def from_hf_config(cfg: dict[str, Any], generation_config: dict[str, Any] | None = None) -> ModelArchConfig:
    """Build from a Hugging Face ``config.json`` dictionary; unsupported settings raise ValueError."""
    model_type = cfg.get("model_type")
    if model_type == "gemma3":
        # Gemma3ForConditionalGeneration: its text weights sit under other names beside a vision tower
        raise ValueError(
            "multimodal Gemma 3 checkpoints (model_type 'gemma3') are not supported; "
            "use a text-only Gemma3ForCausalLM checkpoint (model_type 'gemma3_text')"
        )
    if model_type == "gemma4":
        # Gemma4ForConditionalGeneration: its text model is read (models/gemma4.py skips the other towers)
        cfg = multimodal_text_dict(cfg)
        model_type = cfg["model_type"]
    if not isinstance(model_type, str) or not model_type:
        raise ValueError(f"config.json has no model_type (got {model_type!r})")
    arch = _MODEL_TYPES.get(model_type) or GATED_DELTA_MODEL_TYPES.get(model_type, model_type)
    # the config class's defaults where config.json leaves a key out (an experts' count, widths...)
    cfg = gated_delta_dict({**MOE_FAMILY_DEFAULTS.get(arch, {}), **cfg}, arch)
    if arch in ("gemma2", "gemma3"):
        # the config class's defaults where config.json leaves a key out
        cfg = {**(_GEMMA3_DEFAULTS if arch == "gemma3" else _GEMMA2_DEFAULTS), **cfg}
    elif arch == "gemma4":
        cfg = gemma4_text_dict(cfg)
    elif arch == "lfm2":
        cfg = lfm2_hf_dict(cfg)
    missing = [k for k in _REQUIRED_KEYS if cfg.get(k) is None]
    if missing:
        raise ValueError(f"config.json ({model_type}) lacks {missing}")
    check_unread_fields(cfg, arch)
    num_heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
    theta, scaling = _rope_settings(cfg)
    windows, types = _phi3_windows(cfg) if arch == "phi3" else _sliding_windows(cfg, arch)
    if arch in _GEMMA_SETTINGS:
        extra = _GEMMA_SETTINGS[arch](cfg)
    elif arch == "phi3":
        extra = _phi3_settings(cfg)
    else:
        extra = {"rope_theta": theta, "rope_scaling": scaling, "hidden_act": cfg.get("hidden_act") or "silu"}
    config = ModelArchConfig(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=num_heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", _RMS_NORM_EPS_DEFAULTS.get(arch, 1e-6))),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        # transformers' Qwen2 biases q, k and v whatever attention_bias says
        attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
        qk_norm=arch in ("qwen3", "qwen3_moe", "gemma3", "gemma4", "olmo2"),  # RMSNorm on q and k
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        num_experts=num_experts(cfg),
        **hf_moe_fields(cfg, num_experts(cfg)),
        eos_token_ids=_eos_ids(cfg, generation_config),
        sliding_windows=windows,
        layer_types=types,
        architectures=tuple(cfg.get("architectures") or ()),
        checkpoint_format="hf",
        **extra,
    )
    config = lfm2_fields(hf_gpt_oss_fields(hf_moe_family_fields(hf_family_fields(config, cfg), cfg), cfg), cfg)
    return hf_granite_hybrid_fields(hf_gated_delta_fields(config, cfg), cfg)


def from_hf_folder(path: str) -> ModelArchConfig:
    """Read ``config.json`` (and ``generation_config.json`` if present)."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"{path!r} has no config.json")
    with open(config_path) as f:
        cfg = json.load(f)
    gen_path = os.path.join(path, "generation_config.json")
    gen = None
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            gen = json.load(f)
    return from_hf_config(cfg, gen)
