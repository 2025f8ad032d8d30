"""A decoder-only causal LM assembled from the shared blocks; a model family only says how (``DecoderSpec``).

A family file (``models/*.py``) subclasses ``CausalLM`` and writes one
method, ``decoder_spec``: from the checkpoint's ``ModelArchConfig`` to the
blocks each layer uses. Everything else (building the layers, the step's
forward pass, the LM head and its softcap, loading Hugging Face-named
weights into the fused parameters) is here, once:

- ``SelfAttention`` (``layers/self_attention.py``): head counts and size,
  biases, q/k norms, score scale and softcap, sliding window, RoPE or none;
- ``GatedMLP`` (``layers/mlp.py``) with the checkpoint's activation;
- ``RMSNorm`` of the family's kind (``NormSpec``: Llama's ``w * x`` or
  Gemma's ``(1 + w) * x``), before each branch, and after it where the
  family norms the branch again before the residual add (``post_norms``);
- ``RotaryTables``: one table per way layers rotate, chosen per layer;
- the embedding with its scale (Gemma's ``sqrt(hidden)``, Granite's
  multiplier), Granite's residual multiplier on each branch, and the
  logits' divisor (Granite) and softcap.

Tokens of all sequences in a step are one flat batch ``[num_tokens,
hidden]``; only attention needs to know where one sequence ends, and it
learns that from ``AttentionMetadata``. Each choice (native kernels or
torch, which norms, which forward) is made when a layer is built or when
the runner hands the loaded model its native ops, never per step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from pagedllm.layers.attention import AttentionBackend, AttentionMetadata
from pagedllm.layers.branch_scale import BranchScale
from pagedllm.layers.custom_op import NativeOpsMixin
from pagedllm.layers.fused_moe import MoEBlock, MoESpec, moe_fused_projections
from pagedllm.layers.mlp import GatedMLP
from pagedllm.layers.norm import NormSpec
from pagedllm.layers.parallel import ParallelLMHead, TensorParallelGroup, VocabParallelEmbedding
from pagedllm.layers.quantization.quant_config import QuantConfig
from pagedllm.layers.rotary import RopeSpec, RotaryTables
from pagedllm.layers.self_attention import AttentionSpec, CosSin, SelfAttention
from pagedllm.layers.weights import (
    FusedMap,
    fused_projections,
    load_hf_weights,
    shard_expert_columns,
    split_stacked_experts,
)
from pagedllm.loader.model_config import ModelArchConfig

KvCache = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class DecoderLayerSpec:
    """One decoder layer: its attention, its MLP (width and activation), its norms and its RoPE table.

    ``rope_table``: the name of the ``DecoderSpec.rope_tables`` entry this
    layer rotates by; None for a layer without RoPE (then
    ``attention.rope`` is False too). ``post_norms``: each branch normed
    before it joins the residual; with ``pre_norms`` too that is Gemma's
    sandwich, without (``pre_norms=False``) OLMo 2's layout, where the branch
    reads the residual stream as it is. At least one of the two.
    ``residual_multiplier``: Granite's, each branch multiplied by it before
    it joins the residual (None: added as it is; pre-norm layers only).
    ``moe``: a sparse layer's mixture of experts (``layers/fused_moe.py``) in
    place of the dense MLP; ``intermediate_size``, ``hidden_act`` and
    ``mlp_bias`` are then the dense MLP's, not read.
    """

    attention: AttentionSpec
    intermediate_size: int
    hidden_act: str
    norm: NormSpec
    rope_table: str | None = "default"
    post_norms: bool = False
    residual_multiplier: float | None = None
    pre_norms: bool = True
    mlp_bias: bool = False
    moe: MoESpec | None = None

    def __post_init__(self) -> None:
        if not (self.pre_norms or self.post_norms):
            raise ValueError("a decoder layer norms before its branches (pre_norms), after them (post_norms) or both")


@dataclass(frozen=True)
class DecoderSpec:
    """A whole decoder: vocabulary, width, layers, final norm, RoPE tables, embedding scale, logit softcap.

    ``logits_scaling``: Granite's, the logits divided by it (None: not).
    With tensor parallelism it is a rank's (its head counts and
    intermediate size), built from ``ShardPlan.local_config``.
    """

    vocab_size: int
    hidden_size: int
    layers: tuple[DecoderLayerSpec, ...]
    final_norm: NormSpec
    rope_tables: Mapping[str, RopeSpec] = field(default_factory=dict)
    embed_scale: float | None = None
    final_logit_softcap: float | None = None
    tie_word_embeddings: bool = False
    logits_scaling: float | None = None

    def __post_init__(self) -> None:
        for i, layer in enumerate(self.layers):
            if layer.attention.rope != (layer.rope_table is not None):
                raise ValueError(f"layer {i}: attention.rope={layer.attention.rope} but rope_table="
                                 f"{layer.rope_table!r} (a layer rotates by a table or not at all)")
            if layer.rope_table is not None and layer.rope_table not in self.rope_tables:
                raise ValueError(f"layer {i} rotates by table {layer.rope_table!r}; the model has "
                                 f"{sorted(self.rope_tables)}")
            if layer.rope_table is not None:
                table_dim, head_dim = self.rope_tables[layer.rope_table].rotary_dim, layer.attention.head_dim
                if table_dim != (layer.attention.rotary_dim or head_dim):
                    raise ValueError(f"layer {i} rotates {layer.attention.rotary_dim or head_dim} dimensions of each "
                                     f"head; table {layer.rope_table!r} has {table_dim}")
            if layer.residual_multiplier is not None and layer.post_norms:
                raise ValueError(f"layer {i}: a residual multiplier applies to pre-norm layers only")
        if self.final_logit_softcap is not None and not self.final_logit_softcap > 0:
            raise ValueError(f"final_logit_softcap must be positive or None, got {self.final_logit_softcap!r}")
        if self.logits_scaling is not None and not self.logits_scaling > 0:
            raise ValueError(f"logits_scaling must be positive or None, got {self.logits_scaling!r}")

    def without_rope(self, layers: Iterable[int]) -> DecoderSpec:
        """This spec with the given layers rotating q and k by no table (NoPE layers: SmolLM3, Granite's switch)."""
        nope = set(layers)
        return dataclasses.replace(self, layers=tuple(
            dataclasses.replace(layer, rope_table=None, attention=dataclasses.replace(layer.attention, rope=False))
            if i in nope else layer
            for i, layer in enumerate(self.layers)
        ))


class DecoderLayer(nn.Module):
    """Attention and MLP over the residual stream, each after a norm (and before one, with ``post_norms``).

    Norm names are Hugging Face's: ``input_layernorm`` before attention;
    without post-norms ``post_attention_layernorm`` is the norm before the
    MLP (Llama), with them it norms the attention output and
    ``pre_feedforward_layernorm`` / ``post_feedforward_layernorm`` surround
    the MLP (Gemma); with post-norms only (OLMo 2) there is no
    ``input_layernorm`` nor ``pre_feedforward_layernorm``. The forward pass
    for the layout is bound here, once.
    """

    def __init__(
        self, spec: DecoderLayerSpec, hidden_size: int, backend: AttentionBackend,
        tp: TensorParallelGroup | None = None, quant_config: QuantConfig | None = None, prefix: str = "",
    ) -> None:
        super().__init__()
        self.rope_table = spec.rope_table
        if spec.pre_norms:
            self.input_layernorm = spec.norm.build(hidden_size)
        self.self_attn = SelfAttention(spec.attention, backend, tp, quant_config, f"{prefix}.self_attn")
        self.post_attention_layernorm = spec.norm.build(hidden_size)
        if spec.post_norms and spec.pre_norms:
            self.pre_feedforward_layernorm = spec.norm.build(hidden_size)
        if spec.post_norms:
            self.post_feedforward_layernorm = spec.norm.build(hidden_size)
        self.mlp: nn.Module = (
            MoEBlock(spec.moe, hidden_size, tp, quant_config, f"{prefix}.mlp") if spec.moe is not None
            else GatedMLP(hidden_size, spec.intermediate_size, spec.hidden_act, tp, quant_config, f"{prefix}.mlp",
                          bias=spec.mlp_bias)
        )
        if spec.residual_multiplier is not None:
            self.branch_scale = BranchScale(hidden_size, spec.residual_multiplier)
        self._forward: Callable[[CosSin | None, torch.Tensor, KvCache, AttentionMetadata], torch.Tensor] = (
            (self._forward_sandwich if spec.pre_norms else self._forward_post_norm) if spec.post_norms
            else self._forward_pre_norm if spec.residual_multiplier is None else self._forward_pre_norm_scaled
        )

    def forward(
        self, cos_sin: CosSin | None, x: torch.Tensor, kv_cache: KvCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        """One layer over the residual stream ``x`` ``[num_tokens, hidden]``, updated in place and returned."""
        return self._forward(cos_sin, x, kv_cache, meta)

    def _forward_pre_norm(
        self, cos_sin: CosSin | None, x: torch.Tensor, kv_cache: KvCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        # x += attn(...), x += mlp(...) in place: no new residual tensor per layer; the first add is
        # fused into the MLP's norm where the native kernels run
        attn_out = self.self_attn(cos_sin, self.input_layernorm(x), kv_cache, meta)
        h = self.post_attention_layernorm.add_forward(x, attn_out)
        return x.add_(self.mlp(h))

    def _forward_pre_norm_scaled(
        self, cos_sin: CosSin | None, x: torch.Tensor, kv_cache: KvCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        # Granite: each branch scaled (in place: it is the projection's own output) before it is added, as
        # transformers rounds it, so the first add stays fused into the MLP's norm on the native path
        attn_out = self.branch_scale(self.self_attn(cos_sin, self.input_layernorm(x), kv_cache, meta))
        h = self.post_attention_layernorm.add_forward(x, attn_out)
        return x.add_(self.branch_scale(self.mlp(h)))

    def _forward_sandwich(
        self, cos_sin: CosSin | None, x: torch.Tensor, kv_cache: KvCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        attn_out = self.self_attn(cos_sin, self.input_layernorm(x), kv_cache, meta)
        x.add_(self.post_attention_layernorm(attn_out))
        mlp_out = self.mlp(self.pre_feedforward_layernorm(x))
        return x.add_(self.post_feedforward_layernorm(mlp_out))

    def _forward_post_norm(
        self, cos_sin: CosSin | None, x: torch.Tensor, kv_cache: KvCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        # OLMo 2: the branches read the residual stream un-normed; only their outputs are normed
        attn_out = self.self_attn(cos_sin, x, kv_cache, meta)
        x.add_(self.post_attention_layernorm(attn_out))
        return x.add_(self.post_feedforward_layernorm(self.mlp(x)))


class DecoderModel(nn.Module):
    """Embedding (scaled where the spec says), decoder layers, final norm and RoPE tables (HF's ``model.*``)."""

    def __init__(
        self, spec: DecoderSpec, backend: AttentionBackend, tp: TensorParallelGroup | None = None,
        quant_config: QuantConfig | None = None, prefix: str = "model", layer_class: type[nn.Module] | None = None,
    ) -> None:
        super().__init__()
        layer_class = DecoderLayer if layer_class is None else layer_class
        vocab_start, vocab_rows = tp.plan.vocab if tp is not None else (0, spec.vocab_size)
        self.embed_tokens = VocabParallelEmbedding(vocab_rows, spec.hidden_size, tp, vocab_start, quant_config,
                                                   f"{prefix}.embed_tokens")
        self.layers = nn.ModuleList(
            layer_class(layer, spec.hidden_size, backend, tp, quant_config, f"{prefix}.layers.{i}")
            for i, layer in enumerate(spec.layers)
        )
        self.norm = spec.final_norm.build(spec.hidden_size)
        self.rotary = RotaryTables(spec.rope_tables)
        self._embed: Callable[[torch.Tensor], torch.Tensor] = self._plain_embedding
        if spec.embed_scale is not None:
            # a buffer, so that model.to(dtype) rounds the factor with the weights, as transformers does; filled
            # by CausalLM.load_weights (a model built on the meta device has no values yet)
            self.register_buffer("embed_scale", torch.empty(()), persistent=False)
            self._embed = self._scaled_embedding

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The step's tokens ``[num_tokens]`` -> embeddings ``[num_tokens, hidden]``, scaled where the spec says."""
        return self._embed(input_ids)

    def _plain_embedding(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def _scaled_embedding(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x * self.embed_scale.to(x.dtype)


class CausalLM(NativeOpsMixin, nn.Module):
    """Decoder plus LM head; ``forward`` returns hidden states, ``compute_logits`` the (softcapped) logits.

    A family subclasses it and defines ``decoder_spec``. ``cfg`` is the
    shape this process holds: with ``tp`` (tensor parallelism) a rank's
    head counts and intermediate size (``ShardPlan.local_config``), and
    ``tp.plan`` says which slices they are. ``use_native_ops``
    (``NativeOpsMixin``) switches its layers between native and torch
    implementations. ``supports_experts``: the family computes mixture-of-experts
    layers (``DecoderLayerSpec.moe``); the registry refuses a checkpoint with
    experts for a family without. ``layer_class``: the layer module a family
    builds from each ``DecoderLayerSpec`` (None: ``DecoderLayer``).
    """

    supports_experts: bool = False
    # the decoder layer's module (a family with a layer of its own, Gemma 4's, names it; same arguments)
    layer_class: type[nn.Module] | None = None

    def __init__(
        self, cfg: ModelArchConfig, backend: AttentionBackend, tp: TensorParallelGroup | None = None,
        quant_config: QuantConfig | None = None,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.spec = self.decoder_spec(cfg)
        self.model = DecoderModel(self.spec, backend, tp, quant_config, layer_class=self.layer_class)
        vocab_start, vocab_rows = tp.plan.vocab if tp is not None else (0, cfg.vocab_size)
        tied = self.model.embed_tokens if self.spec.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(cfg.hidden_size, vocab_rows, tp, vocab_start, quant_config, "lm_head", tied)

    @classmethod
    def decoder_spec(cls, cfg: ModelArchConfig) -> DecoderSpec:
        """The blocks of the model of shape ``cfg``: what a family file defines."""
        raise NotImplementedError(f"{cls.__name__} does not define decoder_spec")

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[KvCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        """Hidden states after the final norm for the step's tokens.

        ``positions`` index the RoPE tables, and nothing else: the tokens' positions, but for a longrope model
        whose tables hold short and long rows, each token's row (``layers/rotary.py``'s ``longrope_rows``).
        """
        x = self.model.embed(input_ids)
        tables = self.model.rotary.cos_sin(positions, x.dtype)  # looked up once per step for all layers
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches)):
            x = layer(tables.get(layer.rope_table), x, kv_cache, meta.for_layer(i))
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits ``[n, vocab]`` in float32, for the rows that sample only; divided by ``logits_scaling``, then
        ``cap * tanh(x / cap)`` if capped.

        None on tensor-parallel ranks but 0 (their slices are gathered there).
        """
        logits = self.lm_head(hidden)
        if self.spec.logits_scaling is not None:
            logits = logits / self.spec.logits_scaling
        cap = self.spec.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return self.lm_head.gather(logits.float())

    # --- weights -------------------------------------------------------------
    @staticmethod
    def checkpoint_fused_map(cfg: ModelArchConfig, tp: TensorParallelGroup | None) -> FusedMap:
        """Where a checkpoint's separate q/k/v and gate/up tensors go in the fused parameters of the model of
        shape ``cfg`` (a rank's, with ``tp``): known before the model is built."""
        q_size = cfg.num_attention_heads * cfg.head_dim
        kv_size = cfg.num_key_value_heads * cfg.head_dim
        fused = fused_projections(q_size, kv_size, cfg.intermediate_size, tp.plan if tp else None)
        if cfg.num_experts:  # the experts' parts are looked up first: their names hold the dense parts' names
            sharded = tp is not None and tp.size > 1
            fused = {**moe_fused_projections(cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size,
                                             cfg.shared_expert_intermediate_size,
                                             tp.plan.expert_intermediate[0] if sharded else None,
                                             tp.plan.shared_expert_intermediate[0] if sharded else None), **fused}
        return fused

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) into the parameters; set the embedding scale."""
        fused = self.checkpoint_fused_map(self.config, self.tp)
        if self.config.num_experts:  # transformers 5's fused 3-D experts, as per-expert tensors
            weights = split_stacked_experts(weights)
            if self.tp is not None and self.tp.size > 1:  # this rank's columns of each expert's down
                weights = shard_expert_columns(weights, self.tp.plan)
        load_hf_weights(self, weights, fused, self.spec.tie_word_embeddings)
        if self.spec.embed_scale is not None:
            with torch.no_grad():
                self.model.embed_scale.fill_(self.spec.embed_scale)
