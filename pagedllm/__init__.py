"""pagedllm: a small LLM inference engine built on PagedAttention."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedllm.engine.beam_search import BeamSearchParams
from pagedllm.outputs import BeamSearchOutput, CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from pagedllm.engine.llm import LLM

__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "BeamSearchParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "BeamSearchOutput",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # LLM pulls in torch and transformers; importing the torch-free
    # bookkeeping (pagedllm.engine.*) must not
    if name == "LLM":
        from pagedllm.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
