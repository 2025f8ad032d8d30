"""Layers of a tensor-parallel model: each holds its rank's slice and does its own communication.

Column-parallel layers (q/k/v, gate/up) need no class: they are ``Linear``
layers with this rank's rows, and the checkpoint's slices go there through
the model's fused map. The layers here are the three that talk to the
other ranks (``distributed/shard_plan.py`` draws the whole split):

- ``RowParallelLinear`` (o_proj, down_proj): this rank's input columns; its
  output is a partial sum, all-reduced over the ranks.
- ``VocabParallelEmbedding``: this rank's vocabulary rows; a token looked up
  elsewhere is zero here, and the all-reduce fills it in.
- ``ParallelLMHead``: this rank's vocabulary rows; logits are gathered to rank 0.

With ``tp=None`` (one process) each is its plain counterpart. Each layer
knows which slice of a checkpoint tensor it takes (``checkpoint_slice``),
so a rank copies only its slice of each tensor while loading.

The embedding asks the quantization config for its ``EmbeddingMethod`` as
a linear layer asks for its ``LinearMethod`` (float rows, GGUF blocks,
int8 / int4 blocks); a tied LM head holds no table of its own until its
method takes the loaded embedding's (``LinearMethod.tie_weights``, just
before ``process_weights_after_loading``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.group import TensorParallelGroup
from pagedllm.layers.linear import Linear, LinearMethod, QuantConfig, QuantMethod, replace_parameter


def _sharded(tp: TensorParallelGroup | None) -> bool:
    return tp is not None and tp.size > 1


def _quantized_columns(tensor: torch.Tensor, start: int, local: int, stored: torch.Tensor | None) -> torch.Tensor:
    """Columns ``[start, start + local)`` of a GGUF tensor's rows of bytes ``[out, row bytes]``.

    ``stored``: the layer's own ``[out, local row bytes]`` buffer, whose width gives the bytes per weight.
    ValueError when ``start`` does not fall on a block boundary (the loader keeps such layers in float).
    """
    if stored is None:
        raise ValueError("a quantized checkpoint tensor reached a layer with no quantized storage")
    row_bytes = stored.shape[1]
    if (start * row_bytes) % local:
        raise ValueError(f"input column {start} is not on a quantization block boundary")
    return tensor.narrow(1, start * row_bytes // local, row_bytes)


class RowParallelLinear(Linear):
    """A linear layer over this rank's input columns ``[input_start, input_start + in_features)``; output all-reduced.

    A bias is added once: rank 0 holds it, the others hold zeros.
    """

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False,
        tp: TensorParallelGroup | None = None, input_start: int = 0, quant_config: QuantConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__(in_features, out_features, bias, quant_config, prefix, input_start)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.quant_method.apply(self, x)  # [..., out_features]: this rank's partial sum
        return self.tp.all_reduce_(out) if _sharded(self.tp) else out

    def checkpoint_slice(self, param: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of checkpoint tensor ``param`` ("weight", "bias") of the whole layer."""
        if not _sharded(self.tp):
            return tensor
        if param == "bias":
            return tensor if self.tp.is_driver else torch.zeros_like(tensor)
        if tensor.dtype == torch.uint8:  # GGUF blocks kept as stored
            return _quantized_columns(tensor, self.input_start, self.in_features, self._buffers.get("qweight"))
        return tensor.narrow(1, self.input_start, self.in_features)


class EmbeddingMethod(QuantMethod):
    """How an embedding stores its table and looks rows up (``VocabParallelEmbedding.quant_method``); this base
    class: the float table, ``nn.Embedding``'s own."""

    name: str = "float"

    def tied_head_method(self) -> LinearMethod | None:
        """The method a tied LM head multiplies this table with; None: the one the config gives the head."""
        return None

    def embedding(self, layer: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``[..., embedding_dim]`` float of local ids ``ids`` (any shape)."""
        return F.embedding(ids, layer.weight)


class VocabParallelEmbedding(nn.Embedding):
    """Embedding rows ``[vocab_start, vocab_start + num_embeddings)`` of the vocabulary; lookups all-reduced.

    Its table is held as ``quant_method`` (asked of ``quant_config`` when built) says.
    """

    def __init__(
        self, num_embeddings: int, embedding_dim: int, tp: TensorParallelGroup | None = None, vocab_start: int = 0,
        quant_config: QuantConfig | None = None, prefix: str = "",
    ) -> None:
        # nn.Embedding's random init, on the meta device the model is built on, goes through torch._refs.normal_,
        # which imports torch._dynamo (seconds of a cold start): an empty table instead, to be loaded
        weight = torch.empty(num_embeddings, embedding_dim) if torch.get_default_device().type == "meta" else None
        super().__init__(num_embeddings, embedding_dim, _weight=weight)
        self.tp = tp
        self.vocab_start = vocab_start
        method = None if quant_config is None else quant_config.get_quant_method(self, prefix)
        self.quant_method: EmbeddingMethod = method if method is not None else EmbeddingMethod()
        self.quant_method.create_weights(self)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not _sharded(self.tp):
            return self.quant_method.embedding(self, input_ids)
        # a token held by another rank is looked up as local row 0 and zeroed here; the all-reduce brings its row
        local = input_ids - self.vocab_start
        elsewhere = (local < 0) | (local >= self.num_embeddings)  # [num_tokens]: held by another rank
        out = self.quant_method.embedding(self, local.masked_fill(elsewhere, 0))  # [num_tokens, dim]
        out.masked_fill_(elsewhere.unsqueeze(-1), 0.0)
        return self.tp.all_reduce_(out)

    def checkpoint_slice(self, param: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the checkpoint's embedding."""
        return tensor.narrow(0, self.vocab_start, self.num_embeddings) if _sharded(self.tp) else tensor

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, method={self.quant_method.name}"


class ParallelLMHead(Linear):
    """LM head rows ``[vocab_start, vocab_start + out_features)``; ``gather`` puts every rank's logits on rank 0.

    ``tied_to``: the embedding whose table it multiplies by (tied word embeddings), taken after loading.
    """

    def __init__(
        self, in_features: int, out_features: int, tp: TensorParallelGroup | None = None, vocab_start: int = 0,
        quant_config: QuantConfig | None = None, prefix: str = "", tied_to: nn.Embedding | None = None,
    ) -> None:
        super().__init__(in_features, out_features, False, None if tied_to is not None else quant_config, prefix)
        self.tp = tp
        self.vocab_start = vocab_start
        if tied_to is not None:
            # kept out of _modules: the embedding is the model's, not a child of the head
            self.__dict__["tied_embedding"] = tied_to
            # the table's own kind where it has one (GGUF blocks), else what the config gives any head
            method = tied_to.quant_method.tied_head_method()
            if method is None and quant_config is not None:
                method = quant_config.get_quant_method(self, prefix)
            self.quant_method = method if method is not None else self.quant_method
            replace_parameter(self, "weight", None)  # no table of its own: the method ties it after loading

    def gather(self, logits: torch.Tensor) -> torch.Tensor | None:
        """``[n, this rank's vocab]`` -> ``[n, vocab]`` on rank 0, None on the other ranks."""
        return self.tp.gather_vocab(logits) if _sharded(self.tp) else logits

    def checkpoint_slice(self, param: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the checkpoint's LM head."""
        return tensor.narrow(0, self.vocab_start, self.out_features) if _sharded(self.tp) else tensor
