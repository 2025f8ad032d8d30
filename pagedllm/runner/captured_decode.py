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
region instead of one region per kernel. Where that leaves no Python call
in the graph (every Llama-family model; not Gemma 3, whose embedding scale
and GELU stay Python calls), programs run any number of their rows, so the
first decode step is captured once, at the most rows and the widest
tables, and that one graph runs every later step without padding:

    graph (64 rows, 32 columns)          step: 3 sequences, tables 5 wide
      static inputs [64], [64, 32]  <-   copied into rows 0..2, columns 0..4
      programs run rows 0..2             (columns past a row's length and
                                          rows past 3 are never read)
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.attention import AttentionBackend, AttentionMetadata
from pagedllm.loader.model_config import ModelArchConfig
from pagedllm.runner.model_loader import model_tensors
from pagedllm.runner.step_graph import CaptureError, StepGraph
from pagedllm.runner.step_program import lower_to_programs, num_programs

logger = logging.getLogger(__name__)

MIN_TABLE_WIDTH = 8  # blocks: the narrowest table a graph is made for


def row_bucket(num_rows: int) -> int:
    """The rows a graph for ``num_rows`` sequences has: 1, 2, 4, 8, then the next multiple of 8."""
    if num_rows <= 8:
        return 1 << (num_rows - 1).bit_length()
    return (num_rows + 7) // 8 * 8


def owned_tensors(model: nn.Module, kv_cache: torch.Tensor) -> list[torch.Tensor]:
    """Every tensor the model holds (parameters, buffers, tensor attributes) and the KV cache."""
    return [kv_cache, *model_tensors(model)]


class CapturedDecode:
    """Decode steps of ``model`` from per-shape ``StepGraph`` records.

    Args:
        model: the model; ``model(input_ids, positions, kv_caches, meta)`` -> hidden states.
        kv_cache: the one KV tensor; ``kv_caches`` are its per-layer (K, V) views.
        max_rows: the most sequences a captured step has.
        padding_block: a KV block outside the pool, for the padding rows of a bucket.
        block_size: tokens per KV block.
        native_programs: lower each graph to native ``StepProgram`` runs (needs the native kernels).
        max_width: the most blocks a sequence's table has (``ceil(max_model_len / block_size)``).
        row_limits: row counts at which the model's layers change kernels (``LinearMethod.row_limits``):
            a graph recorded at more rows than a limit does not run steps of that many or fewer.
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
        max_rows: int, padding_block: int, block_size: int, native_programs: bool = False, max_width: int = 0,
        row_limits: tuple[int, ...] = (),
        shared: tuple[torch.Tensor, ...] = (),
    ) -> None:
        self.model = model
        self.padding_block = padding_block
        self.block_size = block_size
        self.kv_caches = kv_caches
        self.max_rows = max_rows
        self.max_width = max_width
        # the rows of the row-generic graphs: each limit below the top bucket, and the top bucket;
        # a step of n rows runs on the first tier >= n
        top = row_bucket(max_rows)
        self.row_tiers = sorted({r for r in row_limits if 0 < r < top} | {top})
        # shared: memory the step's ops read that the model does not hold (tensor parallelism's shared slots)
        self._owned = [*owned_tensors(model, kv_cache), *shared]
        self.failed: str | None = None  # why capturing was given up, once it was
        self.reset(native_programs)

    def reset(self, native_programs: bool) -> None:
        """Drop every graph; later steps are captured again, lowered to native programs or not."""
        self.native_programs = native_programs
        self.graphs: dict[tuple[int, int], StepGraph] = {}
        # whether the model's step lowers to native programs alone, so that one graph of the most rows
        # and the widest tables serves every step (None: not captured yet; False: per-shape graphs)
        self.row_generic: bool | None = None if native_programs and self.max_width > 0 else False

    def accepts(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        """Whether a step is replayed (or captured): decode tokens only, at most ``max_rows`` of them."""
        return (
            self.failed is None and meta.num_prefills == 0 and num_tokens == meta.num_seqs
            and num_tokens <= self.max_rows
        )

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states ``[num_tokens, hidden]``, as the model's forward; valid until the next step.

        Where the model's step is native programs alone (``row_generic``),
        one graph of ``row_bucket(max_rows)`` rows and ``max_width`` table
        columns runs every step (one per tier where the layers change
        kernels with the rows, ``LinearMethod.row_limits``): the step's rows and
        table columns are copied into its corner and the programs run that
        many rows, no padding. Otherwise a graph per shape: rows rounded up to a bucket
        (padding rows), tables to a power of two.
        """
        num_rows, width = input_ids.shape[0], meta.block_tables.shape[1]
        if self.row_generic is not False and width <= self.max_width:
            key = (next(t for t in self.row_tiers if t >= num_rows), self.max_width)
            graph = self.graphs.get(key)
            if graph is not None:
                inputs = [input_ids, positions, meta.slot_mapping, meta.block_tables, meta.seq_lens_tensor]
                return graph.replay(inputs, rows=num_rows)
            return self._capture(key, input_ids, positions, meta)
        key = (row_bucket(num_rows), max(MIN_TABLE_WIDTH, 1 << (width - 1).bit_length()))
        graph = self.graphs.get(key)
        if graph is not None:
            return graph.replay(self._padded_inputs(input_ids, positions, meta, *key))[:num_rows]
        return self._capture(key, input_ids, positions, meta)

    def _capture(
        self, key: tuple[int, int], input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Capture the graph for ``key`` (rows, table width) while running this step; its hidden states."""
        num_rows = input_ids.shape[0]
        inputs = self._padded_inputs(input_ids, positions, meta, *key)

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
            graph.group(functools.partial(lower_to_programs, rows=key[0]))
        if self.row_generic is not False:
            # a graph with Python calls left cannot run fewer rows: per-shape graphs from now on (a tier
            # can lower differently from the one before it: a matmul with no program node past a limit)
            self.row_generic = len(graph.runs) == 1 and num_programs(graph.runs) == 1
            if not self.row_generic:
                self.graphs.clear()
                return hidden[:num_rows]  # this one's shape is no bucket's
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
