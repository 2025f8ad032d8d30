"""Builds the model the runner steps: build -> load -> process after loading.

The quantization config (``layers/quantization/quant_config.py``) is resolved here once,
from the checkpoint and the engine config, and every layer asks it for its
method when built; then one sequence for every method: build on the meta
device, allocate, load each tensor through its layer's ``weight_loader``,
cast, ``process_weights_after_loading``, ``select_impls``. Decisions the
config leaves open ("auto") are taken here, once, and returned in
``LoadedModel``; nothing here is kept as module state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType
from torch import nn

from pagedllm.config import EngineConfig
from pagedllm.distributed.group import TensorParallelGroup
from pagedllm.kernels import kernels_failure, load_kernels
from pagedllm.layers.attention import AttentionBackend
from pagedllm.layers.custom_op import select_impls
from pagedllm.layers.linear import LinearMethod, UnquantizedLinearMethod, layer_shape
from pagedllm.layers.native_ops import NativeOps
from pagedllm.layers.quantization.bf16_linear import TorchBF16LinearMethod
from pagedllm.layers.quantization.gguf_dequantized import dequantized_linear_method, has_gguf_kernel
from pagedllm.layers.quantization.gguf_linear import GGUF_KERNEL_TYPES, gguf_types_held
from pagedllm.layers.quantization.onednn_linear import (
    OneDnnLinearMethod,
    onednn_bf16_supported,
)
from pagedllm.layers.quantization.packed_linear import (
    PackedBF16LinearMethod,
    PackedLinearMethod,
    packed_linear_bf16_native,
)
from pagedllm.layers.quantization.quant_config import (
    QuantConfig,
    dequantized_checkpoint_names,
    process_weights_after_loading,
    stored_checkpoint_names,
)
from pagedllm.layers.quantization.quantized_linear import (
    QuantizedEmbeddingMethod,
    QuantizedLinearMethod,
    group_fallbacks,
)
from pagedllm.loader.model_config import ModelArchConfig
from pagedllm.models.registry import model_class
from pagedllm.resolved_config import resolve_config
from pagedllm.runner.huge_pages import empty_weight

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# quantization values that round float weights at load (layers/quantization/quantized_linear.py): their bits
WEIGHT_ONLY = {"int8": 8, "int4": 4}


@dataclass(frozen=True)
class Precision:
    """The dtypes a run uses, resolved from ``EngineConfig.dtype`` and the device.

    ``compute`` is what activations are computed in: the model's dtype,
    except bf16 on the CPU, where only the linear layers multiply bf16
    values and the rest stays float32 (``layers/quantization/bf16_linear.py``).
    """

    weights: torch.dtype
    compute: torch.dtype
    bf16_matmul_only: bool


def resolve_precision(config: EngineConfig, device: torch.device) -> Precision:
    """The dtypes of a run of ``config`` on ``device``."""
    dtype = DTYPES[config.dtype]
    bf16_matmul_only = device.type == "cpu" and dtype == torch.bfloat16
    return Precision(dtype, torch.float32 if bf16_matmul_only else dtype, bf16_matmul_only)


def _warn_if_slow_half_precision(config: EngineConfig, device: torch.device, precision: Precision, linear: str) -> None:
    """Say so when a 2-byte dtype on the CPU runs on a path far slower than float32."""
    if device.type != "cpu" or precision.weights == torch.float32:
        return
    fast = precision.bf16_matmul_only and (
        (linear == "packed" and packed_linear_bf16_native()) or (linear == "onednn" and onednn_bf16_supported())
    )
    if not fast:
        # measured here: a torch bf16 matmul on a Zen 3 core is ~300x slower than float32
        logger.warning(
            "dtype=%s on this CPU runs on a slow path (linear_backend=%s, no native bf16 kernel for it): "
            "expect it to be far slower than float32; dtype='float32' is the fast choice here",
            config.dtype, linear,
        )


def make_linear_method(precision: Precision, linear: str) -> LinearMethod:
    """The one linear method the float layers get, from the dtype and resolved backend (not int8 / int4's)."""
    if precision.bf16_matmul_only:
        methods = {"packed": PackedBF16LinearMethod, "onednn": lambda: OneDnnLinearMethod(torch.bfloat16),
                   "torch": TorchBF16LinearMethod}
        return methods[linear]()
    methods = {"packed": PackedLinearMethod, "onednn": OneDnnLinearMethod, "torch": UnquantizedLinearMethod}
    return methods[linear]()


def resolve_quant_config(
    config: EngineConfig, model_config: ModelArchConfig, weights: Iterable[tuple[str, torch.Tensor]],
    device: torch.device, precision: Precision, linear: str, tp: TensorParallelGroup | None,
) -> QuantConfig:
    """The one quantization config of this load, from the checkpoint and ``config``.

    A GGUF file's quantized tensors are taken as stored where the native
    kernels run (the CPU, float32 activations) and no other quantization is
    asked for; weight-only int8 / int4 round float tensors at load (no
    float32 copy of the model is ever built); the float layers take the
    dtype's and backend's method.
    """
    bits = WEIGHT_ONLY.get(config.quantization or "")
    if bits is not None and load_kernels() is None:
        raise ValueError(f"quantization={config.quantization!r} needs the native CPU kernels, which cannot be "
                         f"built here: {kernels_failure()}")
    quantized: dict[str, int] = getattr(weights, "quantized", {})
    if quantized and bits is not None:
        kinds = sorted({GGMLQuantizationType(t).name for t in quantized.values()})
        logger.warning("quantization=%r on a GGUF file: its %s tensors are dequantized and rounded again to %s "
                       "(two roundings); quantization=None keeps the file's own blocks",
                       config.quantization, "+".join(kinds), config.quantization)
    fused_map = getattr(model_class(model_config), "checkpoint_fused_map", None)
    keep_gguf = bool(quantized) and fused_map is not None and config.quantization is None
    if keep_gguf and (device.type != "cpu" or precision.compute != torch.float32 or load_kernels() is None):
        logger.warning("GGUF weights are dequantized to %s: their kernels run on the CPU in float32 only (%s)",
                       precision.weights, kernels_failure() or f"device={device.type}")
        keep_gguf = False
    return QuantConfig(
        float_method=UnquantizedLinearMethod() if bits is not None else make_linear_method(precision, linear),
        weight_only_bits=bits,
        group_size=config.weight_group_size if bits is not None else None,
        gguf_types=quantized if keep_gguf else {}, fused=fused_map(model_config, tp) if keep_gguf else {},
        interleave=config.gguf_activations == "int8",
        # types with no kernel: held in bfloat16 where this CPU multiplies it fast (gguf_dequantized.py)
        dequantized_method=dequantized_linear_method() if keep_gguf else None,
    )


def _warn_what_stays_float(
    config: EngineConfig, quant_config: QuantConfig, model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]
) -> None:
    """Say which layers do not hold what was asked: GGUF tensors dequantized, int8 / int4 groups made smaller."""
    quantized = quant_config.gguf_types
    if quantized:
        half = sorted(weights.half)
        if half:
            kinds = {GGMLQuantizationType(quantized[name]).name for name in half}
            no_kernel = sorted(k for k in kinds if not has_gguf_kernel(GGMLQuantizationType[k]))
            logger.warning("%d GGUF tensors are dequantized to bfloat16 (%s linears): types %s have no kernel here%s; "
                           "e.g. %s", len(half), quant_config.dequantized_method.name, no_kernel,
                           f" (with the {sorted(kinds - set(no_kernel))} parts of the same fused layers)"
                           if kinds - set(no_kernel) else "", half[0])
        left = sorted(name for name in quantized
                      if name not in weights.keep and name not in weights.half and name != "lm_head.weight")
        if left:
            kinds = sorted({GGMLQuantizationType(quantized[name]).name for name in left})
            logger.warning("%d GGUF tensors are dequantized to float32 (no kernel for their type, or a fused layer "
                           "with a part of such a type): types %s, e.g. %s", len(left), kinds, left[0])
    if config.quantization in WEIGHT_ONLY:
        group_size = config.weight_group_size
        for group, names in sorted(group_fallbacks(model, group_size).items()):
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            logger.warning("quantization_group_size=%d does not divide the in_features of %d layers (%s): "
                           "they use groups of %d", group_size, len(names), shown, group)


def count_params(model: nn.Module) -> int:
    """Weights of the architecture: parameters, and the weights GGUF or int8 / int4 blocks hold (a tied
    embedding counted once)."""
    count = sum(p.numel() for p in model.parameters())
    seen: set[int] = set()
    for module in model.modules():
        qweight = module._buffers.get("qweight")
        if qweight is None or qweight.data_ptr() in seen:
            continue
        seen.add(qweight.data_ptr())
        rows, inputs = layer_shape(module)
        count += rows * inputs
    return count


def weight_format(config: EngineConfig, model: nn.Module, precision: Precision) -> str:
    """How the weights are held: the GGUF types kept (e.g. "gguf:Q4_1+Q8_0"), "int4-g128" (every group size
    used, e.g. "int4-g96+g128"), "int8-per-channel", or the dtype."""
    kept = sorted({GGUF_KERNEL_TYPES[t][0] for t in gguf_types_held(model)})
    if kept:
        return "gguf:" + "+".join(kept)
    if config.quantization in WEIGHT_ONLY:
        if config.weight_group_size is None:
            return f"{config.quantization}-per-channel"
        groups = sorted({m.group_size for m in model.modules()
                         if isinstance(getattr(m, "quant_method", None), (QuantizedLinearMethod, QuantizedEmbeddingMethod))})
        return f"{config.quantization}-" + "+".join(f"g{g}" for g in groups)
    return str(precision.weights).removeprefix("torch.")


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to step, and the decisions taken while loading it."""

    model: nn.Module
    linear_backend: str
    native_ops: NativeOps | None
    num_params: int  # weights of the architecture (a tied embedding counted once), before quantization
    load_seconds: float
    weight_bytes: int  # what the model holds in memory once loaded, cast and packed (model_tensors)
    weight_format: str  # how the weights are held (weight_format)


def model_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every tensor the model holds: parameters, buffers and tensor attributes (packed weights, RoPE tables)."""
    held: list[torch.Tensor] = []
    for module in model.modules():
        held += [t for t in module._parameters.values() if t is not None]
        held += [t for t in module._buffers.values() if t is not None]
        held += [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
    return held


def resident_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the memory behind ``tensors``, each storage once (a tied embedding, views of one buffer).

    oneDNN's packed weights have no storage to ask: their elements are counted.
    """
    seen: dict[object, int] = {}
    for t in tensors:
        if t.layout == torch.strided:
            storage = t.untyped_storage()
            seen[("storage", storage.data_ptr(), t.device)] = storage.nbytes()
        else:
            seen[("object", id(t))] = t.numel() * t.element_size()
    return sum(seen.values())


def load_model(
    config: EngineConfig,
    model_config: ModelArchConfig,
    weights: Iterable[tuple[str, torch.Tensor]],
    backend: AttentionBackend,
    device: torch.device,
    tp: TensorParallelGroup | None = None,
) -> LoadedModel:
    """Build the model on ``device`` from checkpoint ``weights``, in the config's dtype and linear method.

    ``model_config`` is the shape this process holds: with ``tp``, a rank's
    slice (``ShardPlan.local_config``), and only that slice of each
    checkpoint tensor is copied.
    """
    start = time.perf_counter()
    precision = resolve_precision(config, device)
    linear = resolve_config(config).linear_backend
    _warn_if_slow_half_precision(config, device, precision, linear)
    quant_config = resolve_quant_config(config, model_config, weights, device, precision, linear, tp)
    # built on the meta device: no time spent on random init of weights that the checkpoint overwrites
    # anyway; each layer's method made the tensors it loads into (create_weights)
    with torch.device("meta"):
        model = model_class(model_config)(model_config, backend, tp, quant_config)
    if hasattr(weights, "keep"):  # a GGUF file hands these tensors over as stored, the others dequantized
        weights.keep = stored_checkpoint_names(model)
        # the tensors of layers with a part of a type no kernel reads: handed over in bfloat16, their dtype
        weights.half = dequantized_checkpoint_names(model, quant_config)
    _warn_what_stays_float(config, quant_config, model, weights)
    # model.to_empty(device="cpu"), but through torch.empty_strided: to_empty's empty_like of a meta tensor runs
    # torch._refs, which imports sympy (a second or more of a cold start); large weights in huge pages
    # (runner/huge_pages.py: a decode step streams them)
    model = model._apply(lambda t: empty_weight(t.size(), t.stride(), t.dtype))
    model.load_weights(weights)  # each tensor through its layer's method's weight_loader
    # every weight rounded to dtype once; with bf16 matmuls only, held as float32 after that (exact)
    model = model.to(device=device, dtype=precision.weights)
    model = model.to(dtype=precision.compute).eval()
    num_params = count_params(model)
    process_weights_after_loading(model)
    # norms, RoPE and SiLU-and-multiply as single native calls where they build
    lib = load_kernels() if device.type == "cpu" and precision.compute == torch.float32 else None
    native_ops = NativeOps(lib) if lib is not None else None
    # each layer with a native implementation binds it (or its torch one) now, once
    select_impls(model, native_ops)
    # RoPE tables stay float32 whatever the model dtype, and cover the positions the engine reaches only
    model.model.rotary.float().build_tables(config.max_model_len)
    return LoadedModel(
        model, linear, native_ops, num_params, time.perf_counter() - start,
        resident_bytes(model_tensors(model)), weight_format(config, model, precision),
    )
