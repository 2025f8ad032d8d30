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
- ``ParallelRMSNorm``: an RMSNorm over features split across the ranks
  (OLMo 2's q/k norms span every head): this rank's slice of the weight,
  each token's sum of squares all-reduced before each rank scales its slice.

Two hold a slice without talking: ``SegmentedColumnLinear``, a
column-parallel layer whose checkpoint rows are segments of which a rank
takes its part of each (LFM2's B | C | x, Mamba-2's z | x | B | C | dt), and
``RowShardedParams``, a state layer's per-channel tensors (a conv's
weight and bias, a gated norm's weight) cut the same way.

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
from pagedllm.layers.norm import NormSpec, RMSNorm
from pagedllm.layers.weights import RowSpans, take_rows


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

    A bias is added once: rank 0 holds it, the others hold zeros. ``reduce=False`` leaves the partial sum
    to the caller, which adds it to others before one all-reduce (a shared expert beside the routed ones).
    """

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False,
        tp: TensorParallelGroup | None = None, input_start: int = 0, quant_config: QuantConfig | None = None,
        prefix: str = "", reduce: bool = True,
    ) -> None:
        super().__init__(in_features, out_features, bias, quant_config, prefix, input_start)
        self.tp = tp
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.quant_method.apply(self, x)  # [..., out_features]: this rank's partial sum
        return self.tp.all_reduce_(out) if self.reduce and _sharded(self.tp) else out

    def checkpoint_slice(self, param: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of checkpoint tensor ``param`` ("weight", "bias") of the whole layer."""
        if not _sharded(self.tp):
            return tensor
        if param == "bias":
            return tensor if self.tp.is_driver else torch.zeros_like(tensor)
        if tensor.dtype == torch.uint8:  # GGUF blocks kept as stored
            return _quantized_columns(tensor, self.input_start, self.in_features, self._buffers.get("qweight"))
        return tensor.narrow(1, self.input_start, self.in_features)


class SegmentedColumnLinear(Linear):
    """A column-parallel layer whose rows are this rank's part of each segment of the checkpoint's rows.

    ``row_spans``: ``(start, rows)`` of the checkpoint's weight per segment, in order (LFM2's ``in_proj``: its
    channels of B, of C, of x); the layer's rows are their concatenation. One process (``tp`` None or of one
    rank) takes the whole tensor, its spans being the whole rows.
    """

    def __init__(
        self, in_features: int, row_spans: RowSpans, bias: bool = False, tp: TensorParallelGroup | None = None,
        quant_config: QuantConfig | None = None, prefix: str = "",
    ) -> None:
        super().__init__(in_features, sum(rows for _, rows in row_spans), bias, quant_config, prefix)
        self.tp = tp
        self.row_spans = tuple(row_spans)

    def checkpoint_slice(self, param: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's rows of checkpoint tensor ``param`` ("weight" floats or GGUF rows of blocks, "bias")."""
        return take_rows(tensor, self.row_spans) if _sharded(self.tp) else tensor


class RowShardedParams(nn.Module):
    """Parameters along a state layer's channels (a conv's ``weight`` and ``bias``, a norm's ``weight``) of which a
    rank holds the rows ``row_spans`` of the checkpoint's: the same cut as the layer's input projection.

    ``shapes``: name -> this rank's shape (rows first); None for a parameter the checkpoint does not have
    (a conv without bias).
    """

    def __init__(self, shapes: dict[str, tuple[int, ...] | None], row_spans: RowSpans,
                 tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        rows = sum(n for _, n in row_spans)
        for name, shape in shapes.items():
            if shape is not None and shape[0] != rows:
                raise ValueError(f"RowShardedParams: {name} has {shape[0]} rows, its spans {rows}")
            setattr(self, name, None if shape is None else nn.Parameter(torch.empty(shape), requires_grad=False))
        self.tp = tp
        self.row_spans = tuple(row_spans)

    def checkpoint_slice(self, param: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's rows of checkpoint tensor ``param``."""
        return take_rows(tensor, self.row_spans) if _sharded(self.tp) else tensor


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


class ParallelRMSNorm(RMSNorm):
    """An RMSNorm over ``total_dim`` features of which this rank holds ``[start, start + dim)``.

    OLMo 2 norms q and k over a token's whole projection, every head of it,
    while a rank holds its heads only: each rank sums the squares of its
    features, the ranks all-reduce those sums (one float per token, through
    the group's all-reduce: shared memory or gloo), and each scales its own
    features by ``rsqrt(sum / total_dim + eps)`` and its slice of the weight.
    The native row kernel would take the mean of this rank's features only,
    so both implementations run these torch ops (the shared-memory
    all-reduce is a native op, which a captured decode step replays).
    """

    def __init__(self, spec: NormSpec, dim: int, tp: TensorParallelGroup, start: int, total_dim: int) -> None:
        if not 0 <= start <= total_dim - dim:
            raise ValueError(f"ParallelRMSNorm: features [{start}, {start + dim}) are not within {total_dim}")
        super().__init__(dim, spec.eps, spec.unit_offset, spec.float32_weight)
        self.tp = tp
        self.start = start
        self.total_dim = total_dim

    def forward_torch(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., dim]`` (this rank's features) normed by the mean square over every rank's."""
        sum_sq = self.partial_sum_squares(x)  # [..., 1]: this rank's share
        if _sharded(self.tp):
            self.tp.all_reduce_(sum_sq)
        return self.scale(x, sum_sq)

    @staticmethod
    def partial_sum_squares(x: torch.Tensor) -> torch.Tensor:
        """``[..., 1]`` float32: each row's sum of squares over this rank's features."""
        return x.float().square().sum(-1, keepdim=True)

    def scale(self, x: torch.Tensor, sum_sq: torch.Tensor) -> torch.Tensor:
        """``x`` normed by ``sum_sq`` ``[..., 1]``, the sums of squares of every rank's features, and weighted."""
        normed = x.float() * torch.rsqrt(sum_sq / self.total_dim + self.eps)
        if self.float32_weight:
            weight = 1.0 + self.weight.float() if self.unit_offset else self.weight.float()
            return (normed * weight).to(x.dtype)
        # the weight applied after casting back, in the input dtype, as RMSNorm does
        return self.weight * normed.to(x.dtype)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        """The torch ops (see the class docstring): the native kernel cannot take the other ranks' squares."""
        return self.forward_torch(x)

    def _add_forward_native(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return self.forward_torch(x.add_(delta))

    def checkpoint_slice(self, param: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's features of the checkpoint's whole-projection norm weight."""
        if tensor.shape[0] != self.total_dim:
            raise ValueError(f"norm weight has {tensor.shape[0]} features, the whole projection {self.total_dim}")
        return tensor.narrow(0, self.start, self.weight.shape[0]) if _sharded(self.tp) else tensor

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]} of {self.total_dim} from {self.start}, eps={self.eps}"


def parallel_norm_pair(
    first: ParallelRMSNorm, second: ParallelRMSNorm, x: torch.Tensor, y: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``first(x)``, ``second(y)`` (rows ``[n, ...]`` each) with one all-reduce for both instead of two.

    OLMo 2's q and k norms of a layer run back to back: their sums of
    squares travel together as ``[n, 2]``, halving the collectives' latency.
    """
    sums = torch.cat([first.partial_sum_squares(x), second.partial_sum_squares(y)], dim=-1)  # [n, 2]
    if _sharded(first.tp):
        first.tp.all_reduce_(sums)
    return first.scale(x, sums[:, :1]), second.scale(y, sums[:, 1:])
