"""KV cache groups: which layers share a block table, and where each layer's K/V sits in a block.

A sliding-window layer of ``W`` tokens never reads a key more than ``W - 1``
positions behind the query, so the blocks of a long sequence that fall wholly
out of that window could go back to the pool, but only if no full-attention
layer still needs the same block. Layers are therefore split into *groups*
by cache kind (full attention; a window of ``W`` tokens), and a sequence holds
one block table per group (``engine/block_manager.py``).

Every group takes its blocks from the one pool, so one block id must mean the
same bytes in every group: the pool's layer dimension holds ``num_rows`` rows,
and a group of ``num_rows`` layers keeps layer ``layers[r]`` in row ``r`` of
its blocks. Kinds with more layers than that are split into several groups of
``num_rows`` layers (vLLM's hybrid allocator does the same); the last group of
a kind may hold fewer layers than rows, and its spare rows are padding::

    Gemma 3 1B: 26 layers, every 6th full (5, 11, 17, 23), the others a window of 512
    num_rows = 4 (the smallest kind's layer count)
    group 0  full     layers 5 11 17 23
    group 1  window   layers 0 1 2 3
    ...
    group 6  window   layers 24 25 -  -      <- 2 padded rows: 2 / 28 = 7.1 % of the pool unused

A model whose layers all share one kind has one group of all its layers: a
model without windows keeps exactly the block ids it always had.

A window at least as long as the model's context never drops a key, so it
counts as full attention here (its blocks could never be freed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.loader.model_config import ModelArchConfig


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    """Layers that share one block table per sequence.

    Attributes:
        window: the layers' sliding window in tokens (a query at ``i`` sees keys ``i - window < j <= i``);
            None: full attention.
        layers: the model's layer indices; layer ``layers[r]`` sits in row ``r`` of the group's blocks.
    """

    window: int | None
    layers: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class KVCacheLayout:
    """The groups of a model and the rows of one block (the pool tensor's layer dimension)."""

    groups: tuple[KVCacheGroup, ...]
    num_rows: int

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each group's window (None: full attention), in group order: what ``BlockManager`` takes."""
        return tuple(g.window for g in self.groups)

    @property
    def num_padded_rows(self) -> int:
        """Rows of a block no layer uses, summed over the groups (each group has ``num_rows``)."""
        return sum(self.num_rows - len(g.layers) for g in self.groups)

    @property
    def padding_fraction(self) -> float:
        """The pool's share that padding takes: padded rows over all rows of all groups."""
        return self.num_padded_rows / (self.num_rows * len(self.groups))

    def has_layer(self, layer: int) -> bool:
        """Whether model layer ``layer`` has K/V in the pool (a hybrid model's state layers have none)."""
        return any(layer in g.layers for g in self.groups)

    def layer_slot(self, layer: int) -> tuple[int, int]:
        """(group, row) of model layer ``layer``."""
        for g, group in enumerate(self.groups):
            if layer in group.layers:
                return g, group.layers.index(layer)
        raise ValueError(f"layer {layer} has no KV cache (layers: {self.num_layers})")

    @property
    def num_layers(self) -> int:
        """Layers with a KV cache."""
        return sum(len(g.layers) for g in self.groups)


def kv_cache_layout(
    layer_windows: Sequence[int | None], max_model_len: int | None = None, layer_ids: Sequence[int] | None = None,
) -> KVCacheLayout:
    """The groups of a model whose layer ``i`` has the window ``layer_windows[i]`` (None: full attention).

    Full-attention groups come first, then windows from the shortest. A window
    of ``max_model_len`` tokens or more counts as full attention. With one
    kind, one group of all the layers; with several, groups of as many layers
    as the smallest kind has (see the module docstring). ``layer_ids``: the
    model layer of each entry (a hybrid model's attention layers); default
    ``0 .. len(layer_windows) - 1``.
    """
    if not layer_windows:
        raise ValueError("a KV cache layout needs at least one layer")
    if layer_ids is None:
        layer_ids = range(len(layer_windows))
    elif len(layer_ids) != len(layer_windows):
        raise ValueError(f"{len(layer_ids)} layer ids for {len(layer_windows)} windows")
    kinds: dict[int | None, list[int]] = {}
    for layer, window in zip(layer_ids, layer_windows):
        if window is not None and window < 1:
            raise ValueError(f"layer {layer}: a sliding window must be >= 1 token, got {window}")
        if window is not None and max_model_len is not None and window >= max_model_len:
            window = None  # never drops a key within the context
        kinds.setdefault(window, []).append(layer)
    order = sorted(kinds, key=lambda w: -1 if w is None else w)
    if len(order) == 1:
        return KVCacheLayout((KVCacheGroup(order[0], tuple(kinds[order[0]])),), len(layer_windows))
    num_rows = min(len(layers) for layers in kinds.values())
    groups = tuple(
        KVCacheGroup(window, tuple(kinds[window][start : start + num_rows]))
        for window in order
        for start in range(0, len(kinds[window]), num_rows)
    )
    return KVCacheLayout(groups, num_rows)


def model_kv_layout(model_config: ModelArchConfig) -> KVCacheLayout:
    """The layout of a model's KV cache, from its attention layers' windows (a hybrid model's state layers
    have no K/V): the one place the engine (block manager) and the runner (cache tensor, attention metadata)
    both take it from, so the two always agree."""
    layers = model_config.attention_layers
    return kv_cache_layout([model_config.sliding_window(i) for i in layers], layer_ids=layers)
