"""Structured outputs: compiling constraints with xgrammar, and the per-sequence grammar state.

Three pieces, each with its own owner::

    GrammarCompiler   one per engine: the tokenizer's xgrammar info (built on
                      first use) and the compiled grammars, cached by the
                      constraint's key; thread-safe, so the server compiles on
                      a worker thread before the request reaches the engine
    RequestGrammar    one per constrained request, owned by the engine's
                      Request: a GrammarMatcher per sequence id, in step with
                      that sequence's output tokens
    bitmask bytes     what a step hands the runner (``SequenceStep.token_bitmasks``):
                      one packed allowed-token mask per sampled row, plain bytes

A matcher follows its sequence's output, whatever happened to it: a fork of
``n > 1`` gets its own matcher, replayed from the tokens it has; after a
preemption the recomputed sequence keeps its tokens, so its matcher stands;
a sequence with fewer tokens than its matcher accepted rolls it back.

xgrammar imports torch; this module lives in the runner package, outside
``pagedllm/engine/``, so that the bookkeeping stays torch-free: the engine
only holds its objects, and hands them its sequences (anything with the
``GrammarSequence`` fields).
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.compile_workers import (
    CompileCancelled,
    CompileWorkers,
    ConstraintError,
    choice_grammar,
    compile_key,
    xgrammar_message,
)
from pagedllm.structured_output.limits import GrammarLimits, check_constraint

__all__ = [
    "CompileCancelled", "GrammarCompiler", "GrammarRejectedError", "GrammarSequence", "RequestGrammar",
    "choice_grammar", "xgrammar",
]

if TYPE_CHECKING:
    import xgrammar as xgr



def xgrammar() -> Any:  # noqa: ANN401 - the module
    """xgrammar, imported on the first constrained request: it pulls in triton (~25 MiB resident, 0.1 s) that an
    engine serving no constraint never needs."""
    import xgrammar as xgr

    return xgr


_WHAT = {
    "json": "not a JSON schema xgrammar can compile",
    "regex": "not a valid regular expression",
    "choice": "not a valid list of choices",
    "grammar": "not a valid EBNF grammar",
    "json_object": "not compilable",
}


class GrammarCompiler:
    """Compiles constraints against one tokenizer, each distinct constraint once, within ``GrammarLimits``.

    Args:
        hf_tokenizer: the Hugging Face tokenizer the engine decodes with, or
            pagedllm's ``Tokenizer`` (its ``.hf``, taken at the first compile).
        vocab_size: the model's vocabulary (logit rows), which may exceed
            the tokenizer's: the extra ids are never allowed.
        stop_token_ids: the ids that end an output (the engine's EOS ids):
            a complete grammar allows exactly these.
        limits: what a constraint may cost (structure, compile time and
            memory, compiles at once) and the cache's size in bytes.

    A compile first runs in a worker process (``compile_workers.py``) that is
    killed past the time or memory limit or on ``cancel``; only a
    constraint that compiled there is compiled here. ``compile`` may be
    called from any thread.
    """

    def __init__(
        self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: list[int],  # noqa: ANN401 - any HF tokenizer
        limits: GrammarLimits | None = None,
    ) -> None:
        self._hf = hf_tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self.limits = limits if limits is not None else GrammarLimits()
        self._lock = threading.Lock()
        self._compiler: xgr.GrammarCompiler | None = None
        self._info: xgr.TokenizerInfo | None = None
        self._cache: OrderedDict[tuple[str, str, bool], xgr.CompiledGrammar] = OrderedDict()
        self.cache_bytes = 0  # the cached grammars' memory_size_bytes, summed
        self.num_compiled = 0  # cache misses, for tests and metrics
        me = weakref.ref(self)  # the workers must not keep this compiler alive (its finalizer holds them)

        def info_json() -> str:
            compiler = me()
            if compiler is None:
                raise RuntimeError("the grammar compiler is gone")
            return compiler._info_json()

        self.workers = CompileWorkers(info_json, self.limits)
        # an engine dropped without close() still stops its workers
        self._release = weakref.finalize(self, self.workers.close)

    @property
    def num_cached(self) -> int:
        """Compiled grammars in the cache."""
        return len(self._cache)

    def _get_compiler(self) -> xgr.GrammarCompiler:
        # the tokenizer info takes a pass over the vocabulary (~0.1 s): built on
        # the first constrained request, not at engine start
        with self._lock:
            if self._compiler is None:
                # pagedllm's Tokenizer makes its transformers tokenizer here, at the first constrained request
                hf = getattr(self._hf, "hf", self._hf)
                info = xgrammar().TokenizerInfo.from_huggingface(
                    hf, vocab_size=self.vocab_size, stop_token_ids=self._stop_token_ids
                )
                # one thread: a compile must not take the cores generation runs on; no
                # cache of xgrammar's own (unbounded): ours is bounded by bytes
                self._compiler = xgrammar().GrammarCompiler(info, max_threads=1, cache_enabled=False)
                self._info = info
            return self._compiler

    def _info_json(self) -> str:
        """The tokenizer info as JSON, for a worker process (1.6 MB for SmolLM2's 49k tokens)."""
        self._get_compiler()
        return self._info.serialize_json()

    def _cached(self, key: tuple[str, str, bool]) -> xgr.CompiledGrammar | None:
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
            return hit

    def compile(
        self, constraint: StructuredOutputsParams, cancel: threading.Event | None = None
    ) -> xgr.CompiledGrammar:
        """The compiled grammar of ``constraint``.

        ValueError naming the problem when it does not compile, and
        GrammarLimitError (a ValueError) naming the limit and its flag when
        it is over one; CompileCancelled when ``cancel`` is set before it is done.
        """
        key = constraint.key
        check_constraint(constraint.kind, getattr(constraint, constraint.kind), key[1], self.limits)
        hit = self._cached(key)
        if hit is not None:
            return hit
        compiler = self._get_compiler()
        with self.workers.slot(cancel) as worker:
            hit = self._cached(key)  # compiled by another thread while this one waited
            if hit is not None:
                return hit
            try:
                self.workers.check(worker, key, cancel)
                if cancel is not None and cancel.is_set():
                    raise CompileCancelled("the request was cancelled while its grammar compiled")
                # it compiled in the worker within the limits: compiling it here takes as long
                compiled = compile_key(compiler, key)
            except (ConstraintError, RuntimeError, TypeError) as e:  # xgrammar's errors are RuntimeErrors
                kind = constraint.kind
                raise ValueError(f"structured_outputs.{kind} is {_WHAT[kind]}: {xgrammar_message(e)}") from None
        self._insert(key, compiled)
        return compiled

    def _insert(self, key: tuple[str, str, bool], compiled: xgr.CompiledGrammar) -> None:
        """Cache ``compiled``, dropping the least recently used grammars to stay within ``limits.cache_bytes``."""
        size = int(compiled.memory_size_bytes)
        if size > self.limits.cache_bytes:
            # uncached, the engine thread would compile it again when the request is added
            raise self.limits.refuse(f"structured_outputs.{key[0]} compiled to a grammar that", size, "cache_bytes",
                                     " bytes")
        with self._lock:
            self.num_compiled += 1
            if key in self._cache:
                return
            self._cache[key] = compiled
            self.cache_bytes += size
            while self.cache_bytes > self.limits.cache_bytes:
                _, old = self._cache.popitem(last=False)
                self.cache_bytes -= int(old.memory_size_bytes)

    def close(self) -> None:
        """Stop the compile workers (a later compile spawns them again)."""
        self.workers.close()


class GrammarSequence(Protocol):
    """What a matcher reads of a sequence (``engine.sequence.Sequence`` has it; the runner never imports it)."""

    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int

    @property
    def num_output_tokens(self) -> int: ...


class GrammarRejectedError(ValueError):
    """A sampled token the grammar does not accept (the mask was not applied, or nothing was allowed)."""


class RequestGrammar:
    """The grammar state of one constrained request: a matcher per sequence, keyed by sequence id.

    Each matcher remembers how many output tokens it accepted; ``bitmask``
    and ``accept`` first bring it in step with the sequence's output (a new
    fork replays its tokens; fewer tokens than accepted roll back).
    """

    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int) -> None:
        self.compiled = compiled
        self.vocab_size = vocab_size
        self._matchers: dict[int, xgr.GrammarMatcher] = {}
        self._accepted: dict[int, int] = {}
        # one row, reused: fill_next_token_bitmask writes into it
        self._row = np.empty((1, xgrammar().get_bitmask_shape(1, vocab_size)[1]), dtype=np.int32)  # [1, ceil(vocab / 32)]

    def _synced(self, seq: GrammarSequence, num_output: int | None = None) -> xgr.GrammarMatcher:
        """The sequence's matcher, having accepted exactly its first ``num_output`` output tokens (default: all;
        fewer leave out the drafts a sequence holds for a verify step)."""
        matcher = self._matchers.get(seq.seq_id)
        if matcher is None:
            matcher = self._matchers[seq.seq_id] = xgrammar().GrammarMatcher(self.compiled)
            self._accepted[seq.seq_id] = 0
        accepted = self._accepted[seq.seq_id]
        num_output = seq.num_output_tokens if num_output is None else num_output
        if accepted > num_output:
            matcher.rollback(accepted - num_output)
            accepted = num_output
        for token in seq.token_ids[seq.num_prompt_tokens + accepted : seq.num_prompt_tokens + num_output]:
            if not matcher.accept_token(token):
                raise GrammarRejectedError(f"the output's token {token} does not follow the structured output grammar")
            accepted += 1
        self._accepted[seq.seq_id] = accepted
        return matcher

    def bitmask(self, seq: GrammarSequence) -> bytes:
        """The packed allowed-token mask of the sequence's next token: int32 words, bit i of word w is token 32w+i.

        Empty when every token is allowed (nothing to apply).
        """
        matcher = self._synced(seq)
        if not matcher.fill_next_token_bitmask(self._row, 0):
            return b""
        return self._row.tobytes()

    def allows_first(self, token_ids: Iterable[int]) -> bool:
        """Whether the grammar lets an output start with any of ``token_ids`` (a fresh matcher's mask)."""
        matcher = xgrammar().GrammarMatcher(self.compiled)
        row = np.empty_like(self._row)
        if not matcher.fill_next_token_bitmask(row, 0):
            return True  # every token is allowed
        words = row[0].view(np.uint32)  # bit i of word w: token 32w + i
        return any(t < self.vocab_size and (int(words[t >> 5]) >> (t & 31)) & 1 for t in token_ids)

    def _walk_drafts(self, seq: GrammarSequence, num_output: int, drafts: list[int]) -> list[bytes]:
        """The masks plain decoding would apply at each draft position: mask j is the grammar's after drafts
        0..j-1. Stops at the first draft the grammar rejects (or after its stop token), so ``len(masks) - 1``
        drafts are valid and the last mask is that of the token after them. The matcher is rolled back."""
        matcher = self._synced(seq, num_output)
        masks: list[bytes] = []
        walked = 0
        for draft in drafts:
            if matcher.is_terminated():
                break  # a draft after the grammar's stop token: the output ends at that token anyway
            masks.append(self._next_mask(matcher))
            if not matcher.accept_token(draft):
                break
            walked += 1
        if len(masks) == walked:
            # the row after the last valid draft; after the stop token it is never appended (b"": any)
            masks.append(b"" if matcher.is_terminated() else self._next_mask(matcher))
        if walked:
            matcher.rollback(walked)
        return masks

    def _next_mask(self, matcher: xgr.GrammarMatcher) -> bytes:
        """The packed mask of ``matcher``'s next token; b"" when every token is allowed."""
        return self._row.tobytes() if matcher.fill_next_token_bitmask(self._row, 0) else b""

    def valid_drafts(self, seq: GrammarSequence, drafts: list[int]) -> list[int]:
        """``drafts`` (proposed after ``seq``'s tokens, not yet appended) cut before the first the grammar rejects."""
        return drafts[: len(self._walk_drafts(seq, seq.num_output_tokens, drafts)) - 1]

    def verify_bitmasks(self, seq: GrammarSequence, num_drafts: int) -> tuple[bytes, ...]:
        """The ``num_drafts + 1`` masks of a verify step of ``seq``, whose last ``num_drafts`` tokens are drafts
        the grammar allows (``valid_drafts`` cut them): row j's is the grammar's after drafts 0..j-1."""
        drafts = list(seq.token_ids[len(seq.token_ids) - num_drafts :])
        masks = self._walk_drafts(seq, seq.num_output_tokens - num_drafts, drafts)
        if len(masks) != num_drafts + 1:
            raise ValueError(f"sequence {seq.seq_id}: the grammar rejects draft {len(masks) - 1} of {num_drafts}")
        return tuple(masks)

    def accept(self, seq: GrammarSequence, token_id: int) -> bool:
        """Advance the sequence's matcher by its new ``token_id``, sampled after its current tokens.

        Returns whether the grammar is now terminated (it accepted a stop
        token at its end: the output is complete). GrammarRejectedError
        when the grammar does not allow the token.
        """
        matcher = self._synced(seq)
        if matcher.is_terminated() or not matcher.accept_token(token_id):
            raise GrammarRejectedError(f"the sampled token {token_id} does not follow the structured output grammar")
        self._accepted[seq.seq_id] += 1
        return matcher.is_terminated()

    def release(self, seq_id: int) -> None:
        """Forget a finished sequence's matcher."""
        self._matchers.pop(seq_id, None)
        self._accepted.pop(seq_id, None)
