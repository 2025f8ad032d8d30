"""Swap every plain ``nn.Linear`` of a model for another implementation, in place."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn


def replace_linear_layers(model: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> int:
    """Replace each ``nn.Linear`` in ``model`` with ``make(linear)``; returns how many.

    Only exact ``nn.Linear`` instances are replaced, so layers already swapped
    (and the embedding a tied LM head shares its weight with) are left alone.
    """
    targets = [(name, mod) for name, mod in model.named_modules() if type(mod) is nn.Linear]
    for name, mod in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, make(mod))
    return len(targets)
