"""Compiling structured-output constraints with xgrammar: one ``GrammarCompiler`` per engine.

It holds the tokenizer's xgrammar info (built on first use) and the compiled
grammars, cached by the constraint's key, within ``GrammarLimits``; it is
thread-safe, so the server compiles on a worker thread before the request
reaches the engine, which then finds the grammar cached. A compile first runs
in a worker process (``compile_workers.py``) where it can be stopped.

The per-request state a compiled grammar drives (a matcher per sequence)
is ``grammar_state.RequestGrammar``; what a step hands the runner is plain
bytes (``SequenceStep.token_bitmasks``), so the runner never imports this package.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.compile_workers import (
    CompileCancelled,
    CompileWorkers,
    ConstraintError,
    choice_grammar,
    compile_key,
    xgrammar_message,
)
from pagedllm.structured_output.lazy_xgrammar import xgrammar
from pagedllm.structured_output.limits import GrammarLimits, check_constraint

__all__ = ["CompileCancelled", "GrammarCompiler", "choice_grammar"]

if TYPE_CHECKING:
    import xgrammar as xgr



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
