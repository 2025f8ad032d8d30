"""Decode steps replayed from graphs of the model's own forward pass (``runner/step_graph.py``).

The first decode step of each shape runs the model as usual while a
``StepGraph`` records it; later steps of that shape replay the record: the
model's kernels back to back, without the Python around them. A shape is
the number of sequences rounded up to a bucket (1, 2, 4, 8, then multiples
of 8, as vLLM sizes its CUDA graphs) and the block-table width rounded up to
a power of two, so that a batch that shrinks as requests finish and a
context that grows are captured a few times, not at every change:

    step: 3 sequences, tables 5 blocks wide  ->  graph (4, 8)
      tables padded with block 0 to 8 columns (never read: lengths bound every read)
      one padding row: token 0 at position 0, its K/V written to and read from
      the runner's padding block (one block past the pool, never handed out)

Decode-only steps of at most ``max_rows`` sequences are captured; prefills,
mixed steps and larger batches (where the Python is a small share of the
step) run the model directly. Only models whose decode path takes nothing
from the step but its tensors may be captured (``supports``).

With ``native_programs`` (the runner's default where the native kernels are
loaded) each graph's nodes are lowered to ``StepProgram`` calls
(``runner/step_program.py``): the step's kernels run in one OpenMP parallel
region instead of one region per kernel.
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
from pagedllm.runner.step_program import lower_to_programs

logger = logging.getLogger(__name__)

MIN_TABLE_WIDTH = 8  # blocks: the narrowest table a graph is made for


def row_bucket(num_rows: int) -> int:
    """The rows a graph for ``num_rows`` sequences has: 1, 2, 4, 8, then the next multiple of 8."""
    if num_rows <= 8:
        return 1 << (num_rows - 1).bit_length()
    return (num_rows + 7) // 8 * 8


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
        padding_block: a KV block outside the pool, for the padding rows of a bucket.
        block_size: tokens per KV block.
        native_programs: lower each graph to native ``StepProgram`` runs (needs the native kernels).
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
        max_rows: int, padding_block: int, block_size: int, native_programs: bool = False,
    ) -> None:
        self.model = model
        self.native_programs = native_programs
        self.padding_block = padding_block
        self.block_size = block_size
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
        num_rows = input_ids.shape[0]
        width = max(MIN_TABLE_WIDTH, 1 << (meta.block_tables.shape[1] - 1).bit_length())
        inputs = self._padded_inputs(input_ids, positions, meta, row_bucket(num_rows), width)
        key = (inputs[0].shape[0], width)
        graph = self.graphs.get(key)
        if graph is not None:
            return graph.replay(inputs)[:num_rows]

        def step(ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, tbl: torch.Tensor,
                 lens: torch.Tensor) -> torch.Tensor:
            pad = ids.shape[0] - len(meta.seq_lens)  # padding rows: one-token sequences
            static = dataclasses.replace(
                meta, slot_mapping=slots, block_tables=tbl, seq_lens_tensor=lens,
                query_start_loc=list(range(ids.shape[0] + 1)), seq_lens=[*meta.seq_lens, *[1] * pad],
                num_computed=[*meta.num_computed, *[0] * pad],
            )
            return self.model(ids, pos, self.kv_caches, static)

        try:
            graph, hidden = StepGraph.capture(step, inputs, self._owned)
        except CaptureError as e:
            # the capture ran nothing to completion that matters: run this step (and all later ones) directly
            self.failed = str(e)
            logger.warning("decode steps cannot be captured, running the model directly: %s", e)
            return self.model(input_ids, positions, self.kv_caches, meta)
        if self.native_programs:
            graph.group(lower_to_programs)
        self.graphs[key] = graph
        return hidden[:num_rows]

    def _padded_inputs(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, rows: int, width: int
    ) -> list[torch.Tensor]:
        """The step's five inputs grown to ``rows`` sequences and ``width`` table columns.

        A padding row decodes token 0 at position 0 of a one-token sequence in the padding block.
        """
        pad = rows - input_ids.shape[0]
        tables = F.pad(meta.block_tables, (0, width - meta.block_tables.shape[1]))  # [num_seqs, width]
        if pad == 0:
            return [input_ids, positions, meta.slot_mapping, tables, meta.seq_lens_tensor]
        zeros = torch.zeros(pad, dtype=torch.int64)
        padding_tables = torch.full((pad, width), self.padding_block, dtype=torch.int64)
        return [
            torch.cat([input_ids, zeros]), torch.cat([positions, zeros]),  # [rows]
            torch.cat([meta.slot_mapping, zeros + self.padding_block * self.block_size]),
            torch.cat([tables, padding_tables]),  # [rows, width]
            torch.cat([meta.seq_lens_tensor, zeros + 1]),
        ]
