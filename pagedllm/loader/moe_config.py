"""The mixture-of-experts fields of a configuration, read from config.json or GGUF metadata.

Each reader returns the ``ModelArchConfig`` fields of the experts (a dense
model: none): how many experts a token goes to (``num_experts_per_tok``),
each expert's intermediate size (``moe_intermediate_size``), whether the
chosen weights are renormalised (``norm_topk_prob``), which layers keep a
dense MLP (``dense_layers``) and a shared expert's size
(``shared_expert_intermediate_size``, 0: none). The model families build
their ``MoESpec`` from them (``layers/fused_moe.py``).

config.json, as transformers 5's config classes read it:

- ``num_experts_per_tok`` (required), ``moe_intermediate_size`` (default:
  ``intermediate_size``, Mixtral's reading), ``norm_topk_prob`` (default
  false, as ``Qwen3MoeConfig``).
- Qwen3-MoE / Qwen2-MoE's dense layers: layer ``i`` is sparse unless it is
  in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``.

GGUF, as llama.cpp's converter writes it: ``<arch>.expert_used_count``,
``<arch>.expert_feed_forward_length`` (else ``feed_forward_length``),
``<arch>.expert_shared_feed_forward_length``, ``<arch>.expert_weights_norm``;
a layer is sparse where the file holds its router, ``blk.N.ffn_gate_inp``.
For ``qwen3moe`` llama.cpp always renormalises the chosen weights (its
graph passes ``norm_w = true``, whatever the original config said; the
converter writes no key for it), and so does a ``qwen3moe`` file here unless
it sets ``expert_weights_norm``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

# GGUF architectures whose graph in llama.cpp renormalises the top-k weights without a metadata key
_GGUF_ALWAYS_NORMALISED = ("qwen3moe",)


def _positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"config.json {name} must be a positive integer, got {value!r}")
    return value


def hf_moe_fields(cfg: dict[str, Any], num_experts: int) -> dict[str, Any]:
    """The experts' fields of config.json ``cfg`` (a model of ``num_experts`` experts; {} for a dense one)."""
    if not num_experts:
        return {}
    n = cfg["num_hidden_layers"]
    top_k = _positive_int(cfg.get("num_experts_per_tok"), "num_experts_per_tok")
    inter = cfg.get("moe_intermediate_size")
    inter = _positive_int(cfg["intermediate_size"] if inter is None else inter, "moe_intermediate_size")
    step = cfg.get("decoder_sparse_step")
    step = _positive_int(1 if step is None else step, "decoder_sparse_step")
    only_dense = cfg.get("mlp_only_layers") or []
    if not isinstance(only_dense, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in only_dense):
        raise ValueError(f"config.json mlp_only_layers must be a list of layer indices, got {only_dense!r}")
    dense = tuple(i for i in range(n) if i in only_dense or (i + 1) % step)
    norm = cfg.get("norm_topk_prob", False)
    if not isinstance(norm, bool):
        raise ValueError(f"config.json norm_topk_prob must be true or false, got {norm!r}")
    shared = cfg.get("shared_expert_intermediate_size") or 0
    return dict(num_experts_per_tok=top_k, moe_intermediate_size=inter, norm_topk_prob=norm, dense_layers=dense,
                shared_expert_intermediate_size=int(shared))


def gguf_moe_fields(
    key: Callable[[str], object], arch: str, num_experts: int, num_layers: int, feed_forward_length: int,
    tensor_names: Iterable[str],
) -> dict[str, Any]:
    """The experts' fields of a GGUF file of ``arch`` (``key(name)`` reads ``<arch>.<name>``, None if absent);
    ``tensor_names``: the file's tensors, whose routers say which layers are sparse."""
    if not num_experts:
        return {}
    top_k = key("expert_used_count")
    if top_k is None:
        raise ValueError(f"GGUF {arch} file with {num_experts} experts lacks {arch}.expert_used_count")
    sparse = set()
    for name in tensor_names:
        block, _, rest = name.partition(".")[2].partition(".")
        if name.startswith("blk.") and rest == "ffn_gate_inp.weight" and block.isdigit():
            sparse.add(int(block))
    norm = key("expert_weights_norm")
    return dict(
        num_experts_per_tok=int(top_k),
        moe_intermediate_size=int(key("expert_feed_forward_length") or feed_forward_length),
        norm_topk_prob=bool(norm) if norm is not None else arch in _GGUF_ALWAYS_NORMALISED,
        dense_layers=tuple(i for i in range(num_layers) if i not in sparse),
        shared_expert_intermediate_size=int(key("expert_shared_feed_forward_length") or 0),
    )
