"""The quantization config: one object, chosen once per load, that every linear and embedding layer asks when built.

The model loader resolves it from the checkpoint (a GGUF file's tensor
types) and the engine config (``quantization``, ``gguf_activations``, the
float linear method of the dtype and backend) and hands it to the model's
constructor; each ``Linear`` and ``VocabParallelEmbedding`` then calls
``get_quant_method(layer, prefix)`` and keeps the answer. The load itself is
the same for every method::

    build (meta device) -> method.create_weights(layer)
    load                -> method.weight_loader(layer, name, tensor, offset, rows)   per checkpoint tensor
    after loading       -> method.process_weights_after_loading(layer)

Decision order for a layer: the registered rules (``register_quant_method``:
a new method, e.g. a LoRA or a test's, added without touching the loader),
then the GGUF file's blocks where the kernels take them as stored, then
weight-only int8 / int4, then the float method.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from torch import nn

from pagedllm.layers.linear import Linear, LinearMethod, QuantMethod, UnquantizedLinearMethod
from pagedllm.layers.quantization.gguf_dequantized import (
    DequantizedEmbeddingMethod,
    has_gguf_kernel,
)
from pagedllm.layers.quantization.gguf_linear import gguf_method, gguf_spans
from pagedllm.layers.quantization.quantized_linear import (
    QuantizedEmbeddingMethod,
    QuantizedLinearMethod,
)
from pagedllm.layers.weights import FusedMap

# (layer, prefix) -> the method that layer takes, or None to leave the choice to the config
QuantRule = Callable[[nn.Module, str], QuantMethod | None]

_RULES: list[QuantRule] = []


def register_quant_method(rule: QuantRule) -> Callable[[], None]:
    """Consult ``rule`` first for every layer of the models built from now on; returns the function that
    removes it again."""
    _RULES.append(rule)
    return lambda: _RULES.remove(rule)


@dataclass(frozen=True)
class QuantConfig:
    """How every linear and embedding layer of one load holds its weights.

    ``float_method``: the method of float linear layers (shared: the float
    methods keep no per-layer state). ``weight_only_bits`` / ``group_size``:
    int8 / int4 blocks rounded at load (None: float). ``gguf_types``: the
    checkpoint's quantized tensors the layers may take as stored (name ->
    ggml type), ``fused``: where a checkpoint's q/k/v and gate/up parts go.
    ``interleave``: interleave blocks after loading (``gguf_activations="int8"``).
    ``rules``: extra deciders consulted first (default: those ``register_quant_method`` holds now).
    ``dequantized_method``: the 2-byte method of a layer with a GGUF part of a type no kernel reads
    (``gguf_dequantized.py``); None: such layers take the float method.
    """

    float_method: LinearMethod = field(default_factory=UnquantizedLinearMethod)
    weight_only_bits: int | None = None
    group_size: int | None = None
    gguf_types: Mapping[str, int] = field(default_factory=dict)
    fused: FusedMap = field(default_factory=dict)
    interleave: bool = False
    rules: tuple[QuantRule, ...] = field(default_factory=lambda: tuple(_RULES))
    dequantized_method: LinearMethod | None = None
    # checkpoint parameter -> its quantized parts (gguf_spans), derived once from gguf_types and fused
    _gguf_parts: Mapping[str, list[tuple[str, int, int | None, int]]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_gguf_parts", MappingProxyType(gguf_spans(self.gguf_types, self.fused)))

    def gguf_parts(self, name: str) -> list[tuple[str, int, int | None, int]] | None:
        """The checkpoint's quantized parts of parameter ``name`` (``gguf_spans``); None: it has none."""
        return self._gguf_parts.get(name)

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantMethod | None:
        """The method ``layer`` (named ``prefix`` in the model) takes; None: the layer's unquantized default."""
        for rule in self.rules:
            method = rule(layer, prefix)
            if method is not None:
                return method
        parts = self._gguf_parts.get(f"{prefix}.weight")
        if parts is not None:
            method = gguf_method(layer, parts, self.interleave)
            if method is not None:
                return method
            if self.dequantized_method is not None and not all(has_gguf_kernel(kind) for *_, kind in parts):
                return (DequantizedEmbeddingMethod(self.dequantized_method) if isinstance(layer, nn.Embedding)
                        else self.dequantized_method)
        if self.weight_only_bits is not None:
            if isinstance(layer, nn.Embedding):
                return QuantizedEmbeddingMethod(self.weight_only_bits, self.group_size)
            return QuantizedLinearMethod(self.weight_only_bits, self.group_size, self.interleave)
        return self.float_method if isinstance(layer, Linear) else None


def dequantized_checkpoint_names(model: nn.Module, quant_config: QuantConfig) -> set[str]:
    """The checkpoint tensors ``model``'s layers hold in bfloat16 because a part of theirs has a GGUF type no
    kernel reads (``gguf_dequantized.py``): those parts, and the other parts of the same fused layers."""
    names: set[str] = set()
    if quant_config.dequantized_method is None:
        return names
    for prefix, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is quant_config.dequantized_method or isinstance(method, DequantizedEmbeddingMethod):
            names.update(name for name, *_ in quant_config._gguf_parts.get(f"{prefix}.weight", ()))
    return names


def stored_checkpoint_names(model: nn.Module) -> set[str]:
    """The checkpoint tensors ``model``'s layers take as stored (a GGUF file's blocks), not dequantized."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(getattr(module, "quant_method", None), "stored_names", ()))
    return names


def process_weights_after_loading(model: nn.Module) -> None:
    """Each layer's method turns what was loaded into what it computes with, once. A tied LM head's method first
    takes its embedding's table (``tie_weights``), finished: ``modules()`` yields the embedding first."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, QuantMethod):
            if "tied_embedding" in module.__dict__:  # layers/parallel.py's ParallelLMHead(tied_to=...)
                method.tie_weights(module, module.tied_embedding)
            method.process_weights_after_loading(module)
