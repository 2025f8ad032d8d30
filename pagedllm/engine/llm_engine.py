"""The engine loop: add requests, step, collect outputs.

A thin coordinator. Each ``step()``::

    Scheduler.schedule()  -> SchedulerOutput   (who runs, which blocks)
    StepRecordBuilder     -> StepRecord        (plain data: new sequences whole, then what changed)
    ModelRunner.execute() -> sampled tokens    (slot mapping, attention, sampler)
    Scheduler.update()                          (tokens now in the cache)
    OutputProcessor / apply_beam_step           (append, detokenize, stop; beams fork)
    -> RequestOutput for every request that moved
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import random
import threading
import time

from pagedllm.config import EngineConfig
from pagedllm.distributed.group import DistributedError
from pagedllm.engine.beam_search import BeamSearch, BeamSearchParams, apply_beam_step
from pagedllm.engine.block_manager import BlockManager
from pagedllm.engine.contiguous_allocator import ContiguousAllocator
from pagedllm.engine.inputs import InputProcessor, check_first_token, check_prompt_len
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.request import Request
from pagedllm.engine.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from pagedllm.engine.sequence import Sequence, SequenceStatus
from pagedllm.engine.step_budget import StepCostModel
from pagedllm.engine.step_builder import StepRecordBuilder
from pagedllm.kv_disk.open_store import open_kv_disk_store, open_state_disk_store
from pagedllm.kv_groups import model_kv_layout
from pagedllm.loader import iter_weights, load_model_config
from pagedllm.loader.generation_defaults import load_generation_defaults
from pagedllm.loader.tokenizer import Tokenizer
from pagedllm.outputs import RequestOutput
from pagedllm.resolved_config import resolve_config
from pagedllm.runner.executor import TensorParallelExecutor
from pagedllm.runner.model_runner import ModelRunner
from pagedllm.runner.process_settings import apply_process_settings
from pagedllm.runner.tp_workers import end_worker_process, is_torchrun_worker, serve_torchrun_rank
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.spec_decode.draft_model import DraftModelProposer
from pagedllm.spec_decode.speculator import Speculator
from pagedllm.step_record import LogitsRules, NoTokenToSampleError
from pagedllm.step_result import StepResult, TokenLogprobs
from pagedllm.step_time import StepTimeModel
from pagedllm.structured_output.compiler import GrammarCompiler
from pagedllm.structured_output.grammar_state import GrammarRejectedError, RequestGrammar

logger = logging.getLogger(__name__)


class _GrammarCutDrafts:
    """The speculator's drafts for a decode, cut before the first token the request's grammar rejects.

    Sits between the scheduler and the ``Speculator`` (the scheduler's
    ``DraftSource``); the cut happens inside ``Speculator.propose``, before the
    cost model weighs the drafts and counts them into the step, and before
    they take slots: a
    structured-output sequence verifies only drafts its grammar allows, each
    row under the mask of its position (``RequestGrammar.verify_bitmasks``).
    """

    def __init__(self, speculator: Speculator, requests: dict[str, Request]) -> None:
        self.speculator = speculator
        self.requests = requests

    def propose(self, seq: Sequence, max_num_tokens: int, batch_size: int) -> list[int]:
        """``Speculator.propose``'s drafts, cut to what a constrained request's grammar allows."""
        req = self.requests.get(seq.request_id)
        grammar = req.grammar if req is not None else None
        allow = (lambda drafts: grammar.valid_drafts(seq, drafts)) if grammar is not None else None
        return self.speculator.propose(seq, max_num_tokens, batch_size, allow)


class LLMEngine:
    """Continuous-batching engine over a paged KV cache.

    With ``tensor_parallel_size > 1`` the engine is rank 0: it starts the
    other ranks (or meets those torchrun started) and its runner drives
    them. In a torchrun rank other than 0, constructing the engine serves
    rank 0's steps and then ends the process (exit status 0, without the
    interpreter's finalization: ``end_worker_process``) when rank 0
    shuts down: the same script runs on every rank. Call ``shutdown()`` to
    stop the ranks before the process ends.

    Args:
        config: the validated engine configuration.
    """

    def __init__(self, config: EngineConfig) -> None:
        if is_torchrun_worker(config):
            # a torchrun rank other than 0 only serves rank 0's steps; when rank 0 stops, so does this process
            serve_torchrun_rank(config)
            end_worker_process(0)
        self.config = config
        # every "auto" resolved once, before anything loads (a combination it refuses fails here)
        self.resolved_config = resolve_config(config)
        self.model_config = load_model_config(config.model)
        if config.max_model_len > self.model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len={config.max_model_len} exceeds the model's "
                f"max_position_embeddings={self.model_config.max_position_embeddings}"
            )
        # the model's sampling defaults (generation_config.json), which the entry points apply to what a request
        # leaves unset; read before the weights, so a file with a bad value stops the start at once
        self.generation_defaults = load_generation_defaults(config.model, config.generation_config)
        self.tokenizer = Tokenizer(config.tokenizer or config.model, self.model_config.eos_token_ids)
        # tensor parallelism: the other ranks and their lifecycle (runner/executor.py); None in one process
        self.executor: TensorParallelExecutor | None = None
        if config.tensor_parallel_size > 1:
            self.executor = TensorParallelExecutor(config, self.model_config)
        else:
            apply_process_settings(config)
        try:
            self.model_runner = ModelRunner(
                config, self.model_config, iter_weights(config.model, self.model_config),
                self.executor.group if self.executor is not None else None,
            )
        except BaseException:
            if self.executor is not None:
                self.executor.stop(graceful=False)
            raise
        # the runner sized the KV pool and, where fit_max_model_len allows, lowered max_model_len to what it
        # holds (resolved_config.plan_kv_pool): from here on the engine runs under that config
        self.config = config = self.model_runner.config
        self.inputs = InputProcessor(self.tokenizer, self.model_config.vocab_size, config.max_model_len)
        num_blocks = self.model_runner.num_kv_blocks
        # the prefix cache on disk (kv_disk/): blocks outlive RAM eviction and restarts; None when off
        self.kv_disk = open_kv_disk_store(config, self.model_config, self.model_runner)
        # a hybrid model's state snapshots beside them, so its disk hits have the state at their end
        self.state_disk = open_state_disk_store(config, self.model_config, self.model_runner)
        if config.kv_allocator == "contiguous":
            if model_kv_layout(self.model_config).num_groups > 1:
                raise ValueError("kv_allocator='contiguous' holds one block table per sequence; this model's "
                                 "sliding-window layers need one per KV cache group (use kv_allocator='paged')")
            if self.model_runner.num_state_slots:
                raise ValueError("kv_allocator='contiguous' has no state slots: a hybrid model needs 'paged'")
            self.block_manager: BlockManager | ContiguousAllocator = ContiguousAllocator(num_blocks, config.block_size)
        else:
            # a longrope model's long prompts rotate their keys their own way: their own prefix-cache chain;
            # one block table per KV cache group: sliding-window groups give back what leaves their window;
            # a hybrid model's sequences hold a state slot each (engine/state_slots.py)
            self.block_manager = BlockManager(num_blocks, config.block_size, config.prefix_caching,
                                              self.model_config.longrope_switch_len, self.kv_disk,
                                              model_kv_layout(self.model_config).windows,
                                              self.model_runner.num_state_slots,
                                              self.model_runner.num_snapshot_slots,
                                              self.model_runner.num_checkpoint_slots,
                                              state_snapshot_interval=self.resolved_config.state_snapshot_interval,
                                              state_disk=self.state_disk)
        # every timed step fitted into one model of a step's time (step_time.py), which the prefill cap
        # and the drafting cost both read
        self.step_times = StepTimeModel()
        # the prompt tokens a step may add to running decodes, from the fitted step time (None: no target)
        self.step_costs: StepCostModel | None = None
        if self.resolved_config.itl_auto or self.resolved_config.itl_target_ms is not None:
            self.step_costs = StepCostModel(self.resolved_config.itl_target_ms, self.step_times)
        # speculative decoding: drafts for decodes, verified in the same step (docs/speculative-decoding.md)
        self.speculator: Speculator | None = None
        self.draft_proposer: DraftModelProposer | None = None
        spec = config.speculative_config
        if spec is not None:
            if spec.method == "draft_model":
                self.draft_proposer = DraftModelProposer.build(
                    config, spec.model, self.tokenizer.hf.get_vocab(), type(self)
                )
            self.speculator = Speculator(
                spec, config.max_model_len, self.draft_proposer.propose if self.draft_proposer is not None else None,
                self.step_times,
            )
        self.requests: dict[str, Request] = {}
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
            self.step_costs.max_prefill_tokens if self.step_costs is not None else None,
            _GrammarCutDrafts(self.speculator, self.requests) if self.speculator is not None else None,
        )
        # what the runner holds of each sequence: each step's record sends only what changed
        self.step_records = StepRecordBuilder()
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler, config.max_model_len)
        # structured outputs: the tokenizer's xgrammar info and the compiled constraints, once per engine
        self.grammar_compiler = GrammarCompiler(
            self.tokenizer, self.model_config.vocab_size, sorted(self.tokenizer.eos_token_ids),
            config.grammar_limits,
        )
        self._rng = random.Random(config.seed)
        self._arrivals = itertools.count()
        self._request_ids = itertools.count()
        # statistics for benchmarks and metrics
        self.num_generated_tokens = 0
        self.num_prompt_tokens_computed = 0
        self.peak_used_blocks = 0
        # whether the last step() ran the model (False: nothing was schedulable)
        self.last_step_scheduled = False

    # --- requests ------------------------------------------------------------
    def new_request_id(self) -> str:
        return str(next(self._request_ids))

    def process_prompt(
        self, prompt: str | dict, params: SamplingParams | None = None
    ) -> tuple[str | None, list[int]]:
        """Text or token ids -> (text or None, validated token ids).

        With ``params``, the prompt plus ``params.max_tokens`` must fit in
        ``max_model_len`` too: the one rule of the offline API and the server
        (``ContextLengthError``, a ValueError); ``params.truncate_prompt_tokens``
        keeps the last k token ids first (the text stays as given). The rules
        are ``engine/inputs.py``'s, which the server's ``PromptEncoder`` applies too.
        """
        return self.inputs.process_prompt(prompt, params)

    def check_prompt_len(self, num_prompt_tokens: int, params: SamplingParams | None = None) -> None:
        """Raise ContextLengthError unless the prompt (plus ``params.max_tokens``) fits in max_model_len.

        Reads only the configuration, so any thread may call it.
        """
        check_prompt_len(num_prompt_tokens, params, self.config.max_model_len)

    def logits_rules(self, params: SamplingParams) -> LogitsRules | None:
        """The request's logits processors against this model's tokenizer and vocabulary.

        Raises ValueError for token ids outside the vocabulary (``logit_bias``,
        ``allowed_token_ids``) and bad words that tokenize to nothing.
        """
        return self.inputs.logits_rules(params)

    def compile_grammar(
        self, params: SamplingParams, cancel: threading.Event | None = None
    ) -> RequestGrammar | None:
        """The grammar state of a request with ``params``; None without a structured-output constraint.

        Compiles the constraint (once per distinct constraint: cached), so a
        bad schema, regex or grammar, or one over ``config.grammar_limits``,
        is a ValueError here. Reads only the compiler, which is thread-safe:
        the server calls it on a worker thread first (``cancel`` stops the
        compile: CompileCancelled), and the engine thread then finds it cached.
        """
        if params.structured_outputs is None:
            return None
        compiled = self.grammar_compiler.compile(params.structured_outputs, cancel)
        return RequestGrammar(compiled, self.model_config.vocab_size)

    def add_request(
        self, request_id: str, prompt: str | dict, params: SamplingParams | None = None
    ) -> None:
        """Validate and queue a request; ValueError leaves the engine unchanged."""
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {type(request_id).__name__}")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if params.num_samples > 1 and self.config.kv_allocator == "contiguous":
            raise ValueError("n > 1 and best_of need block sharing, which the contiguous allocator lacks")
        if params.num_samples > self.config.max_num_seqs:
            raise ValueError(
                f"the request runs {params.num_samples} sequences (n/best_of), more than "
                f"max_num_seqs={self.config.max_num_seqs}"
            )
        text, ids = self.process_prompt(prompt, params)
        rules = self.logits_rules(params)
        if rules is not None and rules.thinking is not None:
            # the template may have opened the reasoning block in the prompt (budget counted from the output's start)
            rules = dataclasses.replace(rules, thinking=rules.thinking.with_prompt(ids))
        grammar = self.compile_grammar(params)
        if grammar is not None and rules is not None and rules.thinking is not None and rules.thinking.opened:
            if self.speculator is not None:
                raise ValueError("thinking_token_budget with structured outputs on a reasoning block the prompt "
                                 "opened is not served with speculative decoding (drafts would cross the block's end)")
            grammar.starts_at = rules.thinking.grammar_start  # the model thinks freely; the grammar holds after
        else:
            check_first_token(rules, grammar)
        req = Request(
            request_id, text, ids, params, self.config.block_size, self._rng, next(self._arrivals)
        )
        req.rules = rules
        req.grammar = grammar
        if self.config.contiguous_reserve == "max_tokens" and params.max_tokens is not None:
            reserve = min(len(ids) + params.max_tokens, self.config.max_model_len)
        else:
            reserve = self.config.max_model_len
        for seq in req.seqs:
            seq.reserve_len = reserve
        if self.speculator is not None and getattr(params, "pooling_type", None) is None:
            # every sample (n, best_of) speculates on its own; the runner applies the logits processors at
            # each verify position with the drafts before it counted, and a grammar's mask of that position
            # (drafts it rejects are cut before verify), so all stay lossless (docs/speculative-decoding.md).
            # Beam search never registers: its beams decode plainly
            req.speculates = True
            max_len = len(ids) + params.max_tokens if params.max_tokens is not None else None
            for seq in req.seqs:
                self.speculator.register(seq, req.speculates, max_len)
        self.requests[request_id] = req
        self.scheduler.add(req.seqs[0])  # the others are forked from it at admission

    def add_beam_search_request(
        self, request_id: str, prompt: str | dict, params: BeamSearchParams
    ) -> None:
        """Queue a beam-search request; it yields one RequestOutput, at the end."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be BeamSearchParams, got {type(params).__name__}")
        if self.config.kv_allocator == "contiguous":
            raise ValueError("beam search needs block sharing, which the contiguous allocator lacks")
        if params.beam_width > self.config.max_num_seqs:
            raise ValueError(f"beam_width {params.beam_width} exceeds max_num_seqs={self.config.max_num_seqs}")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self.process_prompt(prompt)
        eos = frozenset(self.tokenizer.eos_token_ids)
        beam = BeamSearch(params, len(ids), self.config.max_model_len, eos)
        # beams take the greedy path through the runner and report their
        # top-K next tokens; the search, not the sampler, picks what follows
        inner = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
        req = Request(request_id, text, ids, inner, self.config.block_size, self._rng, next(self._arrivals))
        req.beam = beam
        req.num_top_logprobs = beam.num_candidates  # may exceed what SamplingParams.logprobs allows
        # the beams it will fork count against max_num_seqs from admission on
        req.seqs[0].num_reserved_seqs = params.beam_width
        beam.start(req.seqs[0])
        self.requests[request_id] = req
        self.scheduler.add(req.seqs[0])

    def abort_request(self, request_id: str | list[str]) -> None:
        """Stop requests now and free their blocks; unknown ids are ignored."""
        self._abort(request_id)
        self._give_back_kv_pages()

    def _abort(self, request_id: str | list[str]) -> None:
        """``abort_request`` without giving pages back (a failed step's requests: the runner may be gone)."""
        ids = [request_id] if isinstance(request_id, str) else request_id
        for rid in ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            for seq in req.seqs:
                if not seq.is_finished:
                    self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
            self._finish_speculation(req)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use stay); with no request left, their pages go back to the OS."""
        self.block_manager.reset_prefix_cache()
        self._give_back_kv_pages()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # --- the loop ------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and leave their group; no step may run after this (one process: no-op)."""
        if self.draft_proposer is not None:
            self.draft_proposer.engine.shutdown()
        if self.kv_disk is not None:
            self.kv_disk.close()
        if self.state_disk is not None:
            self.state_disk.close()
        if self.executor is not None:
            self.executor.shutdown()

    @property
    def dead(self) -> DistributedError | None:
        """Why no step may run again: a tensor-parallel rank failed or the engine shut down; None in one process."""
        return self.executor.dead if self.executor is not None else None

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; return outputs of requests that progressed (``DistributedError``, now
        and on every later call, once a tensor-parallel rank has failed).

        Three phases: ``_schedule`` (the bookkeeping decides which tokens run),
        ``_execute`` (the runner computes them from a plain ``StepRecord``) and
        ``_process`` (sampled tokens become text, finished requests leave).
        """
        if self.executor is not None:
            self.executor.check()
        started = time.perf_counter()
        num_traces = self.model_runner.num_decode_traces
        output = self._schedule()
        if output.is_empty:
            # an empty step right after a preemption is normal: admissions wait
            # for the next one; without a preemption it is a stall
            return self._resolve_stall() if self.requests and not output.preempted else []
        if self.model_runner.capture_waits and self._decode_steps_ahead() >= self.config.capture_min_decode_steps:
            self.model_runner.warm_up()  # the trace now pays for itself (EngineConfig.capture_min_decode_steps)
        results = self._execute(output)
        outputs = self._process(output, results)
        # a step that traced the decode is no step's cost
        traced = self.model_runner.num_decode_traces != num_traces
        self._observe_step(output, None if traced else time.perf_counter() - started)
        self._give_back_kv_pages()
        return outputs

    def _decode_steps_ahead(self) -> int:
        """The most decode steps the unfinished requests may still take (``max_tokens``, else up to
        ``max_model_len``): an upper bound, as EOS or a stop string may end them sooner."""
        ahead = 0
        for req in self.requests.values():
            for seq in req.seqs:
                if seq.is_finished:
                    continue
                limit = req.params.max_tokens
                if limit is None:
                    limit = self.config.max_model_len - len(req.prompt_token_ids)
                ahead = max(ahead, limit - seq.num_output_tokens)
        return ahead

    def _give_back_kv_pages(self) -> None:
        """Once no request is left, the pages of blocks that hold nothing go back to the OS.

        The pool stays reserved; only blocks written since they were last given
        back and now empty (not cached prefixes) are released (``runner/kv_cache.py``),
        by a record that runs nothing, so every tensor-parallel rank releases them too.
        """
        if self.requests or self.dead is not None:
            return
        ranges = self.block_manager.take_releasable()
        if ranges or self.step_records.num_held:
            # the runner also drops the states of the sequences that just finished
            record = self.step_records.release(ranges)
            try:
                self.model_runner.execute(record)
            except BaseException:
                self.step_records.not_delivered(record)
                raise

    def _schedule(self) -> SchedulerOutput:
        """The scheduler's plan for this step (blocks allocated, preemptions done)."""
        # blocks published by a plan that never ran (its schedule raised) must not be hit
        self.block_manager.unpublish_unconfirmed()
        if self.draft_proposer is not None:
            # the draft model drafts for every decode this step may plan, in one batched run
            decodes = [s for s in self.scheduler.running
                       if s.status == SequenceStatus.RUNNING and len(s) - s.num_computed_tokens == 1]
            self.speculator.prepare(decodes, len(self.scheduler.running))
        output = self.scheduler.schedule()
        self.last_step_scheduled = False
        if not output.is_empty:
            self.peak_used_blocks = max(self.peak_used_blocks, self.block_manager.num_used_blocks)
        return output

    def _execute(self, output: SchedulerOutput) -> list[StepResult]:
        """Run ``output`` on the model runner; on failure its requests fail (their blocks freed) and it raises."""
        reqs = [self.requests[s.seq.request_id] for s in output.scheduled]
        params = [r.params for r in reqs]
        num_top = [r.num_top_logprobs for r in reqs]
        rules = [r.rules for r in reqs]
        bitmasks = self._bitmasks(output, reqs)
        for seq in output.preempted:
            req = self.requests.get(seq.request_id)
            if req is not None and req.beam is not None:
                req.beam.results.pop(seq.seq_id, None)  # recomputed later, reported again
        self.last_step_scheduled = True
        record = None
        try:
            record = self.step_records.build(output, params, num_top, rules, bitmasks)
            results = self.model_runner.execute(record)
        except BaseException as e:
            if record is not None:
                self.step_records.not_delivered(record)
            # the step is lost, not the engine (unless a tensor-parallel rank failed): its requests fail so
            # their blocks return to the pool; blocks it published to the prefix cache were never written,
            # so they leave the cache. Then the caller sees the error (KeyboardInterrupt included).
            self.block_manager.unpublish_unconfirmed()
            for s in output.scheduled:
                self._abort(s.seq.request_id)
            if isinstance(e, DistributedError) and self.executor is not None:
                self.executor.fail(e)
            raise
        self.block_manager.confirm_published()
        self._save_to_disk()
        self.scheduler.update(output)
        return results

    def _save_to_disk(self) -> None:
        """Hand the blocks the step computed and published to the disk store: their K/V is copied out of the
        pool now (the blocks may be reused by the next step), and written by the store's own thread. A hybrid
        model's state snapshots the step took go to the state store the same way."""
        if self.kv_disk is None:
            return
        saves = self.block_manager.take_saves()
        if saves:
            for (_, h, tokens), payload in zip(saves, self.model_runner.read_blocks([b for b, _, _ in saves])):
                self.kv_disk.write(h, tokens, payload)
        if self.state_disk is not None:
            states = self.block_manager.take_state_saves()
            slots = [slot for slot, _, _ in states]
            for (_, h, tokens), payload in zip(states, self.model_runner.read_state_slots(slots)):
                self.state_disk.write(h, tokens, payload)

    def _process(self, output: SchedulerOutput, results: list[StepResult]) -> list[RequestOutput]:
        """Append each sequence's sampled tokens, apply beam steps, and make the step's outputs."""
        touched: dict[str, Request] = {}
        # a sequence whose settings leave no token to sample ends there; its request goes on (n > 1)
        ended: set[int] = set()
        for i, (s, r) in enumerate(zip(output.scheduled, results)):
            req = self.requests[s.seq.request_id] if isinstance(r.error, NoTokenToSampleError) else None
            if req is not None and req.beam is None:  # a beam search cannot end one beam alone
                self._end_without_token(req, s)
                touched[req.request_id] = req
                ended.add(i)
        # a sequence that failed alone (a bug, a beam's dead end) fails its request only
        failed = {
            s.seq.request_id: r.error
            for i, (s, r) in enumerate(zip(output.scheduled, results)) if r.error is not None and i not in ended
        }
        for i, (s, result) in enumerate(zip(output.scheduled, results)):
            if s.is_prefill:
                self.num_prompt_tokens_computed += s.num_new_tokens
            if i in ended:
                continue
            if s.seq.request_id in failed:
                s.seq.discard_draft_tokens()  # never part of the output
                continue
            req = self.requests[s.seq.request_id]
            if result.prompt_logprobs is not None:
                self._add_prompt_logprobs(req, result)
            if getattr(req.params, "pooling_type", None) is not None:
                error = self._add_pooled(req, s, result)  # a pooling prefill: nothing sampled
                if error is not None:  # this request's alone
                    failed[req.request_id] = error
                    continue
                touched[req.request_id] = req
                continue
            if s.num_draft_tokens:
                try:
                    self._apply_verify_step(req, s, result)
                except GrammarRejectedError as e:  # this request's alone
                    failed[req.request_id] = e
                    continue
                touched[req.request_id] = req
                continue
            for seq, sample in zip((s.seq, *s.forks), result.samples):
                if req.beam is not None:
                    req.beam.add_result(seq, list(sample.top))
                else:
                    try:
                        self._append_sample(req, seq, sample)
                    except GrammarRejectedError as e:  # this request's alone
                        failed[req.request_id] = e
                        break
                    self.num_generated_tokens += 1
                touched[req.request_id] = req
        for rid in failed:
            touched.pop(rid, None)
        for req in touched.values():
            if req.beam is not None and req.beam.ready:
                self.num_generated_tokens += apply_beam_step(req, self.scheduler)
        outputs = [self._fail_request(rid, error) for rid, error in failed.items()]
        for req in touched.values():
            if req.is_finished:
                del self.requests[req.request_id]
                self._finish_speculation(req)
                outputs.append(self.output_processor.make_output(req))
                outputs[-1].pooled = req.pooled
            elif (req.beam is None and req.params.num_samples == req.params.n
                  and req.params.output_kind is not RequestOutputKind.FINAL_ONLY):
                # with best_of > n the winners are known only at the end
                outputs.append(self.output_processor.make_output(req))
        return outputs

    def _apply_verify_step(self, req: Request, s: ScheduledSequence, result: StepResult) -> None:
        """A verify step ran: drop the drafts, append what it emitted (accepted drafts, then one sampled
        token) one at a time so every stop rule sees each, and roll the cache back to what is kept.

        The sequence ends computed up to its newest token, as after a plain
        decode: K/V of the kept drafts stays, slots of the rejected ones are
        reused, blocks only they used go back (``BlockManager.rollback``).
        """
        seq = s.seq
        drafts = seq.discard_draft_tokens()
        num_accepted = len(result.samples) - 1
        for sample in result.samples:
            self._append_sample(req, seq, sample)  # the grammar's matcher takes each token too
            self.num_generated_tokens += 1
            if seq.is_finished:
                break  # blocks already freed; later tokens are past a stop
        if not seq.is_finished:
            self.block_manager.rollback(seq, len(seq) - 1)
        req.num_drafts += 1
        req.num_draft_tokens += len(drafts)
        req.num_accepted_tokens += num_accepted
        if self.speculator is not None:
            self.speculator.observe(seq, len(drafts), num_accepted)

    def _finish_speculation(self, req: Request) -> None:
        """``req`` left: the speculator forgets its sequences (suffix decoding learns their outputs; beams'
        hypotheses are not outputs)."""
        if self.speculator is not None and req.beam is None:
            for seq in req.seqs:
                self.speculator.finish(seq)

    def _add_pooled(self, req: Request, s: ScheduledSequence, result: StepResult) -> ValueError | None:
        """Fold a pooling prefill's share into ``req.pooled``; the step that completes the prompt ends it.

        A "MEAN" share is a sum over the step's tokens: a prompt recomputed from position 0 (after a
        preemption) starts the sum again; the mean is taken at the end. Returns the error that fails the
        request (its prompt ended with nothing pooled: the runner and the engine disagree), else None.
        """
        if result.pooled is not None:
            if req.params.pooling_type != "MEAN" or req.pooled is None or result.pooled_start == 0:
                req.pooled = list(result.pooled)
            else:
                req.pooled = [a + b for a, b in zip(req.pooled, result.pooled)]
        if s.num_computed_tokens + s.num_new_tokens < s.seq.num_prompt_tokens:
            return None
        if req.pooled is None:
            return ValueError(f"pooling request {req.request_id} ended its prompt without pooled hidden states")
        if req.params.pooling_type == "MEAN":
            req.pooled = [v / s.seq.num_prompt_tokens for v in req.pooled]
        s.seq.stop_reason = None
        self.scheduler.finish(s.seq, SequenceStatus.FINISHED_STOPPED)
        return None

    def _add_prompt_logprobs(self, req: Request, result: StepResult) -> None:
        """A prompt in chunks brings its logprobs a chunk at a time; a recomputed one
        (after preemption) brings again what is already there."""
        if req.prompt_logprobs is None:
            req.prompt_logprobs = [None]
        for pos, t in enumerate(result.prompt_logprobs, start=result.prompt_logprobs_start):
            if pos == len(req.prompt_logprobs):
                req.prompt_logprobs.append(self.output_processor.position_logprobs(t))

    def _observe_step(self, output: SchedulerOutput, seconds: float | None) -> None:
        """Feed the step's wall time (schedule to outputs: what a decoding stream waited) to the step-time
        model that the prefill cap and the drafting cost read (None: the step's time is no step's cost)."""
        # a verify step (a decode with drafts) is a decode: its drafts are no prompt tokens to budget
        num_decodes = sum(1 for s in output.scheduled if not s.is_prefill and (s.num_new_tokens == 1 or s.num_draft_tokens))
        num_prompt = sum(s.num_new_tokens for s in output.scheduled if s.is_prefill or
                         (s.num_new_tokens > 1 and not s.num_draft_tokens))
        num_drafts = sum(s.num_draft_tokens for s in output.scheduled)
        if self.speculator is not None:
            self.speculator.end_step(num_drafts)
        if seconds is not None:
            self.step_times.observe(num_decodes, num_drafts, num_prompt, seconds)

    def _bitmasks(self, output: SchedulerOutput, reqs: list[Request]) -> list[tuple[bytes, ...]] | None:
        """The structured-output mask of every row the step samples; None when no request has a constraint."""
        if all(r.grammar is None for r in reqs):
            return None
        return [
            () if r.grammar is None or not s.samples
            else r.grammar.verify_bitmasks(s.seq, s.num_draft_tokens) if s.num_draft_tokens
            else tuple(r.grammar.bitmask(q) for q in (s.seq, *s.forks))
            for s, r in zip(output.scheduled, reqs)
        ]

    def _append_sample(self, req: Request, seq: Sequence, sample: TokenLogprobs) -> None:
        """Append a sampled token to ``seq``; a constrained sequence's matcher takes it first.

        When the grammar is terminated by the token (its stop token at its
        end) the sequence finishes with "stop", also where no other rule
        would end it (``ignore_eos``). GrammarRejectedError when the grammar
        does not allow the token.
        """
        terminated = req.grammar is not None and req.grammar.accept(seq, sample.token_id)
        self.output_processor.append_sample(req, seq, sample)
        if terminated and not seq.is_finished:
            seq.stop_reason = None
            self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
        if req.grammar is not None and seq.is_finished:
            req.grammar.release(seq.seq_id)

    def _end_without_token(self, req: Request, s: ScheduledSequence) -> None:
        """End ``s``'s sequence and forks, whose sampling settings leave no token: finish reason
        ``"no_valid_token"``, their output as it stands (a client's settings, not a failure)."""
        for seq in (s.seq, *s.forks):
            seq.discard_draft_tokens()
            if not seq.is_finished:
                seq.stop_reason = None
                self.scheduler.finish(seq, SequenceStatus.FINISHED_NO_VALID_TOKEN)
            if req.grammar is not None:
                req.grammar.release(seq.seq_id)

    def _fail_request(self, request_id: str, error: BaseException) -> RequestOutput:
        """End a request whose own computation raised: free its blocks, report it with ``error`` set."""
        req = self.requests.pop(request_id)
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
        self._finish_speculation(req)
        if req.beam is not None:
            req.beam.abort()
            req.beam_done = True
        out = self.output_processor.make_output(req)
        out.error = f"{type(error).__name__}: {error}"
        logger.error("request %s failed alone: %s", request_id, out.error)
        return out

    def _resolve_stall(self) -> list[RequestOutput]:
        """Nothing could be scheduled although requests are unfinished.

        Beam search gets here when admitted beams wait for siblings that the
        pool cannot admit (after a preemption the beams no longer share
        blocks): the newest such request is ended with finish_reason "abort",
        keeping the hypotheses found so far, and its blocks are freed.

        Without beams, a request that holds nothing still cannot start: a
        model with sliding-window KV cache groups needs a prompt step's blocks
        in every group at once, which a pool given by ``num_kv_blocks`` /
        ``kv_cache_memory_bytes`` may not hold (one group's worth of
        ``max_model_len`` is all ``fit_max_model_len`` checks). The oldest
        request fails alone with an error naming the ways out; the others go on.
        """
        stalled = [r for r in self.requests.values() if r.beam is not None]
        if not stalled:
            req = min(self.requests.values(), key=lambda r: r.seqs[0].arrival)
            bm = self.block_manager
            return [self._fail_request(req.request_id, ValueError(
                f"the KV pool ({bm.num_blocks} blocks of {self.config.block_size} tokens, {bm.num_groups} KV cache "
                f"group(s)) cannot hold this request's blocks with nothing else running; give the cache more "
                f"blocks (num_kv_blocks= / --num-kv-blocks, kv_cache_memory_bytes=) or compute prompts in "
                f"smaller steps (max_num_batched_tokens=)"))]
        req = max(stalled, key=lambda r: r.seqs[0].arrival)
        logger.warning("request %s: the KV pool cannot hold its %d beams; aborting it",
                       req.request_id, req.beam.params.beam_width)
        req.beam.abort()
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
        req.beam_done = True
        del self.requests[req.request_id]
        return [self.output_processor.make_output(req)]
