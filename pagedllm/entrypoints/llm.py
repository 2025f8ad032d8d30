"""The offline API where vLLM has it (``vllm.entrypoints.llm``): re-exported from ``pagedllm.engine.llm``.

The class lives in ``engine/`` because the benchmarks, which the CLI
imports, run the engine through it; this module keeps the documented names
(``pagedllm.entrypoints.llm.RequestFailedError``) working.
"""

from __future__ import annotations

from pagedllm.engine.llm import LLM, PromptType, RequestFailedError, make_engine_config

__all__ = ["LLM", "PromptType", "RequestFailedError", "make_engine_config"]
