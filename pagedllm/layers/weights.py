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

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pagedllm.distributed.shard_plan import ShardPlan
from pagedllm.layers.linear import load_rows

# the rows of a checkpoint tensor a tensor-parallel rank takes in pieces, ``(start, rows)`` each, in order (a Gated
# DeltaNet's q | k | v rows: its heads' rows of each)
RowSpans = tuple[tuple[int, int], ...]

# checkpoint part -> (fused parameter, row offset, rows, first row of the checkpoint's tensor a
# tensor-parallel rank takes, or its pieces; None: the whole tensor, one process)
FusedMap = dict[str, tuple[str, int, int, int | RowSpans | None]]


def take_rows(tensor: torch.Tensor, spans: RowSpans) -> torch.Tensor:
    """Rows ``[start, start + rows)`` of ``tensor`` for each span, in order: one tensor (a view for one span).

    Whatever the rows hold (floats, a GGUF file's ``[rows, row bytes]`` blocks); ValueError where a span falls
    outside the tensor's rows.
    """
    for start, rows in spans:
        if start < 0 or rows < 0 or start + rows > tensor.shape[0]:
            raise ValueError(f"checkpoint has {tensor.shape[0]} rows, the shard needs rows {start}..{start + rows}")
    if len(spans) == 1:
        return tensor.narrow(0, *spans[0])
    return torch.cat([tensor.narrow(0, start, rows) for start, rows in spans])


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


def fused_part(name: str, fused: FusedMap) -> tuple[str, int, int, int | RowSpans | None] | None:
    """Where checkpoint tensor ``name`` goes if it is a part of a fused parameter: (the parameter's name, row
    offset, rows, first row a tensor-parallel rank takes); None for a tensor of its own."""
    # the longest part named wins: a shared expert's "shared_expert.gate_proj" holds the dense "gate_proj". The
    # parts ".{part}." matches are the runs of whole components inside the name (looked up, not scanned: a
    # mixture of experts has 3 parts per expert)
    parts = name.split(".")
    found = max((run for i in range(1, len(parts) - 1) for j in range(i + 1, len(parts))
                 if (run := ".".join(parts[i:j])) in fused), key=len, default=None)
    if found is None:
        return None
    fused_name, offset, size, start = fused[found]
    return name.replace(f".{found}.", f".{fused_name}."), offset, size, start


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
            spans = ((start, size),) if isinstance(start, int) else start
            try:
                tensor = take_rows(tensor, spans)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
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
        # the longest fused name held wins (an experts' "experts.gate_up" beside a dense "gate_up_proj")
        fused_name = max((fname for fname, *_ in fused.values() if f".{fname}." in name), key=len, default=None)
        if fused_name is not None:
            split = [part for part, (fname, *_) in fused.items() if fname == fused_name]
            names.update(name.replace(f".{fused_name}.", f".{part}.") for part in split)
        else:
            names.add(name)
    return names


def split_fused_checkpoint(
    weights: Iterable[tuple[str, torch.Tensor]], splits: dict[str, tuple[tuple[str, int], ...]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint whose projections are stored fused (Phi-3's ``qkv_proj``, ``gate_up_proj``) as separate parts.

    ``splits``: fused name -> its parts in row order, ``(part name, rows)``.
    A tensor named ``....<fused>.weight`` (or ``.bias``) comes out as one
    row slice (a view) per part, renamed ``....<part>.weight``, so that it
    loads through ``fused_projections``' map like a checkpoint that stores
    the parts apart; whatever the rows hold (floats, or a GGUF file's
    ``[rows, row bytes]`` blocks). ValueError when its rows are not the parts' sum.
    """
    for name, tensor in weights:
        owner, _, param = name.rpartition(".")
        module, _, fused = owner.rpartition(".")
        parts = splits.get(fused)
        if parts is None:
            yield name, tensor
            continue
        total = sum(rows for _, rows in parts)
        if tensor.shape[0] != total:
            raise ValueError(f"{name}: checkpoint has {tensor.shape[0]} rows, its parts "
                             f"{[part for part, _ in parts]} need {total}")
        start = 0
        for part, rows in parts:
            yield f"{module}.{part}.{param}", tensor.narrow(0, start, rows)
            start += rows
        del tensor


# transformers 5's fused experts (a ``Qwen3MoeExperts``'s parameters): name -> the per-expert parts of each
# expert's slice, in row order ((part, rows as a fraction of the slice's): gate then up halves)
_STACKED_EXPERTS = {
    "experts.gate_up_proj": ("gate_proj", "up_proj"),
    "experts.down_proj": ("down_proj",),
}


def split_stacked_experts(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint whose experts are stacked in 3-D tensors, as per-expert tensors (views).

    transformers 5 holds ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` (gate rows,
    then up rows) and ``mlp.experts.down_proj`` ``[E, H, I]``; a folder saved
    by it is per-expert already (``mlp.experts.{e}.gate_proj.weight``), and
    those pass through. Each stacked tensor comes out as
    ``mlp.experts.{e}.<part>.weight``, ``[rows, cols]`` of expert ``e``.
    """
    for name, tensor in weights:
        owner, _, last = name.rpartition(".")
        parts = _STACKED_EXPERTS.get(f"{owner.rpartition('.')[2]}.{last}") if owner.endswith(".experts") else None
        if parts is None:
            yield name, tensor
            continue
        if tensor.dim() != 3 or tensor.shape[1] % len(parts):
            raise ValueError(f"{name}: stacked experts must be [experts, rows, cols] with rows split into "
                             f"{list(parts)}, got {tuple(tensor.shape)}")
        rows = tensor.shape[1] // len(parts)
        for e in range(tensor.shape[0]):
            for i, part in enumerate(parts):
                yield f"{owner}.{e}.{part}.weight", tensor[e].narrow(0, i * rows, rows)
        del tensor


def shard_expert_columns(
    weights: Iterable[tuple[str, torch.Tensor]], plan: ShardPlan
) -> Iterator[tuple[str, torch.Tensor]]:
    """Per-expert checkpoint tensors with each expert's ``down_proj`` cut to this rank's input columns.

    ``plan.expert_intermediate`` gives the columns (the same rows of gate and
    up go through the fused map); a GGUF tensor kept as stored (uint8 ``[rows,
    row bytes]``) is cut in bytes, which the plan's whole-block split makes
    exact. A down bias is added once: rank 0 keeps it, the others load
    zeros. Other tensors pass through.
    """
    start, local = plan.expert_intermediate
    total = plan.total_expert_intermediate
    for name, tensor in weights:
        owner, _, param = name.rpartition(".")
        if plan.size == 1 or not owner.endswith(".down_proj") or ".experts." not in owner:
            yield name, tensor
            continue
        if param == "bias":
            yield name, tensor if plan.rank == 0 else torch.zeros_like(tensor)
            continue
        width = tensor.shape[1]
        if tensor.dtype == torch.uint8:  # GGUF blocks: `width` bytes hold `total` weights
            if (start * width) % total or (local * width) % total:
                raise ValueError(f"{name}: columns {start}..{start + local} of {total} are not whole GGUF blocks")
            yield name, tensor.narrow(1, start * width // total, local * width // total)
        elif width != total:
            raise ValueError(f"{name}: an expert's down projection has {width} columns, the config says {total}")
        else:
            yield name, tensor.narrow(1, start, local)
