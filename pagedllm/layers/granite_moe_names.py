"""GraniteMoE's stacked experts under the shared blocks' names (GraniteMoE and Granite 4.0-H share them).

The folder stores the experts stacked, as transformers' JetMoE-style
``ParallelExperts`` did: ``block_sparse_moe.input_linear.weight``
``[experts, 2 * intermediate, hidden]`` (each expert's gate rows, then its up
rows), ``block_sparse_moe.output_linear.weight`` ``[experts, hidden,
intermediate]`` and the router ``block_sparse_moe.router.layer.weight``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

_MOE = ".block_sparse_moe."


def granitemoe_weight_names(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A GraniteMoE folder's tensors under the shared blocks' names, the stacked experts one expert at a time."""
    for name, tensor in weights:
        owner, moe, part = name.partition(_MOE)
        if not moe:
            yield name, tensor
        elif part in ("router.layer.weight", "router.weight"):  # as saved; as transformers 5 holds it
            yield f"{owner}.mlp.gate.weight", tensor
        elif part == "input_linear.weight":
            if tensor.dim() != 3 or tensor.shape[1] % 2:
                raise ValueError(f"{name}: expected [experts, 2 * intermediate, hidden], got {tuple(tensor.shape)}")
            inter = tensor.shape[1] // 2
            for e, rows in enumerate(tensor):
                yield f"{owner}.mlp.experts.{e}.gate_proj.weight", rows[:inter]
                yield f"{owner}.mlp.experts.{e}.up_proj.weight", rows[inter:]
        elif part == "output_linear.weight":
            if tensor.dim() != 3:
                raise ValueError(f"{name}: expected [experts, hidden, intermediate], got {tuple(tensor.shape)}")
            for e, rows in enumerate(tensor):
                yield f"{owner}.mlp.experts.{e}.down_proj.weight", rows
        elif part.startswith("experts."):  # transformers 5's in-memory form, split where CausalLM loads it
            yield f"{owner}.mlp.{part}", tensor
        else:
            raise ValueError(f"unexpected GraniteMoE tensor {name!r}")
