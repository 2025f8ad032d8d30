"""Decode steps run from one FX trace of the model's own forward pass (``runner/capture/decode_graph.py``).

The first decode step traces the model's forward symbolically (its rows
and block-table width are symbols; about a second) on ``DecodeMetadata``,
the step's addressing as tensors only, and lowers the trace once, at the
most rows (``max_rows``) and the widest tables (``max_width``). Every later
decode step, whatever its batch size, copies its inputs into the leading
corner of the static inputs and runs the first rows:

    graph (64 rows, 32 columns)          step: 3 sequences, tables 5 wide
      static inputs [64], [64, 32]  <-   copied into rows 0..2, columns 0..4
      programs and Python calls run      (columns past a row's length and
      rows 0..2                          rows past 3 are never read)

With ``native_programs`` (the runner's default where the native kernels are
loaded) the trace's kernels are grouped into ``StepProgram`` runs
(``runner/capture/step_program.py``): the step's kernels in one OpenMP parallel
region instead of one region per kernel; ops without a program node
(Gemma 3's embedding scale and GELU) run from Python between programs.

Decode-only steps of at most ``max_rows`` sequences are captured, once
``armed`` (at the first decode step, or when the engine sees enough decode
steps ahead to pay for the trace: ``EngineConfig.capture_min_decode_steps``); prefills,
mixed steps and larger batches (where the Python is a small share of the
step) run the model directly. Where the traced forward branched on the row
count (a linear method that changes kernels past some rows), the trace
holds for the row counts its shape guards allow, and a step outside them is
traced again (``num_traces``).

A hybrid model's state layers (``state_layers``) read the step's state
slots as one more input, after the KV cache groups' (``DecodeMetadata.state_slots``),
and their state tensors in place, as memory the graph owns; a step whose
rows do not each continue their own state (a one-token prompt from zero, a
verify step's rows of one sequence) runs the model directly.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from pagedllm.layers.attention import AttentionBackend, AttentionMetadata, DecodeMetadata
from pagedllm.layers.fused_moe import experts_capturable
from pagedllm.loader.model_config import ModelArchConfig
from pagedllm.runner.capture.decode_graph import (
    CaptureError,
    DecodeGraph,
    check_constants,
    input_symbols,
    lower,
    trace,
    valid_rows,
)
from pagedllm.runner.model_loader import model_tensors

logger = logging.getLogger(__name__)

_TRACE_ROWS = 2  # rows (and table columns) of the trace's example inputs: 0 and 1 would be traced as constants


class CapturedDecode:
    """Decode steps of ``model`` from FX traces lowered to static buffers.

    Args:
        model: the model; ``model(input_ids, positions, kv_caches, meta)`` -> hidden states.
        kv_cache: the one KV tensor; ``kv_caches`` are its per-layer (K, V) views.
        max_rows: the most sequences a captured step has.
        block_size: tokens per KV block.
        max_width: the most blocks a sequence's table has (``ceil(max_model_len / block_size)``).
        native_programs: lower each graph to native ``StepProgram`` runs (needs the native kernels).
        shared: memory the step's ops read that the model does not hold (tensor parallelism's shared slots).
    """

    @staticmethod
    def supports(backend: AttentionBackend, model_config: ModelArchConfig, model: nn.Module | None = None) -> bool:
        """Whether a decode step reads the step through tensors only: ``cpu_paged`` without score softcaps, and
        a mixture of experts only where ``model``'s experts are all GGUF blocks of one type per layer.

        A hybrid model's state layers read a decode step's state slots as a
        tensor (``DecodeMetadata.state_slots``, docs/hybrid-models.md), so
        they are captured too.

        ``cpu_paged`` decodes (windowed or not) take block tables and lengths
        as tensors; the SDPA decode path sizes its gather from the Python
        lengths, which a trace would freeze. A mixture of experts groups the
        step's tokens by the experts their router chose: the grouped GGUF op
        takes that grouping as tensors (``layers/fused_moe.py``), the
        per-expert loop of the other formats reads it into Python
        (``layers/experts_linear.py``), so those models decode eagerly.
        """
        if backend.name != "cpu_paged" or model_config.attn_logit_softcapping is not None:
            return False
        return not model_config.num_experts or (model is not None and experts_capturable(model))

    def __init__(
        self, model: nn.Module, kv_cache: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        max_rows: int, block_size: int, max_width: int, native_programs: bool = False,
        shared: tuple[torch.Tensor, ...] = (), armed: bool = True, layer_groups: tuple[int, ...] = (),
        state_layers: bool = False,
    ) -> None:
        # KV cache groups (kv_groups.py): each group's slots and tables are inputs of their own
        self.layer_groups = layer_groups
        self.num_groups = max(layer_groups, default=0) + 1
        self.model = model
        self.kv_caches = kv_caches
        self.max_rows = max_rows
        self.block_size = block_size
        self.max_width = max_width
        # a hybrid model's state slots are one more input of the graph (after the KV cache groups'); its state
        # tensors, which ``kv_caches`` holds in its state layers' places, are memory the graph owns
        self.state_layers = state_layers
        states = [t for entry in kv_caches for t in entry] if state_layers else []
        self._owned = [kv_cache, *states, *model_tensors(model), *shared]
        self.failed: str | None = None  # why capturing was given up, once it was
        self.num_traces = 0
        # False: decode steps run the model directly until ``warm_up`` (the engine calls it once a trace
        # pays for itself: EngineConfig.capture_min_decode_steps)
        self.armed = armed
        self.reset(native_programs)

    def reset(self, native_programs: bool) -> None:
        """Drop every graph; later steps are traced again, lowered to native programs or not."""
        self.native_programs = native_programs
        # (fewest, most rows) -> the graph that runs steps of that many rows
        self.graphs: dict[tuple[int, int], DecodeGraph] = {}

    def accepts(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        """Whether a step is replayed (or captured): decode tokens only, at most ``max_rows`` of them."""
        return (
            self.armed and self.failed is None and meta.num_prefills == 0 and num_tokens == meta.num_seqs
            and num_tokens <= self.max_rows and meta.block_tables.shape[1] <= self.max_width
            and (not self.state_layers or self._continues_states(meta, num_tokens))
        )

    @staticmethod
    def _continues_states(meta: AttentionMetadata, num_tokens: int) -> bool:
        """Whether every row of a hybrid model's step continues its own state slot: a step with a one-token
        prompt (its state starts at zero) or a verify step's rows (``as_decode_rows``: one slot, several
        tokens, which the recurrence takes in turn) runs the model directly."""
        slots, initial = meta.state_slots, meta.has_initial_state
        return (slots is not None and slots.shape[0] == num_tokens
                and (initial is None or bool(initial.all())))

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states ``[num_tokens, hidden]``, as the model's forward; valid until the next step."""
        rows = input_ids.shape[0]
        graph = next((g for (lo, hi), g in self.graphs.items() if lo <= rows <= hi), None)
        if graph is None:
            try:
                graph = self._capture(rows)
            except CaptureError as e:
                # nothing ran: this step (and all later ones) run the model directly
                self.failed = str(e)
                logger.warning("decode steps cannot be captured, running the model directly: %s", e)
                return self.model(input_ids, positions, self.kv_caches, meta)
        inputs = [input_ids, positions, meta.slot_mapping, meta.block_tables, meta.seq_lens_tensor]
        if meta.group_metas is not None:
            for group in meta.group_metas[1:]:
                inputs += [group.slot_mapping, group.block_tables]
        if self.state_layers:
            inputs.append(meta.state_slots)
        return graph.replay(inputs, rows)

    def warm_up(self) -> None:
        """Trace and lower the decode step now, before any request waits on it (a server does this at start,
        as vLLM captures its CUDA graphs); a model that cannot be captured runs eagerly from the start."""
        self.armed = True
        if self.graphs or self.failed is not None:
            return
        try:
            self._capture(1)
        except CaptureError as e:
            self.failed = str(e)
            logger.warning("decode steps cannot be captured, running the model directly: %s", e)

    def _capture(self, rows: int) -> DecodeGraph:
        """Trace the decode step, lower it at the most rows its guards allow, and keep it; CaptureError if not."""
        n = max(rows, _TRACE_ROWS)
        # a width unlike the rows: make_fx gives input sizes that are equal one symbol
        w = max(self.max_width, _TRACE_ROWS) + (1 if max(self.max_width, _TRACE_ROWS) == n else 0)
        zeros = torch.zeros(n, dtype=torch.int64)  # [n]
        example = [zeros, zeros.clone(), zeros.clone(), torch.zeros(n, w, dtype=torch.int64), zeros + 1]
        for _ in range(self.num_groups - 1):  # each further KV cache group's slots and tables
            example += [zeros.clone(), torch.zeros(n, w, dtype=torch.int64)]
        if self.state_layers:  # the state slots, distinct (as a step's are)
            example.append(torch.arange(n, dtype=torch.int64))
        model, kv_caches, block_size, layer_groups = self.model, self.kv_caches, self.block_size, self.layer_groups
        state_layers = self.state_layers

        def step(*inputs: torch.Tensor) -> torch.Tensor:  # a plain function: make_fx counts a method's self
            ids, pos, slots, tables, lens, *extra = inputs
            state_slots = extra.pop() if state_layers else None
            meta = DecodeMetadata(slots, tables, lens, block_size, state_slots=state_slots)
            if extra:
                groups = [meta, *(DecodeMetadata(extra[i], extra[i + 1], lens, block_size, state_slots=state_slots)
                                  for i in range(0, len(extra), 2))]
                meta = DecodeMetadata(slots, tables, lens, block_size, tuple(groups), layer_groups, state_slots)
            return model(ids, pos, kv_caches, meta)

        gm = trace(step, example)
        self.num_traces += 1
        check_constants(gm, self._owned)
        dims = input_symbols(gm)
        if len(dims) != 3 + 2 * self.num_groups + self.state_layers or isinstance(dims[0][0], int) or any(d[0] != dims[0][0] for d in dims):
            raise CaptureError("the trace fixed the step's row count")
        row_symbol = dims[0][0]
        width = dims[3][1]
        bindings = {} if isinstance(width, int) else {width: self.max_width}
        valid = valid_rows(gm, row_symbol, bindings, self.max_rows)
        if rows not in valid:
            raise CaptureError(f"the trace does not hold for a step of {rows} rows")
        lo = hi = rows
        while lo - 1 in valid:
            lo -= 1
        while hi + 1 in valid:
            hi += 1
        inputs = [torch.zeros(hi, dtype=torch.int64) for _ in range(3)]  # [hi]: ids, positions, slots
        tables = torch.zeros(hi, self.max_width, dtype=torch.int64)  # [hi, max_width]
        inputs += [tables, torch.ones(hi, dtype=torch.int64)]
        for _ in range(self.num_groups - 1):
            inputs += [torch.zeros(hi, dtype=torch.int64), torch.zeros(hi, self.max_width, dtype=torch.int64)]
        if self.state_layers:
            inputs.append(torch.arange(hi, dtype=torch.int64))  # [hi]: the state slots
        graph = lower(gm, inputs, row_symbol, {**bindings, row_symbol: hi}, list(range(lo, hi + 1)),
                      self.native_programs)
        self.graphs[(lo, hi)] = graph
        return graph
