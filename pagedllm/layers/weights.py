"""Checkpoint loading shared by the model families: Hugging Face names into fused parameters.

Models store q/k/v and gate/up fused (``qkv_proj``, ``gate_up_proj``) so
each is one matmul; a checkpoint has them apart. ``fused_projections`` says
where each separate tensor goes, ``load_hf_weights`` copies them there and
checks that every parameter was written exactly once by name. Each
tensor goes through the ``weight_loader`` of its layer's quantization
method (``layers/quantization/quant_config.py``): a float copy, GGUF bytes into the
layer's blocks, or float rows rounded into int8 / int4 blocks as they
arrive; a layer with no method (norms) is copied into.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedllm.distributed.shard_plan import ShardPlan
from pagedllm.layers.linear import load_rows

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


def fused_part(name: str, fused: FusedMap) -> tuple[str, int, int, int | None] | None:
    """Where checkpoint tensor ``name`` goes if it is a part of a fused parameter: (the parameter's name, row
    offset, rows, first row a tensor-parallel rank takes); None for a tensor of its own."""
    for part, (fused_name, offset, size, start) in fused.items():
        if f".{part}." in name:
            return name.replace(part, fused_name), offset, size, start
    return None


def load_hf_weights(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], fused: FusedMap, tied_lm_head: bool
) -> None:
    """Copy checkpoint tensors (Hugging Face names) into ``model``'s parameters.

    ``tied_lm_head``: the LM head shares the embedding, so a checkpoint's
    ``lm_head.weight`` is skipped and not expected. Raises ValueError for a
    tensor with no place, a wrong shape, or a parameter left unwritten.
    """
    modules = dict(model.named_modules())
    loaded: set[str] = set()
    for name, tensor in weights:
        if "rotary_emb" in name or (name == "lm_head.weight" and tied_lm_head):
            continue
        target, offset, size, tensor = _checkpoint_part(name, tensor, fused, modules)
        owner_name, _, param = target.rpartition(".")
        owner = modules.get(owner_name)
        if owner is None:
            raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
        method = getattr(owner, "quant_method", None)
        try:
            if method is None:
                load_rows(owner, param, tensor, offset, size)
            else:
                method.weight_loader(owner, param, tensor, offset, size)
        except ValueError as e:  # the loaders know the layer's tensor; the checkpoint's name is said here
            raise ValueError(f"{name}: {e}") from None
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
    part = fused_part(name, fused)
    if part is not None:
        target, offset, size, start = part
        if start is not None:
            if tensor.shape[0] < start + size:
                raise ValueError(f"{name}: checkpoint has {tensor.shape[0]} rows, the shard needs "
                                 f"rows {start}..{start + size}")
            tensor = tensor.narrow(0, start, size)
        return target, offset, size, tensor
    owner_name, _, param_name = name.rpartition(".")
    owner = modules.get(owner_name)
    if hasattr(owner, "checkpoint_slice"):  # layers/parallel.py: this rank's slice
        tensor = owner.checkpoint_slice(param_name, tensor)
    return name, 0, None, tensor


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
            names.update(name.replace(fused_name, part) for part in split)
        else:
            names.add(name)
    return names
