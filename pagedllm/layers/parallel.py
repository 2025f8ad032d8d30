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
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.group import TensorParallelGroup
from pagedllm.layers.linear import Linear


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


def vocab_parallel_lookup(
    input_ids: torch.Tensor, vocab_start: int, num_rows: int, tp: TensorParallelGroup,
    lookup: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Rows of this rank's slice ``[vocab_start, vocab_start + num_rows)`` of an embedding, all-reduced.

    ``lookup`` maps local ids to rows ``[num_tokens, dim]`` (a float table, or GGUF blocks); a token held
    by another rank is looked up as local row 0 and zeroed here, and the all-reduce brings its row in.
    """
    local = input_ids - vocab_start
    elsewhere = (local < 0) | (local >= num_rows)  # [num_tokens]: held by another rank
    out = lookup(local.masked_fill(elsewhere, 0))  # [num_tokens, dim]
    out.masked_fill_(elsewhere.unsqueeze(-1), 0.0)
    return tp.all_reduce_(out)


class RowParallelLinear(Linear):
    """A linear layer over this rank's input columns ``[input_start, input_start + in_features)``; output all-reduced.

    A bias is added once: rank 0 holds it, the others hold zeros.
    """

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False,
        tp: TensorParallelGroup | None = None, input_start: int = 0,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp
        self.input_start = input_start

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


class VocabParallelEmbedding(nn.Embedding):
    """Embedding rows ``[vocab_start, vocab_start + num_embeddings)`` of the vocabulary; lookups all-reduced."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, tp: TensorParallelGroup | None = None, vocab_start: int = 0
    ) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.tp = tp
        self.vocab_start = vocab_start

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not _sharded(self.tp):
            return super().forward(input_ids)
        return vocab_parallel_lookup(
            input_ids, self.vocab_start, self.num_embeddings, self.tp, lambda ids: F.embedding(ids, self.weight)
        )

    def checkpoint_slice(self, param: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the checkpoint's embedding."""
        return tensor.narrow(0, self.vocab_start, self.num_embeddings) if _sharded(self.tp) else tensor


class ParallelLMHead(Linear):
    """LM head rows ``[vocab_start, vocab_start + out_features)``; ``gather`` puts every rank's logits on rank 0."""

    def __init__(
        self, in_features: int, out_features: int, tp: TensorParallelGroup | None = None, vocab_start: int = 0
    ) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.tp = tp
        self.vocab_start = vocab_start

    def gather(self, logits: torch.Tensor) -> torch.Tensor | None:
        """``[n, this rank's vocab]`` -> ``[n, vocab]`` on rank 0, None on the other ranks."""
        return self.tp.gather_vocab(logits) if _sharded(self.tp) else logits

    def checkpoint_slice(self, param: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the checkpoint's LM head."""
        return tensor.narrow(0, self.vocab_start, self.out_features) if _sharded(self.tp) else tensor
