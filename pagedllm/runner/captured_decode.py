"""Decode steps replayed from graphs of the model's own forward pass (``runner/step_graph.py``).

The first decode step of each shape runs the model as usual while a
``StepGraph`` records it; later steps of that shape replay the record: the
model's kernels back to back, without the Python around them. A shape is
the number of sequences and the block-table width, rounded up to a power of
two so that a growing context is captured a few times, not once per block:

    step: 3 sequences, tables 5 blocks wide  ->  graph (3, 8): tables padded
    with block 0 to 8 columns (never read: the lengths bound every read)

Decode-only steps of at most ``max_rows`` sequences are captured; prefills,
mixed steps and larger batches (where the Python is a small share of the
step) run the model directly. Only models whose decode path takes nothing
from the step but its tensors may be captured (``supports``).
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.attention import AttentionBackend, AttentionMetadata
from pagedllm.loader.model_config import ModelArchConfig
from pagedllm.runner.step_graph import CaptureError, StepGraph

logger = logging.getLogger(__name__)

MIN_TABLE_WIDTH = 8  # blocks: the narrowest table a graph is made for


def owned_tensors(model: nn.Module, kv_cache: torch.Tensor) -> list[torch.Tensor]:
    """Every tensor the model holds (parameters, buffers, tensor attributes) and the KV cache."""
    owned = [kv_cache]
    for module in model.modules():
        owned += [t for t in module._parameters.values() if t is not None]
        owned += [t for t in module._buffers.values() if t is not None]
        owned += [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
    return owned


class CapturedDecode:
    """Decode steps of ``model`` from per-shape ``StepGraph`` records.

    Args:
        model: the model; ``model(input_ids, positions, kv_caches, meta)`` -> hidden states.
        kv_cache: the one KV tensor; ``kv_caches`` are its per-layer (K, V) views.
        max_rows: the most sequences a captured step has.
    """

    @staticmethod
    def supports(backend: AttentionBackend, model_config: ModelArchConfig) -> bool:
        """Whether a decode step reads the step through tensors only: ``cpu_paged`` without score softcaps.

        ``cpu_paged`` decodes (windowed or not) take block tables and lengths
        as tensors; the SDPA decode path sizes its gather from the Python
        lengths, which a record would freeze.
        """
        return backend.name == "cpu_paged" and model_config.attn_logit_softcapping is None

    def __init__(
        self, model: nn.Module, kv_cache: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        max_rows: int,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.max_rows = max_rows
        self._owned = owned_tensors(model, kv_cache)
        self.graphs: dict[tuple[int, int], StepGraph] = {}
        self.failed: str | None = None  # why capturing was given up, once it was

    def accepts(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        """Whether a step is replayed (or captured): decode tokens only, at most ``max_rows`` of them."""
        return (
            self.failed is None and meta.num_prefills == 0 and num_tokens == meta.num_seqs
            and num_tokens <= self.max_rows
        )

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states ``[num_tokens, hidden]``, as the model's forward; valid until the next step."""
        width = max(MIN_TABLE_WIDTH, 1 << (meta.block_tables.shape[1] - 1).bit_length())
        tables = F.pad(meta.block_tables, (0, width - meta.block_tables.shape[1]))  # [num_seqs, width]
        inputs = [input_ids, positions, meta.slot_mapping, tables, meta.seq_lens_tensor]
        key = (input_ids.shape[0], width)
        graph = self.graphs.get(key)
        if graph is not None:
            return graph.replay(inputs)

        def step(ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, tbl: torch.Tensor,
                 lens: torch.Tensor) -> torch.Tensor:
            static = dataclasses.replace(meta, slot_mapping=slots, block_tables=tbl, seq_lens_tensor=lens)
            return self.model(ids, pos, self.kv_caches, static)

        try:
            graph, hidden = StepGraph.capture(step, inputs, self._owned)
        except CaptureError as e:
            # the capture ran nothing to completion that matters: run this step (and all later ones) directly
            self.failed = str(e)
            logger.warning("decode steps cannot be captured, running the model directly: %s", e)
            return self.model(input_ids, positions, self.kv_caches, meta)
        self.graphs[key] = graph
        return hidden
