"""The routing of Mixtral, Qwen2-MoE, OLMoE and GraniteMoE, read from config.json or GGUF metadata.

Each reader takes the ``ModelArchConfig`` the generic reading made
(``model_config.from_hf_config``, ``gguf_loader.read_config``) and returns
it with the mixture-of-experts fields set (``num_experts_per_tok``,
``moe_intermediate_size``, ``norm_topk_prob``,
``shared_expert_intermediate_size``, ``dense_layers``) and what else the
family reads its own way; any other architecture passes through.

config.json, as transformers 5.25's config classes and models read it (the
class's default where a key is left out):

- ``mixtral`` (``MixtralConfig``): top-``num_experts_per_tok`` (2) of
  ``num_local_experts`` by softmax, the chosen weights renormalised; every
  expert ``intermediate_size`` wide; ``sliding_window`` (null) on every
  layer, as Mistral; RoPE theta 1e6 and ``rms_norm_eps`` 1e-5 by default
  (``model_config``'s defaults table).
- ``qwen2_moe`` (``Qwen2MoeConfig``): top-4 of ``num_experts`` by softmax,
  renormalised only with ``norm_topk_prob`` (false); experts
  ``moe_intermediate_size`` (1408) wide, plus a shared expert
  ``shared_expert_intermediate_size`` (5632) wide whose output is scaled by
  ``sigmoid(shared_expert_gate(x))``; q/k/v biased by ``qkv_bias`` (true),
  the output never; a layer listed in ``mlp_only_layers``, or not on the
  ``decoder_sparse_step``, is a dense MLP ``intermediate_size`` wide.
  ``use_sliding_window`` is refused (its windows are off in every published
  checkpoint, and the config class's layer pattern is its own).
- ``olmoe`` (``OlmoeConfig``): top-8 by softmax, ``norm_topk_prob`` false;
  experts ``intermediate_size`` wide; q and k RMS-normed over the whole
  projection (as OLMo 2); ``rms_norm_eps`` 1e-5; ``clip_qkv`` other than
  null is refused (``config_fields.py``: not computed here).
- ``granitemoe`` (``GraniteMoeConfig``): the top-2 router logits
  softmaxed (the same weights as softmax-then-renormalise); experts
  ``intermediate_size`` wide; Granite's four multipliers
  (``loader/smollm3_granite_config.py`` reads them).

GGUF, as llama.cpp's converter writes them: ``<arch>.expert_count`` and
``expert_used_count``; ``expert_feed_forward_length`` where the experts'
width is not ``feed_forward_length`` (``qwen2moe``), and
``expert_shared_feed_forward_length``. Mixtral is written as architecture
``llama`` with an expert count. Whether the top-k weights are renormalised
is no key of these files: llama.cpp's graphs renormalise for ``llama``
(Mixtral) and ``granitemoe``, not for ``qwen2moe`` and ``olmoe``, and so do
we (an ``expert_weights_norm`` key, where a file has one, wins). A Qwen2-MoE
folder with ``norm_topk_prob`` true thus converts to a file that runs
another model, in llama.cpp as here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

# model_config imports this module, so the configuration is typed by a variable (a ModelArchConfig)
ArchConfig = TypeVar("ArchConfig")

MOE_FAMILY_TYPES = ("mixtral", "qwen2_moe", "olmoe", "granitemoe")
# the config classes' defaults of the keys these readings need, where config.json leaves them out
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "mixtral": {"num_experts_per_tok": 2},
    "qwen2_moe": {"num_experts_per_tok": 4, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
                  "norm_topk_prob": False, "qkv_bias": True, "decoder_sparse_step": 1},
    "olmoe": {"num_experts_per_tok": 8, "norm_topk_prob": False},
    "granitemoe": {"num_experts_per_tok": 2},
}
_MIXTRAL_DEFAULT_THETA = 1_000_000.0  # MixtralConfig.default_theta
# llama.cpp's graphs: whether the chosen experts' weights are renormalised, per GGUF architecture
_GGUF_NORM_TOPK = {"llama": True, "qwen2moe": False, "olmoe": False, "granitemoe": True}


def _positive_int(value: object, name: str, arch: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{arch}: {name} must be a positive integer, got {value!r}")
    return value


def hf_moe_fields(config: ArchConfig, cfg: dict[str, Any]) -> ArchConfig:
    """``config`` with the routing (and each family's own keys) read from config.json ``cfg``; others unchanged."""
    arch = config.architecture
    if arch not in MOE_FAMILY_TYPES:
        return config
    cfg = {**_HF_DEFAULTS[arch], **cfg}
    fields: dict[str, Any] = {
        "num_experts_per_tok": _positive_int(cfg["num_experts_per_tok"], "num_experts_per_tok", arch),
        "moe_intermediate_size": config.intermediate_size,
        "norm_topk_prob": True if arch in ("mixtral", "granitemoe") else bool(cfg.get("norm_topk_prob")),
    }
    if arch == "mixtral":
        fields.update(_mixtral_hf(cfg, config.num_hidden_layers, config.max_position_embeddings))
    elif arch == "qwen2_moe":
        fields.update(_qwen2_moe_hf(cfg, config.num_hidden_layers, config.num_experts))
    elif arch == "olmoe":
        fields["qk_norm"] = True
    return dataclasses.replace(config, **fields)


def _mixtral_hf(cfg: dict[str, Any], num_layers: int, max_position: int) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    params = cfg.get("rope_parameters") or {}
    if "rope_theta" not in params and "rope_theta" not in cfg:
        fields["rope_theta"] = _MIXTRAL_DEFAULT_THETA
    window = cfg.get("sliding_window")
    if window is not None:
        # MixtralAttention applies the window to every layer, as Mistral's does
        window = _positive_int(window, "sliding_window", "mixtral")
        if window < max_position:
            fields["sliding_windows"] = (window,) * num_layers
            fields["layer_types"] = ("sliding_attention",) * num_layers
    return fields


def _qwen2_moe_hf(cfg: dict[str, Any], num_layers: int, num_experts: int) -> dict[str, Any]:
    if cfg.get("use_sliding_window"):
        raise ValueError("qwen2_moe: use_sliding_window is not supported; set it to false")
    step = _positive_int(cfg["decoder_sparse_step"], "decoder_sparse_step", "qwen2_moe")
    only_dense = cfg.get("mlp_only_layers") or []
    if not isinstance(only_dense, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in only_dense):
        raise ValueError(f"qwen2_moe: mlp_only_layers must list layer indices, got {only_dense!r}")
    # Qwen2MoeDecoderLayer: a sparse block unless listed, or off the step
    dense = tuple(i for i in range(num_layers)
                  if i in only_dense or not (num_experts > 0 and (i + 1) % step == 0))
    return {
        "moe_intermediate_size": _positive_int(cfg["moe_intermediate_size"], "moe_intermediate_size", "qwen2_moe"),
        "shared_expert_intermediate_size": _positive_int(
            cfg["shared_expert_intermediate_size"], "shared_expert_intermediate_size", "qwen2_moe"),
        "attention_bias": bool(cfg["qkv_bias"]),
        "dense_layers": dense,
    }


def gguf_moe_fields(config: ArchConfig, key: Callable[[str], object]) -> ArchConfig:
    """``config`` with the routing from GGUF metadata, for a file with experts; ``key(name)`` reads ``{arch}.{name}``."""
    if not config.num_experts:
        return config
    arch = config.architecture
    used = key("expert_used_count")
    if used is None:
        raise ValueError(f"GGUF {arch} file with {arch}.expert_count lacks {arch}.expert_used_count")
    norm = key("expert_weights_norm")
    width = key("expert_feed_forward_length")
    shared = key("expert_shared_feed_forward_length")
    return dataclasses.replace(
        config, num_experts_per_tok=int(used),
        moe_intermediate_size=int(width) if width is not None else config.intermediate_size,
        norm_topk_prob=bool(norm) if norm is not None else _GGUF_NORM_TOPK.get(arch, False),
        shared_expert_intermediate_size=int(shared or 0),
    )
