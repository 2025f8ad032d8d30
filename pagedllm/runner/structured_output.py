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

import json
import re
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from pagedllm.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar as xgr



def xgrammar() -> Any:  # noqa: ANN401 - the module
    """xgrammar, imported on the first constrained request: it pulls in triton (~25 MiB resident, 0.1 s) that an
    engine serving no constraint never needs."""
    import xgrammar as xgr

    return xgr


# distinct constraints kept compiled; a server sees a few schemas again and again
GRAMMAR_CACHE_SIZE = 256
# "[10:54:14] /project/cpp/json_schema_converter.cc:5082: " before xgrammar's own message
_XGRAMMAR_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s+\S+:\d+:\s*")

_WHAT = {
    "json": "not a JSON schema xgrammar can compile",
    "regex": "not a valid regular expression",
    "choice": "not a valid list of choices",
    "grammar": "not a valid EBNF grammar",
    "json_object": "not compilable",
}


def _xgrammar_message(e: BaseException) -> str:
    """xgrammar's error text without the C++ source location it starts with."""
    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    return _XGRAMMAR_PREFIX.sub("", lines[0]) if lines else type(e).__name__


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices``.

    JSON string literals are EBNF string literals (the same escapes), so
    quotes, backslashes and control characters in a choice stay literal.
    """
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCompiler:
    """Compiles constraints against one tokenizer, each distinct constraint once.

    Args:
        hf_tokenizer: the Hugging Face tokenizer the engine decodes with.
        vocab_size: the model's vocabulary (logit rows), which may exceed
            the tokenizer's: the extra ids are never allowed.
        stop_token_ids: the ids that end an output (the engine's EOS ids):
            a complete grammar allows exactly these.

    ``compile`` may be called from any thread.
    """

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self._hf = hf_tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._lock = threading.Lock()
        self._compiler: xgr.GrammarCompiler | None = None
        self._cache: OrderedDict[tuple[str, str, bool], xgr.CompiledGrammar] = OrderedDict()
        self.num_compiled = 0  # cache misses, for tests and metrics

    def _get_compiler(self) -> xgr.GrammarCompiler:
        # the tokenizer info takes a pass over the vocabulary (~0.1 s): built on
        # the first constrained request, not at engine start
        with self._lock:
            if self._compiler is None:
                info = xgrammar().TokenizerInfo.from_huggingface(
                    self._hf, vocab_size=self.vocab_size, stop_token_ids=self._stop_token_ids
                )
                self._compiler = xgrammar().GrammarCompiler(info)
            return self._compiler

    def compile(self, constraint: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The compiled grammar of ``constraint``; ValueError naming the problem when it does not compile."""
        key = constraint.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiler = self._get_compiler()
        # compiled outside the lock: a long schema must not hold up other threads' cache hits
        try:
            compiled = self._compile(compiler, constraint)
        except (RuntimeError, TypeError, ValueError) as e:  # xgrammar's parse and conversion errors are RuntimeErrors
            kind = constraint.kind
            raise ValueError(f"structured_outputs.{kind} is {_WHAT[kind]}: {_xgrammar_message(e)}") from None
        with self._lock:
            self.num_compiled += 1
            self._cache[key] = compiled
            while len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    @staticmethod
    def _compile(compiler: xgr.GrammarCompiler, c: StructuredOutputsParams) -> xgr.CompiledGrammar:
        any_whitespace = not c.disable_any_whitespace
        kind = c.kind
        if kind == "json":
            return compiler.compile_json_schema(json.dumps(c.json), any_whitespace=any_whitespace)
        if kind == "json_object":
            # any object (not any JSON value, as xgrammar's builtin JSON grammar allows)
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace, strict_mode=False)
        if kind == "regex":
            return compiler.compile_regex(c.regex)
        if kind == "choice":
            return compiler.compile_grammar(choice_grammar(c.choice))
        return compiler.compile_grammar(c.grammar)


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

    def _synced(self, seq: GrammarSequence) -> xgr.GrammarMatcher:
        """The sequence's matcher, having accepted exactly its output tokens."""
        matcher = self._matchers.get(seq.seq_id)
        if matcher is None:
            matcher = self._matchers[seq.seq_id] = xgrammar().GrammarMatcher(self.compiled)
            self._accepted[seq.seq_id] = 0
        accepted, num_output = self._accepted[seq.seq_id], seq.num_output_tokens
        if accepted > num_output:
            matcher.rollback(accepted - num_output)
            accepted = num_output
        for token in seq.token_ids[seq.num_prompt_tokens + accepted :]:
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
