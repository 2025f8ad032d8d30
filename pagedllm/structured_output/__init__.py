"""Structured outputs: constraint limits, compiles in killable worker processes, and per-request grammar state.

::

    limits.py           GrammarLimits: what a constraint may cost; the cheap structural checks
    compile_workers.py  compiles first run in worker processes, stopped by time, memory or cancel
    compiler.py         GrammarCompiler: one per engine, compiles each distinct constraint once (cached)
    grammar_state.py    RequestGrammar: a matcher per sequence of a constrained request
    lazy_xgrammar.py    xgrammar, imported on the first constrained request

The engine and the server use it; the runner only applies the packed masks
it produces (``runner/logits_processors.apply_token_bitmasks``) and never
imports it. Importing this package imports neither torch nor xgrammar.
"""

from pagedllm.structured_output.compiler import CompileCancelled, GrammarCompiler, choice_grammar
from pagedllm.structured_output.grammar_state import (
    GrammarRejectedError,
    GrammarSequence,
    RequestGrammar,
)
from pagedllm.structured_output.limits import GrammarLimitError, GrammarLimits

__all__ = [
    "CompileCancelled", "GrammarCompiler", "GrammarLimitError", "GrammarLimits", "GrammarRejectedError",
    "GrammarSequence", "RequestGrammar", "choice_grammar",
]
