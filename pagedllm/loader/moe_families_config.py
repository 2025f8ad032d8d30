"""What Mixtral, Qwen2-MoE, OLMoE and GraniteMoE read their own way, from config.json or GGUF metadata.

The experts' fields every mixture of experts has (``num_experts_per_tok``,
``moe_intermediate_size``, ``norm_topk_prob``, ``dense_layers``,
``shared_expert_intermediate_size``) are ``loader/moe_config.py``'s
reading; this module adds, per family, what its transformers 5.25 config
class and model do differently:

- ``MOE_FAMILY_DEFAULTS``: the config class's defaults of those keys, for a
  config.json that leaves one out (``model_config.from_hf_config`` merges
  them first, as it does Gemma's).
- ``mixtral`` (``MixtralConfig``, ``MixtralForCausalLM``): top-2 by default;
  the chosen weights always renormalised (``MixtralTopKRouter`` divides by
  their sum; there is no ``norm_topk_prob`` key); experts
  ``intermediate_size`` wide; ``sliding_window`` (null) on every layer, as
  Mistral; RoPE theta 1e6 and ``rms_norm_eps`` 1e-5 by default
  (``model_config``'s defaults table).
- ``qwen2_moe`` (``Qwen2MoeConfig``): top-4, ``moe_intermediate_size``
  1408, ``shared_expert_intermediate_size`` 5632 and ``norm_topk_prob``
  false by default; q/k/v biased by ``qkv_bias`` (true; the output never);
  ``use_sliding_window`` is refused (its windows are off in every published
  checkpoint, and the config class's layer pattern is its own).
- ``olmoe`` (``OlmoeConfig``): top-8, ``norm_topk_prob`` false by default;
  q and k RMS-normed (over the whole projection: the family's choice);
  ``rms_norm_eps`` 1e-5; ``clip_qkv`` other than null is refused
  (``config_fields.py``).
- ``granitemoe`` (``GraniteMoeConfig``): top-2 by default; the top-k router
  logits softmaxed, which is softmax-then-renormalise (read as
  ``norm_topk_prob`` true); Granite's four multipliers
  (``loader/smollm3_granite_config.py``).

GGUF, as llama.cpp's converter writes them (``expert_count``,
``expert_used_count``, ``expert_feed_forward_length`` where the experts'
width is not ``feed_forward_length``, ``expert_shared_feed_forward_length``:
``moe_config.py`` reads them): Mixtral is written as architecture ``llama``
with an expert count. Whether the top-k weights are renormalised is no key
of these files; llama.cpp's graphs renormalise for ``llama`` (Mixtral) and
``granitemoe``, not for ``qwen2moe`` and ``olmoe``, and so do these
families. A Qwen2-MoE folder with ``norm_topk_prob`` true thus converts to
a file that runs another model, in llama.cpp as here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

# model_config imports this module, so the configuration is typed by a variable (a ModelArchConfig)
ArchConfig = TypeVar("ArchConfig")

MOE_FAMILY_TYPES = ("mixtral", "qwen2_moe", "olmoe", "granitemoe")
# the config classes' defaults of the experts' keys, where config.json leaves them out
MOE_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "mixtral": {"num_experts_per_tok": 2, "num_local_experts": 8},
    "qwen2_moe": {"num_experts_per_tok": 4, "num_experts": 60, "moe_intermediate_size": 1408,
                  "shared_expert_intermediate_size": 5632, "norm_topk_prob": False, "qkv_bias": True,
                  "decoder_sparse_step": 1},
    "olmoe": {"num_experts_per_tok": 8, "num_experts": 64, "norm_topk_prob": False},
    "granitemoe": {"num_experts_per_tok": 2, "num_local_experts": 8},
}
_MIXTRAL_DEFAULT_THETA = 1_000_000.0  # MixtralConfig.default_theta
# GGUF architectures whose graph in llama.cpp renormalises the top-k weights (Mixtral is written as "llama")
_GGUF_RENORMALISED = ("llama", "granitemoe")


def hf_moe_family_fields(config: ArchConfig, cfg: dict[str, Any]) -> ArchConfig:
    """``config`` with what the family of config.json ``cfg`` reads its own way; other families unchanged."""
    arch = config.architecture
    if arch not in MOE_FAMILY_TYPES:
        return config
    cfg = {**MOE_FAMILY_DEFAULTS[arch], **cfg}
    fields: dict[str, Any] = {}
    if arch in ("mixtral", "granitemoe"):
        fields["norm_topk_prob"] = True
        fields["moe_intermediate_size"] = config.intermediate_size
    if arch == "mixtral":
        fields.update(_mixtral_hf(cfg, config.num_hidden_layers, config.max_position_embeddings))
    elif arch == "qwen2_moe":
        if cfg.get("use_sliding_window"):
            raise ValueError("qwen2_moe: use_sliding_window is not supported; set it to false")
        fields["attention_bias"] = bool(cfg["qkv_bias"])
    elif arch == "olmoe":
        fields["qk_norm"] = True
        fields["moe_intermediate_size"] = config.intermediate_size
    return dataclasses.replace(config, **fields)


def _mixtral_hf(cfg: dict[str, Any], num_layers: int, max_position: int) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    params = cfg.get("rope_parameters") or {}
    if "rope_theta" not in params and "rope_theta" not in cfg:
        fields["rope_theta"] = _MIXTRAL_DEFAULT_THETA
    window = cfg.get("sliding_window")
    if window is not None:
        # MixtralAttention applies the window to every layer, as Mistral's does
        if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
            raise ValueError(f"mixtral: sliding_window must be a positive number of tokens or null, got {window!r}")
        if window < max_position:  # else it masks no position the RoPE table covers
            fields["sliding_windows"] = (window,) * num_layers
            fields["layer_types"] = ("sliding_attention",) * num_layers
    return fields


def gguf_moe_family_fields(config: ArchConfig, key: Callable[[str], object]) -> ArchConfig:
    """``config`` (a GGUF file's; ``key(name)`` reads ``<arch>.<name>``) with the renormalisation llama.cpp's
    graph of its architecture applies, where the file has no ``expert_weights_norm`` to say."""
    if config.num_experts and config.architecture in _GGUF_RENORMALISED and key("expert_weights_norm") is None:
        return dataclasses.replace(config, norm_topk_prob=True)
    return config
