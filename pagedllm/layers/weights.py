"""Checkpoint loading shared by the model families: Hugging Face names into fused parameters.

Models store q/k/v and gate/up fused (``qkv_proj``, ``gate_up_proj``) so
each is one matmul; a checkpoint has them apart. ``fused_projections`` says
where each separate tensor goes, ``load_hf_weights`` copies them there and
checks that every parameter was written exactly once by name. A layer
prepared for weight-only int8 / int4 (``layers/quantized_linear.py``,
``prepare_quantized_loading``) has blocks instead of a float weight: its
float tensors (or their fused parts) are quantized into those blocks as
they arrive.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedllm.distributed.shard_plan import ShardPlan
from pagedllm.layers.quantized_linear import quantize_rows_into, quantized_weight_target

# checkpoint part -> (fused parameter, row offset, rows, first row of the checkpoint's tensor a
# tensor-parallel rank takes; None: the whole tensor, one process)
FusedMap = dict[str, tuple[str, int, int, int | None]]


def fused_projections(
    q_size: int, kv_size: int, intermediate_size: int, plan: ShardPlan | None = None
) -> FusedMap:
    """Where q/k/v and gate/up of a checkpoint go in ``qkv_proj`` / ``gate_up_proj``.

    Sizes are this rank's (the whole model's in one process); ``plan`` says
    which rows of each checkpoint tensor a tensor-parallel rank takes.
    """
    q_start = kv_start = i_start = None
    if plan is not None and plan.size > 1:
        q_start, kv_start, i_start = plan.q_rows[0], plan.kv_rows[0], plan.intermediate[0]
    return {
        "q_proj": ("qkv_proj", 0, q_size, q_start),
        "k_proj": ("qkv_proj", q_size, kv_size, kv_start),
        "v_proj": ("qkv_proj", q_size + kv_size, kv_size, kv_start),
        "gate_proj": ("gate_up_proj", 0, intermediate_size, i_start),
        "up_proj": ("gate_up_proj", intermediate_size, intermediate_size, i_start),
    }


def load_hf_weights(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], fused: FusedMap, tied_lm_head: bool
) -> None:
    """Copy checkpoint tensors (Hugging Face names) into ``model``'s parameters.

    ``tied_lm_head``: the LM head shares the embedding, so a checkpoint's
    ``lm_head.weight`` is skipped and not expected. Raises ValueError for a
    tensor with no place, a wrong shape, or a parameter left unwritten.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    # a layer holding GGUF blocks (layers/gguf_linear.py) takes a checkpoint's bytes in its qweight buffer
    quantized = {name: buf for name, buf in model.named_buffers(remove_duplicate=False) if name.endswith(".qweight")}
    modules = dict(model.named_modules())
    loaded: set[str] = set()
    for name, tensor in weights:
        if "rotary_emb" in name or (name == "lm_head.weight" and tied_lm_head):
            continue
        target, offset, size, tensor = _checkpoint_part(name, tensor, fused, modules)
        blocks = None
        if tensor.is_floating_point() and target not in params and target.endswith(".weight"):
            blocks = quantized_weight_target(modules.get(target.rpartition(".")[0]))
        if blocks is not None:  # weight-only int8 / int4: rounded now, no float32 copy of the layer
            qweight, bits, group, in_features = blocks
            dest = qweight if size is None else qweight.narrow(0, offset, size)
            if (dest.shape[0], in_features) != tuple(tensor.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model "
                                 f"{(dest.shape[0], in_features)}")
            quantize_rows_into(dest, tensor, bits, group)
        else:
            _copy_into(name, tensor, quantized if tensor.dtype == torch.uint8 else params, target, offset, size, modules)
        loaded.add(name)
        # let go of this tensor before the loader reads the next: the load's peak holds one checkpoint tensor
        del tensor
    missing = _expected_checkpoint_names(model, fused, tied_lm_head) - loaded
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {sorted(missing)[:3]}")


def _checkpoint_part(
    name: str, tensor: torch.Tensor, fused: FusedMap, modules: dict[str, nn.Module]
) -> tuple[str, int, int | None, torch.Tensor]:
    """Where checkpoint tensor ``name`` goes: (parameter name, row offset, rows or None for all, the part of
    ``tensor`` this process takes: a tensor-parallel rank's slice, all of it in one process)."""
    for part, (fused_name, offset, size, start) in fused.items():
        if f".{part}." in name:
            if start is not None:
                if tensor.shape[0] < start + size:
                    raise ValueError(f"{name}: checkpoint has {tensor.shape[0]} rows, the shard needs "
                                     f"rows {start}..{start + size}")
                tensor = tensor.narrow(0, start, size)
            return name.replace(part, fused_name), offset, size, tensor
    owner_name, _, param_name = name.rpartition(".")
    owner = modules.get(owner_name)
    if hasattr(owner, "checkpoint_slice"):  # layers/parallel.py: this rank's slice
        tensor = owner.checkpoint_slice(param_name, tensor)
    return name, 0, None, tensor


def _copy_into(
    name: str, tensor: torch.Tensor, places: dict[str, torch.Tensor], target: str, offset: int, size: int | None,
    modules: dict[str, nn.Module],
) -> None:
    """Copy ``tensor`` into rows ``[offset, offset + size)`` (all: None) of ``target`` in ``places``: the
    parameters, or for GGUF bytes (uint8) the ``qweight`` buffers (a fused layer of mixed GGUF types says
    where each part's rows lie in its flat buffer)."""
    key = target.removesuffix(".weight") + ".qweight" if tensor.dtype == torch.uint8 else target
    param = places.get(key)
    if param is None:
        raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
    owner = modules.get(key.rpartition(".")[0])
    method = getattr(owner, "quant_method", None)
    if tensor.dtype == torch.uint8 and hasattr(method, "qweight_rows"):
        dest = method.qweight_rows(owner, offset, param.shape[0] if size is None else size)
    else:
        dest = param.data if size is None else param.data.narrow(0, offset, size)
    if dest.shape != tensor.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(dest.shape)}")
    dest.copy_(tensor)


def _expected_checkpoint_names(model: nn.Module, fused: FusedMap, tied_lm_head: bool) -> set[str]:
    names: set[str] = set()
    held = [name for name, _ in model.named_parameters()]
    held += [name.removesuffix(".qweight") + ".weight" for name, _ in model.named_buffers() if name.endswith(".qweight")]
    for name in held:
        if name == "lm_head.weight" and tied_lm_head:
            continue
        split = [part for part, (fname, *_) in fused.items() if f".{fname}." in name]
        if split:
            fused_name = fused[split[0]][0]
            suffix = name.split(f".{fused_name}.")[1]
            if suffix == "bias" and fused_name == "gate_up_proj":
                continue
            names.update(name.replace(fused_name, part) for part in split)
        else:
            names.add(name)
    return names
