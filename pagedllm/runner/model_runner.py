"""Owns the model and the KV cache; turns a ``StepRecord`` into sampled tokens."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from pagedllm.c_heap import keep_freed_heap, trim_heap
from pagedllm.config import EngineConfig
from pagedllm.device_memory import available_memory_bytes
from pagedllm.distributed.group import DistributedError, TensorParallelGroup
from pagedllm.kv_groups import model_kv_layout
from pagedllm.layers.attention import AttentionMetadata, make_backend
from pagedllm.layers.gated_deltanet import GatedRMSNorm
from pagedllm.layers.kv_quant import indexable, kv_format_name
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.parallel import ParallelRMSNorm
from pagedllm.layers.quantization.gguf_linear import gguf_types_held
from pagedllm.loader.model_config import ModelArchConfig
from pagedllm.loader.tokenizer import Tokenizer
from pagedllm.resolved_config import (
    KvPoolPlan,
    kv_pool_blocks,
    plan_kv_pool,
    resolve_config,
    resolve_kv_cache_dtype,
)
from pagedllm.runner.capture.captured_decode import CapturedDecode
from pagedllm.runner.draft_verifier import verify_drafts
from pagedllm.runner.expert_load import ExpertLoad
from pagedllm.runner.input_batch import InputBatch, as_decode_rows
from pagedllm.runner.kv_block_bytes import read_block_bytes, write_block_bytes
from pagedllm.runner.kv_cache import (
    allocate_kv_cache,
    kv_bytes_per_block,
    release_kv_blocks,
    resident_kv_bytes,
)
from pagedllm.runner.kv_calibration import calibrate_kv_transforms, calibration_text
from pagedllm.runner.logits_processors import apply_logits_rules, apply_token_bitmasks
from pagedllm.runner.model_loader import DTYPES, load_model, resolve_precision
from pagedllm.runner.pooled_rows import pooled_shares
from pagedllm.runner.prompt_scoring import ScoredPrompt, score_prompt_rows
from pagedllm.runner.sampler import (
    Sampler,
    SamplingTensors,
    logit_stats,
    token_logprobs,
)
from pagedllm.runner.sequence_states import SequenceStates
from pagedllm.runner.state_cache import (
    STATE_DTYPE,
    allocate_state_cache,
    copy_state_slots,
    layer_state_shapes,
    plan_state_slots,
    state_bytes_per_slot,
)
from pagedllm.runner.state_slot_bytes import read_state_bytes, write_state_bytes
from pagedllm.step_record import NoTokenToSampleError, SamplingSpec, SequenceStep, StepRecord
from pagedllm.step_result import StepResult, TokenLogprobs

logger = logging.getLogger(__name__)
# what each kv_cache_dtype stores: a float dtype, or int8 / fp8 values or int4 nibbles (uint8) with their
# scales (layers/kv_quant.py)
KV_DTYPES = {
    **DTYPES,
    "int8": torch.int8,
    "int4": torch.uint8,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


# the most sequences a captured decode step has: past that the Python between kernels is a small share of a step
MAX_CAPTURED_ROWS = 64

class ModelRunner:
    """Owns the model and the KV cache; runs steps.

    Loading is ``runner/model_loader.py``'s, sizing and allocating the cache
    ``runner/kv_cache.py``'s; ``num_kv_blocks`` is decided there and read by
    the engine. Process-wide settings (thread counts) are the engine's, set
    before the runner is built (``runner/process_settings.py``).

    With ``tp`` (tensor parallelism, ``pagedllm/distributed/``) this runner
    holds one rank's slice of the model and its share of every KV block (its
    KV heads); all ranks hold the same number of blocks. Rank 0's
    ``execute`` sends each record to the other ranks, whose runners compute
    the same step in ``serve_steps`` and hand their logits to rank 0, which
    samples alone.
    """

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelArchConfig,
        weights: Iterable[tuple[str, torch.Tensor]],
        tp: TensorParallelGroup | None = None,
    ) -> None:
        self.config = config
        self.model_config = model_config
        self.tp = tp if tp is not None and tp.size > 1 else None
        # the shape this process holds: a rank's heads and intermediate rows under tensor parallelism
        self.local_config = self.tp.plan.local_config(model_config) if self.tp is not None else model_config
        # one GPU per tensor-parallel rank
        self.device = torch.device("cuda", self.tp.rank) if self.tp and config.device == "cuda" else torch.device(config.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but torch sees no CUDA device")
        precision = resolve_precision(config, self.device)
        self.dtype, self.compute_dtype = precision.weights, precision.compute
        # every choice "auto" left open, taken once (resolved_config.py); batch_invariant's refusals there too
        self.resolved = resolve_config(config)
        self.backend = make_backend(self.resolved.attention_backend, self.device.type, self.compute_dtype,
                                    batch_invariant=self.resolved.batch_invariant)

        # measured before loading: the default KV budget is what the weights leave of it
        available = available_memory_bytes(self.device)
        if self.tp is not None and hasattr(weights, "untile_out_proj"):
            weights.untile_out_proj()  # a rank's value heads: one run of grouped columns (local_config)
        loaded = load_model(config, self.local_config, weights, self.backend, self.device, self.tp)
        self.model = loaded.model
        self.linear_backend = loaded.linear_backend
        self.native_ops = loaded.native_ops
        self.num_params = loaded.num_params  # the whole model's, once tensor-parallel ranks have told theirs
        self.load_seconds = loaded.load_seconds
        self.weight_bytes = loaded.weight_bytes
        self.weight_format = loaded.weight_format
        # a hybrid model's state layers and what one sequence's state takes (runner/state_cache.py)
        self.state_shapes = layer_state_shapes(self.model, self.local_config) if model_config.has_state_layers else []
        self.state_bytes_per_slot = state_bytes_per_slot(self.state_shapes)
        self.state_dtype = STATE_DTYPE  # what the state tensors hold (the disk store's fingerprint names it)
        self.num_state_slots = 0  # sized with the KV pool (_plan_kv_pool)
        self.num_snapshot_slots = 0  # state snapshots of cached prefixes, after the running slots
        self.num_checkpoint_slots = 0  # speculative decoding's state checkpoints, after the snapshots
        if not self.state_shapes and config.state_snapshot_interval is not None:
            raise ValueError("state_snapshot_interval places a hybrid model's state snapshots; this model has no "
                             "state layers: leave it unset")

        # what the cache stores; "auto" resolved once the weights' format is known
        self.kv_cache_dtype = KV_DTYPES[resolve_kv_cache_dtype(config.kv_cache_dtype, config.dtype,
                                                               keeps_gguf_blocks=bool(gguf_types_held(self.model)))]
        self.block_size = config.block_size
        # KV cache groups (kv_groups.py): each holds a block table per sequence, so the pool's size counts them
        self.kv_layout = model_kv_layout(model_config)
        # the pool's size, and max_model_len lowered to it where fit_max_model_len allows (resolved_config.py)
        self.kv_pool = self._plan_kv_pool(available)
        self.num_kv_blocks = self.kv_pool.num_kv_blocks
        if self.kv_pool.lowered:  # everything after this reads the length the pool holds
            self.config = dataclasses.replace(self.config, max_model_len=self.kv_pool.max_model_len)
        config = self.config  # max_num_seqs too may be lowered to the state slots (_plan_state_slots)
        self.kv_cache, self.kv_caches = allocate_kv_cache(
            self.local_config, self.num_kv_blocks, self.block_size, self.kv_cache_dtype, self.device
        )
        # a state layer's entry is its state tensors, in the place an attention layer's (K, V) is
        self.state_caches = allocate_state_cache(
            self.state_shapes, self.num_state_slots + self.num_snapshot_slots + self.num_checkpoint_slots, self.device
        )
        for i, states in enumerate(self.state_caches):
            if states is not None:
                self.kv_caches[i] = states
        self.kv_cache_bytes = self.kv_cache.numel() * self.kv_cache.element_size()  # reserved, resident as written
        self.kv_bytes_released = 0  # pages given back to the OS so far (release_kv_blocks)
        # (weight bytes, KV cache bytes) each rank holds, by rank: measured there, gathered here
        self.rank_bytes: list[list[int]] = [[self.weight_bytes, self.kv_cache_bytes]]
        if self.tp is not None:
            self._gather_rank_figures()
        if self.kv_cache_dtype == torch.uint8:  # int4: fit each layer's change of variables first
            self._calibrate_kv_transforms()
        logger.info(
            "resident: weights %.1f MiB (%s, %s linears), KV cache %.1f MiB (%d blocks of %d tokens, %s)",
            self.weight_bytes / 2**20, self.weight_format, self.linear_backend,
            self.kv_cache_bytes / 2**20, self.num_kv_blocks, self.block_size,
            kv_format_name(self.kv_cache_dtype),
        )
        self.sampler = Sampler()
        # a longrope model's tokens look up the short or the long rows of its RoPE table (layers/rotary.py)
        # KV cache groups (kv_groups.py): sliding-window layers read their group's block tables
        layer_groups = tuple(self.kv_layout.layer_slot(i)[0] if self.kv_layout.has_layer(i) else 0
                             for i in range(model_config.num_hidden_layers))
        self.input_batch = InputBatch(self.block_size, self.device, self.model.model.rotary.switch_len,
                                      layer_groups if self.kv_layout.num_groups > 1 else ())
        # every sequence's tokens, block table and sampling settings, kept from the incremental records
        self.sequence_states = SequenceStates()
        # decode steps run from an FX trace of the model's own forward (runner/capture/captured_decode.py),
        # its kernels in one parallel region per program where the native ops are loaded
        # (runner/capture/step_program.py)
        self.captured_decode = self._make_captured_decode(config, model_config)
        # a mixture of experts' routing counts, from zero now that loading and calibration are done (read by
        # /metrics and bench when they ask: runner/expert_load.py); None for a dense model
        self.expert_load = ExpertLoad(self.model) if model_config.num_experts else None
        if self.device.type == "cpu":  # steps' activations reused from the C heap, not faulted in anew (c_heap.py)
            trim_heap()  # loading's freed temporaries go back first
            keep_freed_heap()

    def _plan_kv_pool(self, available: int) -> KvPoolPlan:
        """The pool's blocks (the fewest any tensor-parallel rank has room for) and the ``max_model_len``
        they hold; logs both, and warns where max_model_len was lowered to fit."""
        per_block = kv_bytes_per_block(self.local_config, self.block_size, self.kv_cache_dtype)
        num_blocks, budget = kv_pool_blocks(self.config, per_block, available, self.weight_bytes,
                                            lazy=self.device.type == "cpu",
                                            num_groups=self.kv_layout.num_groups)
        if self.tp is not None:  # one block table addresses every rank's cache: all hold as many blocks
            num_blocks = self.tp.min_int(num_blocks)
        if self.state_bytes_per_slot:
            num_blocks = self._plan_state_slots(num_blocks, budget, per_block)
            if self.tp is not None:  # each rank's states are its heads' (state_bytes_per_slot): blocks again
                num_blocks = self.tp.min_int(num_blocks)
        plan = plan_kv_pool(self.config, num_blocks, budget, per_block)
        if self.tp is not None and self.tp.rank != 0:
            return plan
        pool = f"{num_blocks} blocks of {self.block_size} tokens, {num_blocks * per_block / 2**30:.2f} GiB reserved"
        if budget is None:
            source = "num_kv_blocks"
        elif self.config.kv_cache_memory_bytes is not None:
            source = "kv_cache_memory_bytes"
        else:
            source = (f"default: a share of the {max(0, available - self.weight_bytes) / 2**30:.2f} GiB free "
                      "after the weights")
        if plan.lowered:
            logger.warning(
                "max_model_len lowered from %d to %d tokens to fit the KV cache (%s; %s): one sequence of %d "
                "tokens needs %.2f GiB. Pass --max-model-len (max_model_len=) to choose the length, or "
                "--kv-cache-memory-bytes (kv_cache_memory_bytes=) for a larger pool",
                plan.requested_max_model_len, plan.max_model_len, pool, source, plan.requested_max_model_len,
                -(-plan.requested_max_model_len // self.block_size) * per_block / 2**30,
            )
        logger.info("KV pool: %s (%s); max_model_len %d", pool, source, plan.max_model_len)
        return plan

    def _plan_state_slots(self, num_blocks: int, budget: int | None, per_block: int) -> int:
        """Size the state slots (``num_state_slots``) out of the KV budget; the blocks the rest holds.

        One slot per sequence ``max_num_seqs`` lets run; where fewer fit in half of a known budget,
        max_num_seqs is lowered to them (a running sequence always has its slot, a fork never waits for one).
        With prefix caching as many again hold state snapshots of cached prefixes (engine/state_snapshots.py);
        with speculative decoding as many again hold the checkpoints a verify step's rejected drafts roll back to.
        """
        snapshots = self.config.prefix_caching
        checkpoints = self.config.speculative_config is not None
        copies = 1 + int(snapshots) + int(checkpoints)
        slots = plan_state_slots(self.config.max_num_seqs, copies * self.state_bytes_per_slot, budget)
        if self.tp is not None:  # the driver's block manager hands out slots every rank holds
            slots = self.tp.min_int(slots)
        if slots < self.config.max_num_seqs:
            logger.warning("max_num_seqs lowered from %d to %d: the KV budget holds %d state slots of %.2f MiB",
                           self.config.max_num_seqs, slots, slots, self.state_bytes_per_slot / 2**20)
            self.config = dataclasses.replace(self.config, max_num_seqs=slots)
        self.num_state_slots = slots
        self.num_snapshot_slots = slots if snapshots else 0
        self.num_checkpoint_slots = slots if checkpoints else 0
        state_bytes = copies * slots * self.state_bytes_per_slot
        if budget is not None:
            num_blocks = max(1, min(num_blocks, (budget - state_bytes) // per_block))
        logger.info("state slots: %d running + %d snapshots + %d checkpoints of %.3f MiB (%d state layers), %.2f MiB "
                    "reserved beside the KV pool", slots, self.num_snapshot_slots, self.num_checkpoint_slots,
                    self.state_bytes_per_slot / 2**20,
                    sum(1 for s in self.state_shapes if s is not None), state_bytes / 2**20)
        return num_blocks

    def _make_captured_decode(self, config: EngineConfig, model_config: ModelArchConfig) -> CapturedDecode | None:
        """The captured decode where the backend reads a step through tensors and this process can replay the
        step's collectives; None otherwise (every step runs the model directly)."""
        # under tensor parallelism only with the shared-memory all-reduce, a native op a graph replays; every
        # rank traces and replays the same steps, so their collectives stay in step (gloo's are not ops)
        shm = self.tp.shm if self.tp is not None else None
        capturable = self.tp is None or shm is not None
        if config.enforce_eager or not capturable or not CapturedDecode.supports(self.backend, model_config, self.model):
            return None
        # a verify step's tokens are rows of a captured step too: its last token and up to k drafts
        spec = config.speculative_config
        rows_per_seq = 1 + (spec.num_speculative_tokens if spec is not None else 0)
        return CapturedDecode(
            self.model, self.kv_cache, self.kv_caches, min(config.max_num_seqs * rows_per_seq, MAX_CAPTURED_ROWS),
            self.block_size, -(-config.max_model_len // self.block_size),
            native_programs=self.native_ops is not None,
            layer_groups=self.input_batch.layer_groups,
            shared=(shm.slots, shm.flags, shm.pids) if shm is not None else (),
            # tensor-parallel ranks all trace at the first decode step, so none waits in a collective
            armed=config.capture_min_decode_steps == 0 or self.tp is not None,
            state_layers=bool(self.state_shapes),
        )

    def _calibrate_kv_transforms(self) -> None:
        """Fit every layer's ``KvTransform`` from the calibration prompt (``runner/kv_calibration.py``)."""
        tokenizer = Tokenizer(self.config.tokenizer or self.config.model, self.model_config.eos_token_ids)
        ids = tokenizer.encode(calibration_text(), add_special_tokens=False)
        room = min(self.num_kv_blocks * self.block_size, self.config.max_model_len)
        # a hybrid model's state layers run the prompt too, in the first running slot: no sequence holds it yet
        scratch = 0 if self.state_shapes else None
        seen = calibrate_kv_transforms(self.model, self.kv_caches, self.kv_cache, ids, self.block_size, room, scratch)
        logger.info("int4 KV cache: K/V transforms fitted on %d calibration tokens", seen)

    def _gather_rank_figures(self) -> None:
        """Every tensor-parallel rank's bytes held (``rank_bytes``), and the whole model's parameter count
        (the norms every rank holds a copy of counted once)."""
        # OLMo 2's q/k norms are split over the ranks (ParallelRMSNorm), not copied: counted by every rank's share;
        # a Gated DeltaNet's per-head gated norm is copied
        norm_params = sum(p.numel() for m in self.model.modules()
                          if isinstance(m, (RMSNorm, GatedRMSNorm)) and not isinstance(m, ParallelRMSNorm)
                          for p in m.parameters())
        gathered = self.tp.all_gather_ints([self.weight_bytes, self.kv_cache_bytes, self.num_params])
        self.rank_bytes = [[w, kv] for w, kv, _ in gathered]
        self.num_params = sum(n for _, _, n in gathered) - (self.tp.size - 1) * norm_params
        logger.info("tensor parallel over %d ranks: weights %s MiB, KV cache %s MiB by rank", self.tp.size,
                    "/".join(f"{w / 2**20:.1f}" for w, _ in self.rank_bytes),
                    "/".join(f"{k / 2**20:.1f}" for _, k in self.rank_bytes))

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes one KV block takes in this process across all layers, K and V (a rank's share under TP)."""
        return kv_bytes_per_block(self.local_config, self.block_size, self.kv_cache_dtype)

    # --- one step ------------------------------------------------------------
    def prepare(self, steps: list[SequenceStep]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Build input ids, positions and attention metadata on the CPU (``runner/input_batch.py``).

        Sequences with more than one new token (prefills) go first, as the
        attention backends expect. The tensors are valid until the next call.
        """
        return self.input_batch.build(steps)

    def _sampling_tensors(self, specs: list[SamplingSpec], uniforms: list[float]) -> SamplingTensors:
        vocab = self.model_config.vocab_size
        return SamplingTensors(
            temperatures=torch.tensor([p.temperature for p in specs], dtype=torch.float32),
            top_ks=torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in specs], dtype=torch.int64),
            top_ps=torch.tensor([p.top_p for p in specs], dtype=torch.float32),
            min_ps=torch.tensor([p.min_p for p in specs], dtype=torch.float32),
            uniforms=torch.tensor(uniforms, dtype=torch.float64),
            any_random=any(p.temperature > 0 for p in specs),
        )

    def _sample(
        self, logits: torch.Tensor, specs: list[SamplingSpec], uniforms: list[float], history: _RowHistory
    ) -> list[TokenLogprobs]:
        """Sample one token per row of ``logits`` ``[len(specs), vocab]`` and score it.

        The rows' logits processors (``runner/logits_processors.py``) change
        what is sampled; logprobs stay those of the raw model distribution
        (vLLM's default ``raw_logprobs``), so ``stats`` come from the raw logits.
        """
        stats = logit_stats(logits)
        processed = apply_logits_rules(logits, [p.rules for p in specs], history.prompts, history.outputs)
        if processed is None:
            sample_from, argmax = logits, stats.argmax
        else:
            # the precomputed argmax is stale for the rows the processors changed
            sample_from, changed = processed
            argmax = stats.argmax.clone()
            argmax[changed] = sample_from[changed].argmax(dim=-1)
        # a row with nothing left to sample (its settings exclude every token, e.g. a choice shorter than
        # min_tokens) ends rather than sampling a banned token; the greedy token is -inf only then
        best = sample_from.gather(1, argmax.unsqueeze(1)).squeeze(1)  # [R]
        if bool(torch.isneginf(best).any()):
            raise NoTokenToSampleError()
        tokens = self.sampler(sample_from, self._sampling_tensors(specs, uniforms), argmax=argmax)
        return token_logprobs(logits, tokens, [p.num_top_logprobs for p in specs], lse=stats.lse)

    def copy_blocks(self, copies: Iterable[tuple[int, int]]) -> None:
        """Copy-on-write: copy K and V of every layer from source to destination blocks, in one op."""
        copies = list(copies)
        if not copies:
            return
        src = torch.tensor([c[0] for c in copies], dtype=torch.int64, device=self.device)
        dst = torch.tensor([c[1] for c in copies], dtype=torch.int64, device=self.device)
        # kv_cache: [2, num_layers, num_kv_blocks, ...]; blocks are dim 2 (an fp8 cache copied as bytes)
        cache = indexable(self.kv_cache)
        cache.index_copy_(2, dst, cache.index_select(2, src))

    def warm_up(self) -> None:
        """Capture the decode step now rather than at the first decode (seconds on a 30-layer model).

        Not under tensor parallelism: there every rank captures at the same first decode step, so that
        none waits in a collective while another traces.
        """
        if self.captured_decode is not None and self.tp is None:
            self.captured_decode.warm_up()

    @property
    def capture_waits(self) -> bool:
        """Whether decode steps run the modules until ``warm_up`` is called (the engine's choice)."""
        cd = self.captured_decode
        return cd is not None and not getattr(cd, "armed", True) and cd.failed is None and self.tp is None

    @property
    def num_decode_traces(self) -> int:
        """Decode-step traces made so far (a step that made one took seconds longer than a step)."""
        # getattr: tests swap in wrappers of the captured decode that do not count
        return getattr(self.captured_decode, "num_traces", 0)

    @property
    def kv_resident_bytes(self) -> int:
        """Bytes of this process's KV cache the OS holds in memory now (the pool is reserved, not resident)."""
        return resident_kv_bytes(self.kv_cache)

    def read_blocks(self, block_ids: list[int]) -> list[bytes]:
        """The bytes of each block's K/V in every layer (``runner/kv_block_bytes.py``), copied out of the pool."""
        return read_block_bytes(self.kv_cache, block_ids)

    def read_state_slots(self, slots: list[int]) -> list[bytes]:
        """A hybrid model's state of each slot in every state layer (``runner/state_slot_bytes.py``), copied out."""
        return read_state_bytes(self.state_caches, slots)

    @torch.inference_mode()
    def execute(self, record: StepRecord) -> list[StepResult]:
        """Run one step from its record (``pagedllm/step_record.py``), after folding it into the sequence
        states it is incremental to (``runner/sequence_states.py``).

        Returns one ``StepResult`` per ``record.sequences`` entry, in that
        order: a sampled token for the sequence and each of its forks when
        the step reaches its last token, and prompt logprobs when asked for.
        A tensor-parallel rank other than 0 returns ``[]``: it computes the
        step and hands its logits to rank 0.
        """
        if self.tp is not None and self.tp.is_driver:
            self.tp.broadcast_record(record)
        if record.release_blocks:  # the engine has gone idle: its pages, and the allocator's free memory
            self.kv_bytes_released += release_kv_blocks(self.kv_cache, list(record.release_blocks))
            trim_heap()
        # first, before anything that may fail: the engine counts on the runner holding what it sent
        try:
            full = self.sequence_states.apply(record)
        except ValueError as e:
            if self.tp is None:
                raise
            # every rank fails alike, and a worker's serve_steps ends: the ranks stop
            raise DistributedError(f"tensor-parallel rank {self.tp.rank} could not apply a step record: {e}") from e
        # blocks read back from the prefix cache on disk, before anything reads them
        write_block_bytes(self.kv_cache, list(record.blocks_to_load))
        write_state_bytes(self.state_caches, list(record.states_to_load))  # a hybrid model's, from disk too
        if not full:
            return []
        self.copy_blocks(record.blocks_to_copy)
        copy_state_slots(self.state_caches, list(record.state_copies_before))
        order = sorted(range(len(full)), key=lambda i: full[i].num_new_tokens == 1)
        steps = [full[i] for i in order]
        rows, logits, hidden = self._logits(steps)
        # forks whose parent's prompt completed in this step take the state it computed
        copy_state_slots(self.state_caches, list(record.state_copies_after))
        scored = self._score_prompts(steps, rows, hidden)
        pooled = self._pooled(steps, hidden)
        if self.tp is not None and not self.tp.is_driver:
            return []
        logits = logits.cpu() if logits is not None else None
        results = [StepResult() for _ in steps]
        if rows.num_sampled:
            self._sample_step(logits[: rows.num_sampled], steps, results)
        for i, (start, stop) in rows.verify_rows.items():
            self._verify_step(logits[start:stop], steps[i], results[i])
        for i, one in scored.items():
            if results[i].error is None and one.error is None:
                results[i].prompt_logprobs = one.logprobs
            elif results[i].error is None:
                results[i].error = one.error  # this sequence's alone: the others keep theirs
            results[i].prompt_logprobs_start = steps[i].num_computed_tokens + 1
        for i, share in pooled.items():  # a pooling prefill: no sample, its pooled hidden states (or logits)
            results[i].pooled = share
            results[i].pooled_start = steps[i].num_computed_tokens
        unordered: list[StepResult] = [StepResult()] * len(steps)
        for i, r in zip(order, results):
            unordered[i] = r
        return unordered

    def _logits(self, steps: list[SequenceStep]) -> tuple[_LogitRows, torch.Tensor | None, torch.Tensor]:
        """The model over the step, then one LM-head call for every row that samples (the sampled rows,
        then the verify rows); None when no row does, or on a tensor-parallel rank but 0. The final hidden
        states come along for the prompt-logprob rows (``_score_prompts``).

        Under tensor parallelism a failure here leaves the ranks out of step (one may have passed a
        collective another has not reached): it is a DistributedError, whatever raised it.
        """
        try:
            input_ids, positions, meta = self.prepare(steps)
            hidden = self._forward(steps, input_ids, positions, self.input_batch.rope_rows(steps, positions), meta)
            rows = _LogitRows.of(steps, meta)
            index = torch.tensor(rows.hidden_rows, dtype=torch.int64, device=self.device)
            logits = self.model.compute_logits(hidden[index]) if rows.hidden_rows else None  # [rows, vocab]
        except Exception as e:
            if self.tp is None or isinstance(e, DistributedError):
                raise
            raise DistributedError(f"tensor-parallel rank {self.tp.rank} failed in a step: {e}") from e
        return rows, logits, hidden

    def _pooled(self, steps: list[SequenceStep], hidden: torch.Tensor) -> dict[int, list[float] | None]:
        """Each pooling step entry's share (``runner/pooled_rows.py``); a reranker's LM-head rows run on
        every tensor-parallel rank, as the prompt-logprob rows do."""
        if not any(s.pooling is not None for s in steps):
            return {}
        try:
            return pooled_shares(hidden, steps, self.model.compute_logits)
        except Exception as e:
            if self.tp is None or isinstance(e, DistributedError):
                raise
            raise DistributedError(f"tensor-parallel rank {self.tp.rank} failed in a step: {e}") from e

    def _score_prompts(
        self, steps: list[SequenceStep], rows: _LogitRows, hidden: torch.Tensor
    ) -> dict[int, ScoredPrompt]:
        """Each prompt-logprobs step entry's scored tokens, a few rows of logits at a time
        (``runner/prompt_scoring.py``); every tensor-parallel rank runs the same LM-head passes."""
        scored: dict[int, ScoredPrompt] = {}
        try:
            for i, (start, stop) in rows.prompt_rows.items():
                s = steps[i]
                scored[i] = score_prompt_rows(self.model.compute_logits, hidden[start:stop], s.prompt_targets,
                                              s.prompt_logprobs)
        except Exception as e:
            if self.tp is None or isinstance(e, DistributedError):
                raise
            raise DistributedError(f"tensor-parallel rank {self.tp.rank} failed in a step: {e}") from e
        return scored

    def _forward(
        self, steps: list[SequenceStep], input_ids: torch.Tensor, positions: torch.Tensor, rope_rows: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Final hidden states ``[num_tokens, hidden]``: replayed from the captured decode where the step is
        decodes and verify steps only (each verify token a decode row: ``as_decode_rows``), else the model's
        forward. Every token gets the same bits either way (the decode kernel is the prompt kernel's order).
        The model reads ``rope_rows`` (``InputBatch.rope_rows``) where it reads positions: its RoPE lookup."""
        cd = self.captured_decode
        if cd is not None:
            if cd.accepts(meta, input_ids.shape[0]):
                return cd(input_ids, rope_rows, meta)
            if meta.num_prefills and all(s.num_new_tokens == 1 or s.num_draft_tokens for s in steps):
                rows = as_decode_rows(meta, positions)
                if cd.accepts(rows, input_ids.shape[0]):
                    return cd(input_ids, rope_rows, rows)
        return self.model(input_ids, rope_rows, self.kv_caches, meta)

    @torch.inference_mode()
    def serve_steps(self) -> None:
        """A tensor-parallel worker's loop: run every record rank 0 sends, until it sends None (shutdown)."""
        if self.tp is None or self.tp.is_driver:
            raise ValueError("serve_steps runs on tensor-parallel ranks other than 0")
        while (record := self.tp.broadcast_record()) is not None:
            self.execute(record)

    def _verify_step(self, logits: torch.Tensor, step: SequenceStep, result: StepResult) -> None:
        """A verify step's emitted tokens (accepted drafts, then one sampled) into ``result.samples``.

        ``logits`` ``[k + 1, vocab]``: one row per new token (``runner/draft_verifier.py``).
        Logprobs are the raw model's at each emitted position, as for plain samples.
        """
        k = step.num_draft_tokens
        try:
            emitted = verify_drafts(self._verify_sample_from(logits, step), list(step.token_ids[-k:]),
                                    step.sampling, step.uniforms)
            tokens = torch.tensor(emitted, dtype=torch.int64)
            rows = logits[: len(emitted)]
            # the logsumexp of logit_stats, as a plain sample's logprob has (torch's differs in the last bits)
            result.samples = token_logprobs(
                rows, tokens, [step.sampling.num_top_logprobs] * len(emitted), lse=logit_stats(rows).lse
            )
        except NoTokenToSampleError as e:  # its own settings: it ends (the engine's _end_without_token)
            logger.info("sequence %s has no token left to sample", step.request_id)
            result.error = e
        except Exception as e:  # this sequence's alone
            logger.exception("sequence %s failed while verifying drafts", step.request_id)
            result.error = e

    @staticmethod
    def _verify_sample_from(logits: torch.Tensor, step: SequenceStep) -> torch.Tensor:
        """What a verify step's rows sample from: each row's structured-output mask applied to ``logits`` in
        place (logprobs see it too, as a plain sample's), then the request's logits processors on a copy.

        Row j's mask is the grammar's after drafts 0..j-1 and its processors count those drafts
        (``SequenceStep.output_token_ids``), so every row is the one plain decoding would have sampled.
        """
        if step.token_bitmasks:
            apply_token_bitmasks(logits, list(step.token_bitmasks))
        rules = step.sampling.rules
        if rules is None:
            return logits
        num_rows = logits.shape[0]
        prompts = [step.prompt_token_ids] * num_rows
        outputs = list(step.output_token_ids) if step.output_token_ids else [()] * num_rows
        processed = apply_logits_rules(logits, [rules] * num_rows, prompts, outputs)
        sample_from = logits if processed is None else processed[0]
        if bool(torch.isneginf(sample_from.max(dim=-1).values).any()):
            raise NoTokenToSampleError()
        return sample_from

    def _sample_step(self, logits: torch.Tensor, steps: list[SequenceStep], results: list[StepResult]) -> None:
        """Sample every sequence that reached its last token this step into ``results``.

        ``logits`` ``[num_rows, vocab]``: one row per sample, in the order of
        ``steps`` and each one's forks (``_LogitRows``). One batched call
        normally. If it raises, each sequence (with its forks) is sampled
        alone with the random numbers the record carries, so a failure
        caused by one request's settings lands in that sequence's
        ``StepResult.error`` and the others get the tokens they would have had.
        """
        specs: list[SamplingSpec] = []  # one row per sample; forks share their parent's settings
        uniforms: list[float] = []
        history = _RowHistory()
        bitmasks: list[bytes] = []  # a row's structured-output mask; b"": none
        owners: list[int] = []  # the step entry of each row
        for i, s in enumerate(steps):
            if s.num_draft_tokens:
                continue  # a verify step: _verify_step samples its rows
            for j, u in enumerate(s.uniforms):
                specs.append(s.sampling)
                uniforms.append(u)
                history.prompts.append(s.prompt_token_ids)
                history.outputs.append(s.output_token_ids[j] if s.output_token_ids else ())
                bitmasks.append(s.token_bitmasks[j] if s.token_bitmasks else b"")
                owners.append(i)
        # first, as vLLM: the processors, the sampler and the logprobs all see the masked logits
        apply_token_bitmasks(logits, bitmasks)
        try:
            samples = self._sample(logits, specs, uniforms, history)
        except Exception:
            logger.warning("sampling the batch failed; sampling its %d sequences one by one", len(set(owners)))
            samples = None
        if samples is not None:
            for owner, sample in zip(owners, samples):
                results[owner].samples.append(sample)
            return
        for i in sorted(set(owners)):
            mine = [r for r, owner in enumerate(owners) if owner == i]
            try:
                results[i].samples = self._sample(
                    logits[mine], [specs[r] for r in mine], [uniforms[r] for r in mine], history.select(mine)
                )
            except NoTokenToSampleError as e:  # the request's own settings: it ends, nothing failed
                logger.info("sequence %s has no token left to sample", steps[i].request_id)
                results[i].error = e
            except Exception as e:
                logger.exception("sequence %s failed while sampling", steps[i].request_id)
                results[i].error = e


@dataclass
class _LogitRows:
    """Which rows of a step's hidden states need logits.

    ``hidden_rows``, computed in one LM-head call: first one row per sample
    (each sequence's last token, once per fork), then every new token of the
    verify steps. ``prompt_rows``: each prompt-logprobs sequence's scored
    tokens, whose logits are computed a few rows at a time
    (``runner/prompt_scoring.py``): target ``j`` of a sequence is scored by
    the logits of its step token ``j`` (position ``num_computed_tokens + j``).
    Plain data from the record and metadata, so every tensor-parallel rank
    computes the same rows.
    """

    hidden_rows: list[int]
    num_sampled: int
    prompt_rows: dict[int, tuple[int, int]]  # step entry -> its [start, stop) in the hidden states
    # verify steps (speculative decoding): every new token's row in the logits, after the sampled rows
    verify_rows: dict[int, tuple[int, int]] = field(default_factory=dict)

    @classmethod
    def of(cls, steps: list[SequenceStep], meta: AttentionMetadata) -> _LogitRows:
        rows = [
            int(meta.query_start_loc[i + 1]) - 1 for i, s in enumerate(steps) if not s.num_draft_tokens
            for _ in s.uniforms
        ]
        num_sampled = len(rows)
        prompt_rows: dict[int, tuple[int, int]] = {}
        verify_rows: dict[int, tuple[int, int]] = {}
        for i, s in enumerate(steps):
            if s.prompt_logprobs is not None:
                start = int(meta.query_start_loc[i])
                prompt_rows[i] = (start, start + len(s.prompt_targets))
        for i, s in enumerate(steps):
            if s.num_draft_tokens:
                start, stop = int(meta.query_start_loc[i]), int(meta.query_start_loc[i + 1])
                verify_rows[i] = (len(rows), len(rows) + stop - start)
                rows += range(start, stop)
        return cls(rows, num_sampled, prompt_rows, verify_rows)


@dataclass
class _RowHistory:
    """The token ids each sampled row's logits processors read: empty unless its rules need them."""

    prompts: list[tuple[int, ...]] = field(default_factory=list)
    outputs: list[tuple[int, ...]] = field(default_factory=list)

    def select(self, rows: list[int]) -> _RowHistory:
        return _RowHistory([self.prompts[r] for r in rows], [self.outputs[r] for r in rows])
