"""One linear layer class; how it stores and multiplies its weight is its pluggable ``LinearMethod``.

Models are written with ``Linear``. When a layer is built it asks the
model's quantization config (``layers/quantization/quant_config.py``) for its method,
``quant_config.get_quant_method(layer, prefix)``; the method then owns the
layer's storage through the three steps of every load::

    quant_method.create_weights(layer)                  at build (meta device): the tensors to load into
    quant_method.weight_loader(layer, name, tensor, offset, rows)   per checkpoint tensor (its TP slice)
    quant_method.process_weights_after_loading(layer)   once: loaded tensors -> what ``apply`` reads
    Linear.forward(x) = quant_method.apply(layer, x)

Methods: ``UnquantizedLinearMethod`` (``F.linear``, below),
``PackedLinearMethod`` / ``PackedBF16LinearMethod`` (``layers/quantization/packed_linear.py``),
``OneDnnLinearMethod`` (``layers/quantization/onednn_linear.py``), ``TorchBF16LinearMethod``
(``layers/quantization/bf16_linear.py``), ``QuantizedLinearMethod`` (``layers/quantization/quantized_linear.py``),
``GGUFLinearMethod`` / ``GGUFPartsLinearMethod`` (``layers/quantization/gguf_linear.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


class QuantConfig(Protocol):
    """What a layer asks when built (``layers/quantization/quant_config.py``'s ``QuantConfig``; named here so that the
    layers need not import the module that imports them)."""

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantMethod | None:
        """The method ``layer`` named ``prefix`` takes; None: its unquantized default."""
        ...


class QuantMethod:
    """How a layer (a ``Linear``, an embedding) stores its weights: the steps of every load that it owns."""

    name: str = "abstract"

    def create_weights(self, layer: nn.Module) -> None:  # noqa: B027 - float methods load into the layer's own weight
        """At build (on the meta device): give ``layer`` the tensors the checkpoint loads into."""

    def weight_loader(self, layer: nn.Module, name: str, tensor: torch.Tensor, offset: int, rows: int | None) -> None:
        """Load checkpoint ``tensor`` (this rank's slice) into rows ``[offset, offset + rows)`` of ``layer.<name>``
        ("weight", "bias"; rows None: all of it)."""
        load_rows(layer, name, tensor, offset, rows)

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027 - some methods need nothing
        """Turn what was loaded into this method's storage (once)."""


class LinearMethod(QuantMethod, ABC):
    """How a ``Linear`` stores its weight and computes ``x @ W.T + b``."""

    def tie_weights(self, layer: Linear, embedding: nn.Module) -> None:
        """Make ``layer`` (a tied LM head) read the loaded ``embedding``'s table, before ``process_weights_after_loading``."""
        layer.weight = embedding.weight

    @abstractmethod
    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """The layer's output for ``x`` ``[..., in_features]``: ``[..., out_features]``."""


class UnquantizedLinearMethod(LinearMethod):
    """The weight as loaded, through ``F.linear`` (MKL on the CPU, cuBLAS on a GPU)."""

    name = "torch"

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)


def load_rows(layer: nn.Module, name: str, tensor: torch.Tensor, offset: int, rows: int | None) -> None:
    """Copy ``tensor`` into rows ``[offset, offset + rows)`` (all: None) of ``layer``'s tensor ``name``.

    ValueError when the layer holds no such tensor or the shapes differ.
    """
    dest = layer._parameters.get(name, layer._buffers.get(name))
    if dest is None:
        raise ValueError(f"has no place in the model ({type(layer).__name__} holds no tensor {name!r})")
    dest = dest.data if rows is None else dest.data.narrow(0, offset, rows)
    check_shape(tensor, dest.shape)
    dest.copy_(tensor)


def check_shape(tensor: torch.Tensor, shape: tuple[int, ...] | torch.Size) -> None:
    """ValueError when checkpoint ``tensor`` is not of the model's ``shape``."""
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"checkpoint shape {tuple(tensor.shape)} != model {tuple(shape)}")


def replace_parameter(layer: nn.Module, name: str, value: torch.Tensor | None) -> None:
    """Drop parameter ``name`` of ``layer`` (this module's reference only) and keep ``value`` as a buffer.

    A tied LM head shares its weight with the embedding: deleting the
    attribute here leaves the embedding's parameter alone.
    """
    if name in layer._parameters:
        del layer._parameters[name]
    layer.register_buffer(name, value)


def layer_shape(layer: nn.Module) -> tuple[int, int]:
    """(rows, inputs) of the weight of a ``Linear`` or an embedding: ``(out_features, in_features)`` or
    ``(num_embeddings, embedding_dim)``."""
    if isinstance(layer, nn.Embedding):
        return layer.num_embeddings, layer.embedding_dim
    return layer.out_features, layer.in_features


class Linear(nn.Linear):
    """``nn.Linear`` whose storage and matmul belong to ``quant_method``, asked of ``quant_config`` when built.

    ``prefix``: the layer's name in the model ("model.layers.0.mlp.down_proj"), what the config decides
    by; ``input_start``: the first input column of the checkpoint's weight it holds (a row-parallel
    shard's; 0 otherwise). No config: unquantized.
    """

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, quant_config: QuantConfig | None = None,
        prefix: str = "", input_start: int = 0,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.input_start = input_start
        method = None if quant_config is None else quant_config.get_quant_method(self, prefix)
        self.quant_method: LinearMethod = method if method is not None else UnquantizedLinearMethod()
        self.quant_method.create_weights(self)

    @classmethod
    def from_linear(cls, linear: nn.Linear, method: LinearMethod | None = None) -> Linear:
        """A ``Linear`` holding ``linear``'s weight and bias as ``method`` (default: unquantized) holds them, loaded
        as a checkpoint is: ``create_weights``, ``weight_loader``, ``process_weights_after_loading``.

        ``linear`` itself is left as it was (the new layer holds copies).
        """
        with torch.device("meta"):
            layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None)
        if method is not None:
            layer.quant_method = method
            method.create_weights(layer)
        layer = layer.to_empty(device=linear.weight.device)
        for name, tensor in (("weight", linear.weight), ("bias", linear.bias)):
            if tensor is not None:
                layer.quant_method.weight_loader(layer, name, tensor.detach(), 0, None)
        layer.quant_method.process_weights_after_loading(layer)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, method={self.quant_method.name}"
